"""The built-in verifiers: an explicit list, not discovered.

``detect_tee`` sniffs evidence with each module's ``looks_like`` in a fixed order;
``build_verifiers`` constructs one verifier per TEE from the pinned trust roots. The simulated
TEE is only present when its platform keys are given explicitly: nothing infers "simulation".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cryptography.hazmat.primitives.asymmetric import ec

from certs.collateral.roots import TrustRoots
from certs.errors import EvidenceFormatError
from certs.evidence import nitro, nvidia_gpu, sev_snp, sgx_dcap, sim, tdx
from certs.evidence.claims import Tee, Verifier

SNIFFERS: tuple[tuple[Tee, Callable[[bytes], bool]], ...] = (
    (Tee.NITRO, nitro.looks_like),
    (Tee.NVIDIA_GPU, nvidia_gpu.looks_like),
    (Tee.SEV_SNP, sev_snp.looks_like),
    (Tee.TDX, tdx.looks_like),
    (Tee.SGX, sgx_dcap.looks_like),
    (Tee.SIM, sim.looks_like),
)
"""Every built-in format sniffer. Their magic bytes do not overlap; ``detect_tee`` still
refuses evidence that more than one claims."""


def detect_tee(evidence: bytes) -> Tee:
    """The TEE whose evidence format ``evidence`` has; EvidenceFormatError ``unknown_format``."""
    matches = [tee for tee, looks_like in SNIFFERS if looks_like(evidence)]
    if not matches:
        raise EvidenceFormatError("unknown_format", "no known evidence format")
    if len(matches) > 1:
        raise EvidenceFormatError("unknown_format", f"ambiguous: {', '.join(matches)}")
    return matches[0]


def build_verifiers(
    roots: TrustRoots, *, sim_keys: Sequence[ec.EllipticCurvePublicKey] | None = None
) -> dict[Tee, Verifier]:
    """One verifier per supported TEE, anchored at ``roots``.

    ``sim_keys`` (the simulated platforms' public keys) enables the simulated TEE; without it
    there is no sim verifier, so sim evidence is refused as unsupported.
    """
    verifiers: dict[Tee, Verifier] = {
        Tee.NITRO: nitro.NitroVerifier(roots.nitro),
        Tee.SEV_SNP: sev_snp.SevSnpVerifier(roots.amd_chains),
        Tee.TDX: tdx.TdxVerifier(roots.intel_sgx_root),
        Tee.SGX: sgx_dcap.SgxVerifier(roots.intel_sgx_root),
        Tee.NVIDIA_GPU: nvidia_gpu.NvidiaGpuVerifier(roots.nvidia),
    }
    if sim_keys:
        verifiers[Tee.SIM] = sim.SimVerifier(sim_keys)
    return verifiers
