"""Vendor trust roots shipped with attestmesh, loaded once and handed to verifiers as parameters.

The files in ``certs/collateral/roots/`` are the public vendor roots (and, for AMD, the KDS
``cert_chain`` bundles: ASK/ASVK then ARK). Each bundled root is checked against its published
SHA-256 fingerprint when loaded, so a corrupted or swapped file fails loudly. An operator may
point ``load_roots(directory)`` at a directory with the same file names to replace them; files
missing from that directory fall back to the bundled ones (and are still fingerprint-checked).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from certs.errors import CollateralError, EvidenceFormatError
from certs.evidence.x509chain import parse_certificates

NITRO_ROOT = "aws_nitro_enclaves_root_g1.pem"
AMD_CHAINS = ("ask_ark_milan.pem", "ask_ark_genoa.pem", "asvk_ark_milan_vlek.pem")
INTEL_SGX_ROOT = "Intel_SGX_RootCA.der"
NVIDIA_ROOT = "nvidia_device_identity_root.pem"

# SHA-256 of the root certificate's DER (for AMD bundles: of the ARK, the last certificate).
FINGERPRINTS: Mapping[str, str] = {
    NITRO_ROOT: "641a0321a3e244efe456463195d606317ed7cdcc3c1756e09893f3c68f79bb5b",
    "ask_ark_milan.pem": "69d063b45344d26a2e94e1f4210de49ef555308287d4c174445c95639a540bcd",
    "ask_ark_genoa.pem": "4c6598d19c18719c5dfd4a7d335f674e5bfe1d8f800cea2cf270c10d103db2f1",
    "asvk_ark_milan_vlek.pem": "69d063b45344d26a2e94e1f4210de49ef555308287d4c174445c95639a540bcd",
    INTEL_SGX_ROOT: "44a0196b2b99f889b8e149e95b807a350e7424964399e885a7cbb8ccfab674d3",
    NVIDIA_ROOT: "102bf659d5419614c9d8e6aecebc80454eb26b1df6a769ac720b9a690b167b48",
}


@dataclass(frozen=True, slots=True)
class TrustRoots:
    """Pinned vendor trust anchors, as the bytes each verifier's constructor takes."""

    nitro: bytes
    """AWS Nitro Enclaves Root G1 (PEM)."""
    amd_chains: tuple[bytes, ...]
    """AMD KDS cert_chain bundles (PEM, ASK or ASVK first, then the ARK)."""
    intel_sgx_root: bytes
    """Intel SGX Root CA (DER); anchors both SGX and TDX quotes."""
    nvidia: bytes
    """NVIDIA Device Identity CA (PEM)."""


def root_fingerprint(data: bytes) -> str:
    """SHA-256 (hex) of the DER of the last certificate in ``data`` (PEM bundle or DER), parsed
    strictly (``certs.evidence.x509chain``) as the verifiers will."""
    try:
        cert = parse_certificates(data)[-1]
    except EvidenceFormatError as exc:
        raise CollateralError("root_invalid", exc.detail) from None
    return hashlib.sha256(cert.der).hexdigest()


def _bundled(name: str) -> bytes:
    data = resources.files("certs.collateral").joinpath("roots", name).read_bytes()
    actual = root_fingerprint(data)
    if actual != FINGERPRINTS[name]:
        raise CollateralError(
            "root_fingerprint_mismatch", f"{name}: {actual} != {FINGERPRINTS[name]}"
        )
    return data


def bundled_roots() -> TrustRoots:
    """The roots shipped with attestmesh, fingerprint-checked."""
    return TrustRoots(
        nitro=_bundled(NITRO_ROOT),
        amd_chains=tuple(_bundled(n) for n in AMD_CHAINS),
        intel_sgx_root=_bundled(INTEL_SGX_ROOT),
        nvidia=_bundled(NVIDIA_ROOT),
    )


def load_roots(directory: Path | None = None) -> TrustRoots:
    """Roots from ``directory`` (same file names) where present, else the bundled ones."""
    if directory is None:
        return bundled_roots()

    def one(name: str) -> bytes:
        path = directory / name
        if not path.is_file():
            return _bundled(name)
        data = path.read_bytes()
        root_fingerprint(data)  # must at least parse
        return data

    return TrustRoots(
        nitro=one(NITRO_ROOT),
        amd_chains=tuple(one(n) for n in AMD_CHAINS),
        intel_sgx_root=one(INTEL_SGX_ROOT),
        nvidia=one(NVIDIA_ROOT),
    )
