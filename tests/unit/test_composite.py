"""Composite CPU + GPU attestation (certs.evidence.composite): a test-signed SEV-SNP report
(synthetic ARK/ASK/VCEK) and test-signed H100 SPDM reports whose nonces derive from the CPU
report's binding; the real H100 vectors through the same path. Policy ``requires``, the
certificate's claims and EAR, mesh rules on GPU claims."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from certs.ca import (
    CLAIMS_OID,
    CertificateAuthority,
    decode_claims_extension,
    encode_claims_extension,
    parse_csr,
)
from certs.ca.templates import build_leaf
from certs.ear import build_ear_extension, verify_certificate_ear
from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Tee
from certs.evidence.composite import (
    MAX_GPUS,
    CompositeVerifier,
    GpuEvidence,
    attach_gpus,
    attached_gpus,
    gpu_collateral,
    gpu_nonce,
    split_collateral,
)
from certs.evidence.nvidia_gpu import NvidiaGpuVerifier
from certs.evidence.sev_snp import SevSnpVerifier, parse_amd_chain
from certs.policy import Admitted, Rejected, appraise, parse_policies
from tests.unit.evidence import test_nvidia as nv
from tests.unit.evidence.test_sev_snp import CHIP, IDBLOCK, SYN_TCB, TCB_RAW, _Amd, _sign
from tests.unit.fixtures_core import TRUST_DOMAIN, csr_pem, new_key, policy_doc, record, spki
from xds.meshpolicy import ClaimsCondition

NOW = nv.T0  # the synthetic GPU chain's validity; the synthetic AMD PKI spans 2024-2034
FWID = bytes(range(48))
GPU_VALUE = bytes(range(48)).hex()  # measurement block 1 of the synthetic GPU reports
REPORT_DATA_AT = 0x50  # SEV-SNP ATTESTATION_REPORT.REPORT_DATA (64 bytes)


@dataclass
class Rig:
    """A CVM (synthetic SNP PKI) with synthetic H100s behind one NVIDIA test root."""

    amd: _Amd
    vcek_key: ec.EllipticCurvePrivateKey
    vcek: bytes
    gpu_bundle: bytes
    gpu_key: ec.EllipticCurvePrivateKey
    verifier: CompositeVerifier

    def cpu_report(self, report_data: bytes) -> bytes:
        template = bytearray(IDBLOCK.evidence())
        template[REPORT_DATA_AT : REPORT_DATA_AT + 64] = report_data
        return _sign(bytes(template), self.vcek_key, reported_tcb=TCB_RAW, chip_id=CHIP)

    def gpu(self, nonce: bytes) -> GpuEvidence:
        return GpuEvidence(nv.build_report(self.gpu_key, FWID, nonce), self.gpu_bundle)

    def attestation(self, report_data: bytes, n: int) -> tuple[bytes, dict[str, bytes]]:
        """CPU evidence and collateral with ``n`` GPUs asked for the derived nonces."""
        gpus = [self.gpu(gpu_nonce(report_data, i, n)) for i in range(n)]
        return self.cpu_report(report_data), {"vcek": self.vcek, **gpu_collateral(gpus)}


@pytest.fixture(scope="module")
def rig() -> Rig:
    amd = _Amd()
    vcek_key = ec.generate_private_key(ec.SECP384R1())
    bundle, gpu_key = nv.make_leaf(FWID)
    gpu_root = bundle[bundle.index(b"-----BEGIN", 10) :]
    verifier = CompositeVerifier(
        SevSnpVerifier([parse_amd_chain(amd.chain_pem())]), NvidiaGpuVerifier(gpu_root)
    )
    vcek = amd.vcek(vcek_key, SYN_TCB, CHIP, "Milan-B0")
    return Rig(amd, vcek_key, vcek, bundle, gpu_key, verifier)


def _binding() -> bytes:
    return expected_report_data(bytes(range(32)), spki(new_key()))


def _reason(rig: Rig, evidence: bytes, collateral: dict[str, bytes]) -> str:
    with pytest.raises((EvidenceVerificationError, EvidenceFormatError)) as err:
        rig.verifier.verify(evidence, now=NOW, collateral=collateral)
    return str(err.value.reason)


def test_a_cvm_with_two_gpus_verifies_into_one_claim_set(rig: Rig) -> None:
    rd = _binding()
    evidence, collateral = rig.attestation(rd, 2)
    claims = rig.verifier.verify(evidence, now=NOW, collateral=collateral)
    assert claims.tee is Tee.SEV_SNP and claims.report_data[:64] == rd
    assert claims.details["attached_tees"] == "nvidia-gpu" and claims.details["gpu_count"] == 2
    assert claims.measurements["gpu0.measurement_1"] == GPU_VALUE
    assert claims.measurements["gpu1.measurement_1"] == GPU_VALUE
    assert "measurement" in claims.measurements  # the CPU's launch digest stays
    assert claims.details["gpu0.fwid"] == FWID.hex()
    assert claims.details["gpu0.driver_version"] == "1.0"
    gpus = attached_gpus(claims)
    assert [g.index for g in gpus] == [0, 1]
    assert gpus[1].measurements == {"measurement_1": GPU_VALUE}
    # without GPU entries the composite verifier is the CPU verifier
    plain = rig.verifier.verify(evidence, now=NOW, collateral={"vcek": rig.vcek})
    assert attached_gpus(plain) == [] and "gpu_count" not in plain.details
    assert plain.measurements == {
        k: v for k, v in claims.measurements.items() if not k.startswith("gpu")
    }


def test_gpu_nonces_bind_the_cpu_report_index_and_count() -> None:
    rd = bytes(64)
    nonces = {gpu_nonce(rd, i, n) for n in range(1, 4) for i in range(n)}
    assert len(nonces) == 6 and all(len(x) == 32 for x in nonces)
    assert gpu_nonce(rd, 0, 1) != gpu_nonce(b"\x01" + rd[1:], 0, 1)
    with pytest.raises(ValueError):
        gpu_nonce(rd, 1, 1)
    with pytest.raises(ValueError):
        gpu_nonce(rd, 0, MAX_GPUS + 1)
    with pytest.raises(ValueError):
        gpu_nonce(rd[:32], 0, 1)


def test_neither_report_can_be_swapped(rig: Rig) -> None:
    rd, other = _binding(), _binding()
    evidence, collateral = rig.attestation(rd, 2)
    # the GPUs of another attestation
    _, foreign = rig.attestation(other, 2)
    mixed = {**collateral, "gpu1.evidence": foreign["gpu1.evidence"]}
    assert _reason(rig, evidence, mixed) == "gpu_binding_mismatch"
    # the CPU report of another attestation with these GPUs
    assert _reason(rig, rig.cpu_report(other), collateral) == "gpu_binding_mismatch"
    # the GPUs reordered
    swapped = {
        **collateral,
        "gpu0.evidence": collateral["gpu1.evidence"],
        "gpu1.evidence": collateral["gpu0.evidence"],
    }
    assert _reason(rig, evidence, swapped) == "gpu_binding_mismatch"
    # a GPU left out (the count is bound too)
    dropped = {k: v for k, v in collateral.items() if not k.startswith("gpu1.")}
    assert _reason(rig, evidence, dropped) == "gpu_binding_mismatch"


def test_a_gpu_of_another_vendor_root_fails_the_whole_attestation(rig: Rig) -> None:
    rd = _binding()
    evidence, collateral = rig.attestation(rd, 1)
    bundle, key = nv.make_leaf(FWID)  # same shape, another root
    rogue = GpuEvidence(nv.build_report(key, FWID, gpu_nonce(rd, 0, 1)), bundle)
    with pytest.raises(EvidenceVerificationError) as err:
        rig.verifier.verify(evidence, now=NOW, collateral={**collateral, **gpu_collateral([rogue])})
    assert err.value.detail.startswith("gpu0: ")
    assert err.value.reason in ("untrusted_root", "chain_invalid", "signature_invalid")


@pytest.mark.parametrize(
    ("entries", "problem"),
    [
        ({"gpu1.evidence": b"x", "gpu1.cert_chain": b"x"}, "must be 0..n-1"),
        ({"gpu0.evidence": b"x"}, "gpu0 lacks cert_chain"),
        ({"gpu8.evidence": b"x", "gpu8.cert_chain": b"x"}, "out of range"),
        ({"gpu00.evidence": b"x", "gpu00.cert_chain": b"x"}, "out of range"),
        ({"gpu0.nonce": b"x"}, "unknown GPU collateral entry"),
    ],
)
def test_malformed_gpu_entries_are_refused_before_any_verification(
    rig: Rig, entries: dict[str, bytes], problem: str
) -> None:
    with pytest.raises(EvidenceFormatError) as err:
        split_collateral({"vcek": b"v", **entries})
    assert err.value.reason == "composite_invalid" and problem in err.value.detail
    assert _reason(rig, rig.cpu_report(_binding()), {"vcek": rig.vcek, **entries}) == (
        "composite_invalid"
    )


def test_real_h100_vectors_verify_through_the_composite_path_and_are_not_bound(rig: Rig) -> None:
    """Real H100 reports (real NVIDIA chain) verify in the composite path up to the binding:
    their nonce was chosen by someone else, so they cannot attach to this CVM's report."""
    verifier = CompositeVerifier(
        SevSnpVerifier([parse_amd_chain(rig.amd.chain_pem())]), NvidiaGpuVerifier(nv.ROOT)
    )
    evidence = rig.cpu_report(_binding())
    for vec in nv.VECTORS_NV:
        real = GpuEvidence(nv.report(vec.folder), nv.chain(vec.folder))
        collateral = {"vcek": rig.vcek, **gpu_collateral([real])}
        with pytest.raises(EvidenceVerificationError) as err:
            verifier.verify(evidence, now=nv.NOW, collateral=collateral)
        assert err.value.reason == "gpu_binding_mismatch"
        tampered = GpuEvidence(
            nv.GOOD[:60] + bytes([nv.GOOD[60] ^ 1]) + nv.GOOD[61:], real.cert_chain
        )
        if vec.folder == "hopper_trustee":
            with pytest.raises(EvidenceVerificationError) as err:
                verifier.verify(
                    evidence,
                    now=nv.NOW,
                    collateral={"vcek": rig.vcek, **gpu_collateral([tampered])},
                )
            assert err.value.reason == "signature_invalid"


def test_attach_gpus_wraps_only_cpu_verifiers_when_a_gpu_verifier_exists(rig: Rig) -> None:
    snp = SevSnpVerifier([parse_amd_chain(rig.amd.chain_pem())])
    gpu = NvidiaGpuVerifier(nv.ROOT)
    wrapped = attach_gpus({Tee.SEV_SNP: snp, Tee.NVIDIA_GPU: gpu})
    assert isinstance(wrapped[Tee.SEV_SNP], CompositeVerifier) and wrapped[Tee.NVIDIA_GPU] is gpu
    assert attach_gpus({Tee.SEV_SNP: snp})[Tee.SEV_SNP] is snp
    with pytest.raises(ValueError):
        CompositeVerifier(gpu, gpu)


# -- policy ---------------------------------------------------------------------------------------


def _policy(claims: Claims, gpu_values: list[str], **spec: Any) -> Any:
    refs = {
        "sevSnp": {"measurement": [claims.measurements["measurement"]]},
        "nvidiaGpu": {"measurements": {"1": gpu_values}},
    }
    (p,) = parse_policies([policy_doc("gpu", tees=["sev-snp", "nvidia-gpu"], refs=refs, **spec)])
    return p


def test_requires_demands_both_and_every_gpu_is_appraised(rig: Rig) -> None:
    rd = _binding()
    evidence, collateral = rig.attestation(rd, 2)
    composite = rig.verifier.verify(evidence, now=NOW, collateral=collateral)
    plain = rig.verifier.verify(evidence, now=NOW, collateral={"vcek": rig.vcek})
    policy = _policy(composite, [GPU_VALUE], requires=["sev-snp", "nvidia-gpu"])
    assert policy.requires == {Tee.SEV_SNP, Tee.NVIDIA_GPU}
    assert isinstance(appraise(composite, policy, NOW), Admitted)
    refused = appraise(plain, policy, NOW)
    assert isinstance(refused, Rejected)
    assert refused.reasons == ("tee_required: evidence lacks nvidia-gpu",)
    wrong = appraise(composite, _policy(composite, ["00" * 48]), NOW)
    assert isinstance(wrong, Rejected)
    assert wrong.reasons == (
        f"measurement_not_allowed: gpu0.measurement_1={GPU_VALUE}",
        f"measurement_not_allowed: gpu1.measurement_1={GPU_VALUE}",
    )
    # a CPU-only policy does not admit evidence with a GPU it says nothing about
    refs = {"sevSnp": {"measurement": [composite.measurements["measurement"]]}}
    (cpu_only,) = parse_policies([policy_doc("cpu", tees=["sev-snp"], refs=refs)])
    assert isinstance(appraise(plain, cpu_only, NOW), Admitted)
    gpu_refused = appraise(composite, cpu_only, NOW)
    assert isinstance(gpu_refused, Rejected)
    assert gpu_refused.reason == "tee_not_allowed"


# -- the certificate and the mesh -----------------------------------------------------------------


def test_the_certificate_carries_both_claim_sets(rig: Rig, tmp_path: Path) -> None:
    rd = _binding()
    evidence, collateral = rig.attestation(rd, 2)
    claims = rig.verifier.verify(evidence, now=NOW, collateral=collateral)
    key = new_key()
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, NOW)
    spiffe = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
    ext = build_ear_extension(claims, policy="default/gpu", spiffe_id=spiffe,
                              subject_key=key.public_key(), nonce=bytes(32),
                              issuer=ca.intermediate, now=NOW)  # fmt: skip
    leaf = build_leaf(
        parse_csr(csr_pem(key)), spiffe_id=spiffe,
        claims_extension=encode_claims_extension(claims, "default/gpu", NOW),
        issuer=ca.intermediate, serial=5, now=NOW, ttl=timedelta(hours=1), cmw_extension=ext,
    )  # fmt: skip
    # the project's claims extension: CPU and GPU measurements together
    doc = decode_claims_extension(leaf.extensions.get_extension_for_oid(CLAIMS_OID).value.value)  # type: ignore[attr-defined]
    assert doc["measurements"]["gpu1.measurement_1"] == GPU_VALUE  # type: ignore[index]
    # the EAR: one submod per attester, each bound to the leaf key
    ear = verify_certificate_ear(leaf, ca.intermediate.cert, spiffe)
    assert set(ear.submods) == {"sev-snp", "nvidia-gpu.0", "nvidia-gpu.1"}
    assert "gpu0.measurement_1" not in ear.submods["sev-snp"]["attestmesh.dev/measurements"]
    gpu0 = ear.submods["nvidia-gpu.0"]
    assert gpu0["attestmesh.dev/measurements"] == {"measurement_1": GPU_VALUE}
    assert gpu0["attestmesh.dev/evidence-sha256"] == claims.details["gpu0.evidence_sha256"]
    assert gpu0["ear.status"] == "affirming"


def test_mesh_rules_match_gpu_claims(rig: Rig) -> None:
    evidence, collateral = rig.attestation(_binding(), 1)
    claims = rig.verifier.verify(evidence, now=NOW, collateral=collateral)
    with_gpu = SimpleNamespace(attestation=record("sev-snp", claims.measurements))
    without = SimpleNamespace(
        attestation=record(
            "sev-snp", {k: v for k, v in claims.measurements.items() if not k.startswith("gpu")}
        )
    )
    rule = ClaimsCondition(frozenset({"sev-snp"}),
                           (("gpu0.measurement_1", frozenset({GPU_VALUE})),))  # fmt: skip
    assert rule.matches(with_gpu)  # type: ignore[arg-type]
    assert not rule.matches(without)  # type: ignore[arg-type]
    other = ClaimsCondition(frozenset(), (("gpu0.measurement_1", frozenset({"00" * 48})),))
    assert not other.matches(with_gpu)  # type: ignore[arg-type]


def test_a_td_with_a_gpu_verifies_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """TDX: the binding is the TD report's REPORTDATA; the GPU nonce derives from it alike."""
    import tests.unit.evidence.dcap_fixtures as fx
    from certs.evidence.tdx import TdxVerifier

    monkeypatch.setattr(nv, "T0", fx.NOW)  # the synthetic GPU chain around the DCAP fixtures' time
    pki = fx.Pki()
    bundle, key = nv.make_leaf(FWID)
    root = bundle[bundle.index(b"-----BEGIN", 10) :]
    verifier = CompositeVerifier(TdxVerifier(pki.root_der), NvidiaGpuVerifier(root))
    rd = _binding()
    quote = fx.build_quote(pki, tdx=True, body=fx.td_report(report_data=rd))
    collateral = {"collateral_json": fx.build_collateral(pki, tdx=True)}
    gpu = GpuEvidence(nv.build_report(key, FWID, gpu_nonce(rd, 0, 1)), bundle)
    claims = verifier.verify(quote, now=fx.NOW, collateral={**collateral, **gpu_collateral([gpu])})
    assert claims.tee is Tee.TDX and claims.details["gpu_count"] == 1
    assert claims.measurements["gpu0.measurement_1"] == GPU_VALUE and "mrtd" in claims.measurements
    other = GpuEvidence(nv.build_report(key, FWID, gpu_nonce(_binding(), 0, 1)), bundle)
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(quote, now=fx.NOW, collateral={**collateral, **gpu_collateral([other])})
    assert err.value.reason == "gpu_binding_mismatch"
