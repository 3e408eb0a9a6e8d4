"""SEV-SNP parser and verifier: real vectors at their pin times, derived negatives, synthetic
chains for the checks real vectors cannot reach, and hypothesis on the parser."""

from __future__ import annotations

import base64
import contextlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certs.binding import binding_matches, expected_report_data
from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Tee
from certs.evidence.sev_snp import (
    REPORT_SIZE,
    SIGNED_LEN,
    AmdChain,
    Product,
    SevSnpVerifier,
    SigningKey,
    looks_like,
    parse_amd_chain,
    parse_evidence,
    parse_report,
    product_from_cpuid,
)
from certs.policy import (
    Admitted,
    AttestationPolicy,
    ReferenceValues,
    Rejected,
    Selector,
    appraise,
)
from tests.vectors import VECTORS, pin

SNP = VECTORS / "sev-snp"
AMD = SNP / "amd"
MILAN = (AMD / "ask_ark_milan.pem").read_bytes()
GENOA = (AMD / "ask_ark_genoa.pem").read_bytes()
MILAN_VLEK = (AMD / "asvk_ark_milan_vlek.pem").read_bytes()


@dataclass(frozen=True)
class Vector:
    name: str
    report: str
    cert_name: str
    cert_file: str
    pin: datetime
    product: Product
    version: int
    expect: Mapping[str, object]

    def evidence(self) -> bytes:
        return (SNP / self.name / self.report).read_bytes()

    def collateral(self) -> dict[str, bytes]:
        return {self.cert_name: (SNP / self.name / self.cert_file).read_bytes()}


ZERO48 = "00" * 48
VECTORS_SNP = [
    Vector(
        "milan_v2_gosevguest",
        "report.bin",
        "vcek",
        "vcek.der",
        pin("2023-01-01T00:00:00Z"),
        Product.MILAN,
        2,
        {
            "measurement": "b07af9620f3b839b47996422ddec6058338951d984e312115131ea82705eaf5b"
            "6bdf8a9ece31a5a608eb0cf2e4872b01",
            "report_data": bytes([1, 2, 3, 4, 5]) + bytes(59),
            "tcb": {"bootloader": 2, "tee": 0, "snp": 5, "microcode": 68},
            "svn": 0,
            "debug": True,
            "policy": "0xb0000",
            "vmpl": 0,
            "chip_prefix": "3ac3fe21e13fb099",
            "firmware": "1.49 build 3",
            "host_data": "00" * 32,
            "id_key_digest": ZERO48,
            "reported_tcb": "0x4405000000000002",
            "current_tcb": "0x4405000000000002",
            "signing_key": "vcek",
            "platform_info": "0x1",
        },
    ),
    Vector(
        "milan_v2_idblock_trustee",
        "report.bin",
        "vcek",
        "vcek.der",
        pin("2024-07-01T00:00:00Z"),
        Product.MILAN,
        2,
        {
            "measurement": "a1f3930413247bb38cfc171579ea3c12d5fe4901f0c792f63fd75d98f1ef827c"
            "23500644e0e692e6be917f9050d3d38c",
            "report_data": bytes.fromhex(
                "ec6c52d7533cc2c4f45be7849cf112ab82b2009fe7bd43e71ed08c14400ad7e2"
            )
            + bytes(32),
            "tcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
            "svn": 4,
            "debug": False,
            "policy": "0x3001f",
            "vmpl": 0,
            "chip_prefix": "c38427a30d4c7af9",
            "firmware": "1.52 build 4",
            "family_id": "01" + "00" * 15,
            "image_id": "02" + "00" * 15,
            "id_key_digest": "0356215882a825279a85b300b0b742931d113bf7e32dde2e50ffde7ec743ca49"
            "1ecdd7f336dc28a6e0b2bb57af7a44a3",
            "author_key_digest": ZERO48,
            "reported_tcb": "0x7308000000000003",
            "current_tcb": "0xce08000000000003",
            "signing_key": "vcek",
            "abi_minor": 0x1F,
        },
    ),
    Vector(
        "genoa_v3_azure_trustee",
        "report.bin",
        "vcek",
        "vcek.pem",
        pin("2026-02-01T00:00:00Z"),
        Product.GENOA,
        3,
        {
            "measurement": "f57dc09a507c6ecd82369bffb600f0003792f4d99bc26e985ec0c266fc34faf3"
            "706faf814c9e61065768a6ff917c89ae",
            "report_data": bytes.fromhex(
                "b581f12e29a2d7d64e5e0b738d563879a78b51c644d0fa0cce02b48699f6bf5f"
            )
            + bytes(32),
            "tcb": {"bootloader": 10, "tee": 0, "snp": 23, "microcode": 84},
            "svn": 0x1000B,
            "debug": False,
            "policy": "0x3001f",
            "vmpl": 0,
            "chip_prefix": "0506ffba875e939c",
            "firmware": "1.55 build 40",
            "id_key_digest": "942fd93ebde6ea7a96efadeafc60f1c6b3d10e703b1dafd7555b92f7f3d32d0e"
            "006767648cba5b102af3d65756af4177",
            "image_id": "02" + "00" * 15,
            "reported_tcb": "0x541700000000000a",
            "current_tcb": "0x541700000000000a",
            "signing_key": "vcek",
            "platform_info": "0x24",
            "cpuid": "191101",
        },
    ),
    Vector(
        "milan_v3_vlek_aws_trustee",
        "report.bin",
        "vlek",
        "vlek.der",
        pin("2025-05-28T00:00:00Z"),
        Product.MILAN,
        3,
        {
            "measurement": "8922ebbdd00ec2c541f36a6e7a82a8773a7accb451ed67bc94e740dbe92c93c4"
            "e8c9af857f5ceeb5a493df2a570d7bf0",
            "report_data": bytes.fromhex(
                "819770b7e6ea6df8dd8fd4dd146b073c0bf4f3ce5b0977ecac486e3a05ed1bd5"
                "4e2a7ac1f5d1ca02e7d7d5ef9f73b8574fd9359e3a480d741a4478e8a7bc27ca"
            ),
            "tcb": {"bootloader": 4, "tee": 0, "snp": 24, "microcode": 217},
            "svn": 0,
            "debug": False,
            "policy": "0x30000",
            "vmpl": 1,
            "chip_prefix": None,
            "firmware": "1.55 build 29",
            "host_data": "00" * 32,
            "reported_tcb": "0xd918000000000004",
            "current_tcb": "0xdc18000000000004",
            "committed_tcb": "0xdb18000000000004",
            "launch_tcb": "0xdb18000000000004",
            "signing_key": "vlek",
            "platform_info": "0x27",
            "cpuid": "190101",
        },
    ),
]
BY_NAME = {v.name: v for v in VECTORS_SNP}
GOSEV = BY_NAME["milan_v2_gosevguest"]
IDBLOCK = BY_NAME["milan_v2_idblock_trustee"]
AZURE = BY_NAME["genoa_v3_azure_trustee"]
VLEK = BY_NAME["milan_v3_vlek_aws_trustee"]


@pytest.fixture(scope="module")
def verifier() -> SevSnpVerifier:
    return SevSnpVerifier([MILAN, GENOA, MILAN_VLEK])


def _verify(v: SevSnpVerifier, vec: Vector, evidence: bytes | None = None, **kw: object) -> Claims:
    collateral = kw.pop("collateral", None)
    now = kw.pop("now", vec.pin)
    assert not kw
    return v.verify(
        vec.evidence() if evidence is None else evidence,
        now=now,  # type: ignore[arg-type]
        collateral=vec.collateral() if collateral is None else collateral,  # type: ignore[arg-type]
    )


def _reason(v: SevSnpVerifier, vec: Vector, evidence: bytes | None = None, **kw: object) -> str:
    with pytest.raises(EvidenceVerificationError) as info:
        _verify(v, vec, evidence, **kw)
    return info.value.reason


def _flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# real vectors


@pytest.mark.parametrize("vec", VECTORS_SNP, ids=lambda v: v.name)
def test_vector_verifies_and_decodes_as_documented(verifier: SevSnpVerifier, vec: Vector) -> None:
    claims = _verify(verifier, vec)
    e = vec.expect
    assert verifier.tee is Tee.SEV_SNP
    assert claims.tee is Tee.SEV_SNP
    assert claims.measurements["measurement"] == e["measurement"]
    assert set(claims.measurements) == {
        "measurement",
        "host_data",
        "id_key_digest",
        "author_key_digest",
        "family_id",
        "image_id",
    }
    for key in ("host_data", "id_key_digest", "author_key_digest", "family_id", "image_id"):
        if key in e:
            assert claims.measurements[key] == e[key], key
    assert claims.report_data == e["report_data"]
    assert len(claims.report_data) == 64
    assert claims.tcb == e["tcb"]
    assert claims.svn == e["svn"]
    assert claims.debug is e["debug"]
    if e["chip_prefix"] is None:
        assert claims.platform_id is None  # VLEK: chip_id is masked (all zero)
    else:
        assert claims.platform_id is not None
        assert claims.platform_id.startswith(str(e["chip_prefix"]))
        assert len(claims.platform_id) == 128
    d = claims.details
    assert d["version"] == vec.version
    assert d["policy"] == e["policy"]
    assert d["vmpl"] == e["vmpl"]
    assert d["firmware"] == e["firmware"]
    assert d["product"] == vec.product
    assert d["smt_allowed"] is True
    assert d["migration_agent_allowed"] is False
    for key in (
        "reported_tcb",
        "current_tcb",
        "committed_tcb",
        "launch_tcb",
        "signing_key",
        "platform_info",
        "abi_minor",
        "cpuid",
    ):
        if key in e:
            assert d[key] == e[key], key
    assert ("cpuid" in d) is (vec.version >= 3)
    assert len(claims.evidence_sha256) == 64


def test_idblock_tcb_claims_come_from_reported_not_current(verifier: SevSnpVerifier) -> None:
    claims = _verify(verifier, IDBLOCK)
    assert claims.details["current_tcb"] != claims.details["reported_tcb"]
    assert claims.tcb["microcode"] == 115  # reported; current says 206


def test_azure_hcl_report_is_accepted_and_runtime_claims_hash_checked(
    verifier: SevSnpVerifier,
) -> None:
    hcl = (SNP / AZURE.name / "hcl_report.bin").read_bytes()
    assert hcl[:4] == b"HCLA"
    claims = _verify(verifier, AZURE, hcl)
    plain = _verify(verifier, AZURE)
    assert claims.measurements == plain.measurements
    assert claims.details["hcl"] is True
    assert claims.details["hcl_runtime_claims_bound"] is True
    # Tampering with the runtime claims (outside the signed SNP report) is visible in details.
    tampered = _flip(hcl, 1236 + 20)
    assert _verify(verifier, AZURE, tampered).details["hcl_runtime_claims_bound"] is False
    report, wrapper = parse_evidence(hcl)
    assert wrapper is not None and report.version == 3


def test_looks_like() -> None:
    for vec in VECTORS_SNP:
        assert looks_like(vec.evidence())
    assert looks_like((SNP / AZURE.name / "hcl_report.bin").read_bytes())
    report = GOSEV.evidence()
    assert not looks_like(report[:-1])
    assert not looks_like(b"")
    assert not looks_like(struct.pack("<I", 9) + report[4:])
    assert not looks_like(report[:0x34] + struct.pack("<I", 2) + report[0x38:])


def test_product_from_cpuid() -> None:
    assert product_from_cpuid((0x19, 0x01, 0x01)) is Product.MILAN
    assert product_from_cpuid((0x19, 0x11, 0x01)) is Product.GENOA
    assert product_from_cpuid((0x1A, 0x02, 0x00)) is Product.TURIN
    assert product_from_cpuid((0x17, 0x31, 0x00)) is None
    assert product_from_cpuid(None) is None


def test_pem_and_der_endorsements_are_equivalent(verifier: SevSnpVerifier) -> None:
    der = (SNP / GOSEV.name / "vcek.der").read_bytes()
    # Built by hand: loading a serial-0 certificate in the test would warn (warnings are errors).
    b64 = base64.b64encode(der)
    lines = b"\n".join(b64[i : i + 64] for i in range(0, len(b64), 64))
    pem = b"-----BEGIN CERTIFICATE-----\n" + lines + b"\n-----END CERTIFICATE-----\n"
    assert _verify(verifier, GOSEV, collateral={"vcek": pem}) == _verify(verifier, GOSEV)


def test_cert_chain_override_with_the_pinned_chain_verifies(verifier: SevSnpVerifier) -> None:
    col = {**GOSEV.collateral(), "cert_chain": MILAN}
    assert _verify(verifier, GOSEV, collateral=col).tcb["snp"] == 5
    col = {**VLEK.collateral(), "cert_chain": MILAN_VLEK}
    assert _verify(verifier, VLEK, collateral=col).details["signing_key"] == "vlek"


# ---------------------------------------------------------------------------------------------
# derived negatives: each with one precise reason

SIGNED_SAMPLES = {
    "version": 0x00,
    "guest_svn": 0x04,
    "policy": 0x0A,  # bit 17 -> 19 region: policy byte 2
    "family_id": 0x10,
    "vmpl": 0x30,
    "current_tcb": 0x38,
    "platform_info": 0x40,
    "report_data": 0x50,
    "measurement": 0x90,
    "host_data": 0xC0,
    "id_key_digest": 0xE0,
    "report_id": 0x140,
    "reported_tcb": 0x180,
    "chip_id": 0x1A0,
    "committed_tcb": 0x1E0,
    "launch_tcb": 0x1F0,
    "reserved_tail": SIGNED_LEN - 1,
}


@pytest.mark.parametrize("field", sorted(SIGNED_SAMPLES))
@pytest.mark.parametrize("vec", [GOSEV, VLEK], ids=lambda v: v.name)
def test_flipped_signed_byte_is_signature_invalid(
    verifier: SevSnpVerifier, vec: Vector, field: str
) -> None:
    offset = SIGNED_SAMPLES[field]
    # version 2 -> 3 (bit 0) stays a supported version; the other fields have no parse checks
    # that a single low-bit flip can trip.
    assert _reason(verifier, vec, _flip(vec.evidence(), offset)) == "signature_invalid"


@pytest.mark.parametrize("offset", [SIGNED_LEN, SIGNED_LEN + 47, SIGNED_LEN + 72, 0x317])
def test_flipped_signature_byte_is_signature_invalid(verifier: SevSnpVerifier, offset: int) -> None:
    assert _reason(verifier, AZURE, _flip(AZURE.evidence(), offset)) == "signature_invalid"


def test_signature_component_beyond_384_bits_is_signature_invalid(
    verifier: SevSnpVerifier,
) -> None:
    assert _reason(verifier, GOSEV, _flip(GOSEV.evidence(), SIGNED_LEN + 60)) == (
        "signature_invalid"
    )


@pytest.mark.parametrize("length", [0, 1, 0x2A0, REPORT_SIZE - 1, REPORT_SIZE + 1])
def test_truncated_or_padded_report_is_format_error(verifier: SevSnpVerifier, length: int) -> None:
    data = (GOSEV.evidence() + b"\0")[:length]
    with pytest.raises(EvidenceFormatError) as info:
        _verify(verifier, GOSEV, data)
    assert info.value.reason == "report_length"


def test_truncated_hcl_report_is_format_error(verifier: SevSnpVerifier) -> None:
    hcl = (SNP / AZURE.name / "hcl_report.bin").read_bytes()
    for length in (4, 100, 1216, 1230, 2000):
        with pytest.raises(EvidenceFormatError):
            _verify(verifier, AZURE, hcl[:length])


def test_unknown_version_and_sig_algo_are_format_errors() -> None:
    report = GOSEV.evidence()
    for version in (0, 1, 6, 0xFFFFFFFF):
        with pytest.raises(EvidenceFormatError) as info:
            parse_report(struct.pack("<I", version) + report[4:])
        assert info.value.reason == "report_version_unsupported"
    for algo in (0, 2, 0x100):
        with pytest.raises(EvidenceFormatError) as info:
            parse_report(report[:0x34] + struct.pack("<I", algo) + report[0x38:])
        assert info.value.reason == "signature_algorithm_unsupported"
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(report[:0x48] + struct.pack("<I", 3 << 2) + report[0x4C:])
    assert info.value.reason == "report_field_invalid"


def test_milan_report_with_only_genoa_pinned_is_untrusted_root() -> None:
    genoa_only = SevSnpVerifier([GENOA])
    assert _reason(genoa_only, GOSEV) == "untrusted_root"
    assert _reason(genoa_only, VLEK) == "untrusted_root"
    assert _verify(genoa_only, AZURE).details["product"] == "Genoa"


def test_genoa_cert_chain_for_milan_report_is_chain_invalid(verifier: SevSnpVerifier) -> None:
    col = {**GOSEV.collateral(), "cert_chain": GENOA}
    assert _reason(verifier, GOSEV, collateral=col) == "chain_invalid"


def test_cert_chain_with_unpinned_ark_is_untrusted_root() -> None:
    milan_only = SevSnpVerifier([MILAN])
    col = {**AZURE.collateral(), "cert_chain": GENOA}
    assert _reason(milan_only, AZURE, collateral=col) == "untrusted_root"


def test_vcek_chain_cannot_stand_in_for_vlek_chain(verifier: SevSnpVerifier) -> None:
    col = {**VLEK.collateral(), "cert_chain": MILAN}
    assert _reason(verifier, VLEK, collateral=col) == "chain_invalid"
    vcek_only = SevSnpVerifier([MILAN])
    assert _reason(vcek_only, VLEK) == "untrusted_root"


def test_vlek_after_expiry_is_certificate_expired(verifier: SevSnpVerifier) -> None:
    assert _reason(verifier, VLEK, now=pin("2026-01-01T00:00:00Z")) == "certificate_expired"
    # The cached chain link does not hide expiry: verify once in-window, then out of window.
    _verify(verifier, VLEK)
    assert _reason(verifier, VLEK, now=pin("2025-12-10T22:14:22Z")) == "certificate_expired"


def test_before_vcek_validity_is_certificate_not_yet_valid(verifier: SevSnpVerifier) -> None:
    now = pin("2022-09-24T00:55:27Z")
    assert _reason(verifier, GOSEV, now=now) == "certificate_not_yet_valid"


def test_vcek_from_another_vector_is_signature_invalid(verifier: SevSnpVerifier) -> None:
    """A foreign VCEK of the same product chains fine but its key did not sign the report:
    signature_invalid (checked first), with the TCB mismatch named in the detail."""
    col = {"vcek": (SNP / IDBLOCK.name / "vcek.der").read_bytes()}
    with pytest.raises(EvidenceVerificationError) as info:
        _verify(verifier, GOSEV, collateral=col, now=IDBLOCK.pin)  # both VCEKs valid then
    assert info.value.reason == "signature_invalid"
    assert "tcb_mismatch" in info.value.detail


def test_genoa_vcek_offered_as_vlek_is_signing_key_mismatch(verifier: SevSnpVerifier) -> None:
    col = {"vlek": (SNP / AZURE.name / "vcek.pem").read_bytes()}
    assert _reason(verifier, VLEK, collateral=col) == "signing_key_mismatch"


def test_signing_key_kind_must_match_the_certificate(verifier: SevSnpVerifier) -> None:
    vlek_der = (SNP / VLEK.name / "vlek.der").read_bytes()
    vcek_der = (SNP / GOSEV.name / "vcek.der").read_bytes()
    # VCEK-signed report, VLEK certificate under the VCEK name / under its own name.
    assert _reason(verifier, GOSEV, collateral={"vcek": vlek_der}) == "signing_key_mismatch"
    assert _reason(verifier, GOSEV, collateral={"vlek": vlek_der}) == "signing_key_mismatch"
    # VLEK-signed report, VCEK certificate under the VLEK name.
    assert _reason(verifier, VLEK, collateral={"vlek": vcek_der}) == "signing_key_mismatch"


def test_missing_endorsement_is_collateral_missing(verifier: SevSnpVerifier) -> None:
    assert _reason(verifier, GOSEV, collateral={}) == "collateral_missing"
    assert _reason(verifier, VLEK, collateral={"cert_chain": MILAN_VLEK}) == "collateral_missing"


def test_garbage_certificate_is_format_error(verifier: SevSnpVerifier) -> None:
    with pytest.raises(EvidenceFormatError) as info:
        _verify(verifier, GOSEV, collateral={"vcek": b"not a certificate"})
    assert info.value.reason == "certificate_invalid"
    with pytest.raises(EvidenceFormatError):
        _verify(verifier, GOSEV, collateral={**GOSEV.collateral(), "cert_chain": b"junk"})


def test_constructor_rejects_empty_and_non_amd_chains() -> None:
    with pytest.raises(ValueError):
        SevSnpVerifier([])
    with pytest.raises(EvidenceFormatError):
        parse_amd_chain(
            MILAN.split(b"-----END CERTIFICATE-----")[0] + b"-----END CERTIFICATE-----\n"
        )
    chain = parse_amd_chain(MILAN_VLEK)
    assert (chain.product, chain.key) == (Product.MILAN, SigningKey.VLEK)


# ---------------------------------------------------------------------------------------------
# appraisal and binding on verified claims


def _policy(**ref: object) -> AttestationPolicy:
    measurement = GOSEV.expect["measurement"]
    assert isinstance(measurement, str)
    return AttestationPolicy(
        name="snp",
        selector=Selector(namespace="default"),
        allowed_tees=frozenset({Tee.SEV_SNP}),
        reference_values={
            Tee.SEV_SNP: ReferenceValues(
                measurements={"measurement": frozenset({measurement})},
                **ref,  # type: ignore[arg-type]
            )
        },
    )


def test_debug_guest_is_detected_and_rejected_by_appraise(verifier: SevSnpVerifier) -> None:
    claims = _verify(verifier, GOSEV)
    assert claims.debug is True  # policy 0xB0000 has bit 19
    decision = appraise(claims, _policy(), GOSEV.pin)
    assert isinstance(decision, Rejected)
    assert decision.reason == "debug_not_allowed"


def test_tcb_below_policy_minimum_is_rejected(verifier: SevSnpVerifier) -> None:
    claims = _verify(verifier, GOSEV)
    base = _policy(minimum_tcb={"snp": 5, "microcode": 68})
    permissive = AttestationPolicy(
        name=base.name,
        selector=base.selector,
        allowed_tees=base.allowed_tees,
        reference_values=base.reference_values,
        allow_debug=True,
    )
    assert isinstance(appraise(claims, permissive, GOSEV.pin), Admitted)
    strict = _policy(minimum_tcb={"snp": 6})
    strict = AttestationPolicy(
        name=strict.name,
        selector=strict.selector,
        allowed_tees=strict.allowed_tees,
        reference_values=strict.reference_values,
        allow_debug=True,
    )
    decision = appraise(claims, strict, GOSEV.pin)
    assert isinstance(decision, Rejected)
    assert decision.reason == "tcb_below_minimum"


def test_report_data_not_matching_the_binding(verifier: SevSnpVerifier) -> None:
    claims = _verify(verifier, GOSEV)
    nonce, spki = bytes(32), b"\x30\x03\x02\x01\x00"
    assert expected_report_data(nonce, spki) != claims.report_data
    assert not binding_matches(claims.report_data, nonce, spki)


# ---------------------------------------------------------------------------------------------
# synthetic chains: checks that need a key we control


class _Amd:
    """A synthetic AMD-shaped PKI (RSA-2048 for speed, same PSS parameters as AMD's)."""

    PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
    START = datetime(2024, 1, 1, tzinfo=UTC)

    def __init__(self, product: str = "Milan") -> None:
        self.product = product
        self.ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.ark = self._cert(f"ARK-{product}", self.ark_key, f"ARK-{product}", self.ark_key)
        self.ask = self._cert(f"SEV-{product}", self.ask_key, f"ARK-{product}", self.ark_key)

    @staticmethod
    def _name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def _cert(
        self,
        cn: str,
        key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey,
        issuer_cn: str,
        issuer_key: rsa.RSAPrivateKey,
        extensions: Mapping[str, bytes] | None = None,
    ) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(self._name(cn))
            .issuer_name(self._name(issuer_cn))
            .public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(self.START)
            .not_valid_after(self.START + timedelta(days=3650))
        )
        if extensions is None:  # ARK and ASK are CAs, as AMD's are
            builder = builder.add_extension(
                x509.BasicConstraints(ca=True, path_length=None), critical=True
            )
        for oid, value in (extensions or {}).items():
            builder = builder.add_extension(
                x509.UnrecognizedExtension(x509.ObjectIdentifier(oid), value), critical=False
            )
        return builder.sign(issuer_key, hashes.SHA384(), rsa_padding=self.PSS)

    def chain_pem(self) -> bytes:
        return self.ask.public_bytes(Encoding.PEM) + self.ark.public_bytes(Encoding.PEM)

    def vcek(
        self, key: ec.EllipticCurvePrivateKey, spl: Mapping[str, int], hwid: bytes, name: str
    ) -> bytes:
        base = "1.3.6.1.4.1.3704.1."
        ext = {
            base + "2": b"\x16" + bytes([len(name)]) + name.encode(),
            base + "3.1": bytes([2, 1, spl["bootloader"]]),
            base + "3.2": bytes([2, 1, spl["tee"]]),
            base + "3.3": bytes([2, 1, spl["snp"]]),
            base + "3.8": bytes([2, 1, spl["microcode"]]),
            base + "4": hwid,
        }
        cert = self._cert("SEV-VCEK", key, f"SEV-{self.product}", self.ask_key, ext)
        return cert.public_bytes(Encoding.DER)


def _sign(template: bytes, key: ec.EllipticCurvePrivateKey, **fields: bytes) -> bytes:
    offsets = {"reported_tcb": 0x180, "chip_id": 0x1A0, "cpuid": 0x188, "flags": 0x48}
    body = bytearray(template[:SIGNED_LEN])
    for name, value in fields.items():
        body[offsets[name] : offsets[name] + len(value)] = value
    r, s = decode_dss_signature(key.sign(bytes(body), ec.ECDSA(hashes.SHA384())))
    sig = r.to_bytes(72, "little") + s.to_bytes(72, "little")
    return bytes(body) + sig + bytes(REPORT_SIZE - SIGNED_LEN - len(sig))


@pytest.fixture(scope="module")
def synthetic() -> tuple[_Amd, SevSnpVerifier]:
    amd = _Amd()
    return amd, SevSnpVerifier([parse_amd_chain(amd.chain_pem())])


SYN_NOW = datetime(2025, 1, 1, tzinfo=UTC)
SYN_TCB = {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115}
TCB_RAW = bytes([3, 0, 0, 0, 0, 0, 8, 115])
CHIP = bytes(range(64))


def _syn_verify(v: SevSnpVerifier, report: bytes, vcek: bytes, now: datetime = SYN_NOW) -> Claims:
    return v.verify(report, now=now, collateral={"vcek": vcek})


def _syn_reason(v: SevSnpVerifier, report: bytes, vcek: bytes) -> str:
    with pytest.raises(EvidenceVerificationError) as info:
        _syn_verify(v, report, vcek)
    return info.value.reason


def test_synthetic_chain_verifies(synthetic: tuple[_Amd, SevSnpVerifier]) -> None:
    amd, v = synthetic
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, SYN_TCB, CHIP, "Milan-B0")
    report = _sign(IDBLOCK.evidence(), key, reported_tcb=TCB_RAW, chip_id=CHIP)
    claims = _syn_verify(v, report, vcek)
    assert claims.tcb == SYN_TCB
    assert claims.platform_id == CHIP.hex()


def test_authentic_report_with_vcek_tcb_mismatch(synthetic: tuple[_Amd, SevSnpVerifier]) -> None:
    amd, v = synthetic
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, {**SYN_TCB, "snp": 9}, CHIP, "Milan-B0")
    report = _sign(IDBLOCK.evidence(), key, reported_tcb=TCB_RAW, chip_id=CHIP)
    assert _syn_reason(v, report, vcek) == "tcb_mismatch"


def test_authentic_report_with_vcek_hwid_mismatch(synthetic: tuple[_Amd, SevSnpVerifier]) -> None:
    amd, v = synthetic
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, SYN_TCB, bytes(64), "Milan-B0")
    report = _sign(IDBLOCK.evidence(), key, reported_tcb=TCB_RAW, chip_id=CHIP)
    assert _syn_reason(v, report, vcek) == "chip_id_mismatch"


def test_cpuid_and_product_name_disagree(synthetic: tuple[_Amd, SevSnpVerifier]) -> None:
    amd, v = synthetic
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, SYN_TCB, CHIP, "Milan-B0")
    genoa_cpu = bytes([0x19, 0x11, 0x01])
    report = _sign(AZURE.evidence(), key, reported_tcb=TCB_RAW, chip_id=CHIP, cpuid=genoa_cpu)
    assert _syn_reason(v, report, vcek) == "product_mismatch"


def test_unsigned_report_is_signing_key_unsupported(
    synthetic: tuple[_Amd, SevSnpVerifier],
) -> None:
    amd, v = synthetic
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, SYN_TCB, CHIP, "Milan-B0")
    report = _sign(IDBLOCK.evidence(), key, flags=struct.pack("<I", 7 << 2))
    assert _syn_reason(v, report, vcek) == "signing_key_unsupported"


def test_forged_chain_is_not_trusted_by_the_real_verifier(verifier: SevSnpVerifier) -> None:
    amd = _Amd()
    key = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(key, SYN_TCB, CHIP, "Milan-B0")
    report = _sign(IDBLOCK.evidence(), key, reported_tcb=TCB_RAW, chip_id=CHIP)
    # Same names as the real Milan ASK, different key: the pinned ASK does not verify it.
    with pytest.raises(EvidenceVerificationError) as info:
        verifier.verify(report, now=SYN_NOW, collateral={"vcek": vcek})
    assert info.value.reason == "chain_invalid"
    # Bringing the forged chain along: its ARK is not pinned.
    with pytest.raises(EvidenceVerificationError) as info:
        verifier.verify(
            report, now=SYN_NOW, collateral={"vcek": vcek, "cert_chain": amd.chain_pem()}
        )
    assert info.value.reason == "untrusted_root"


def test_amd_chain_objects_are_accepted_by_the_constructor() -> None:
    chain = parse_amd_chain(GENOA)
    assert isinstance(chain, AmdChain)
    v = SevSnpVerifier([chain])
    assert _verify(v, AZURE).details["product"] == "Genoa"


# ---------------------------------------------------------------------------------------------
# hypothesis: the parser raises only EvidenceFormatError


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2 * REPORT_SIZE))
def test_parser_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_evidence(data)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([v.evidence() for v in VECTORS_SNP]),
    st.lists(st.tuples(st.integers(0, REPORT_SIZE - 1), st.integers(0, 255)), max_size=8),
    st.integers(0, REPORT_SIZE + 8),
)
def test_parser_on_mutated_reports(base: bytes, edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(base)
    for offset, value in edits:
        data[offset] = value
    try:
        report = parse_report(bytes(data[:cut]))
    except EvidenceFormatError:
        return
    assert report.version in {2, 3, 4, 5}


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=1600))
def test_hcl_parser_on_arbitrary_tails(tail: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_evidence(b"HCLA" + tail)


def test_verify_on_mutated_reports_raises_only_project_errors(verifier: SevSnpVerifier) -> None:
    base = GOSEV.evidence()
    for offset in range(0, REPORT_SIZE, 7):
        try:
            _verify(verifier, GOSEV, _flip(base, offset, 0xFF))
        except (EvidenceFormatError, EvidenceVerificationError):
            continue
        # Only bytes outside the signed region and signature components may be ignored.
        assert offset >= SIGNED_LEN + 144, offset


def test_warm_verification_reuses_verified_links(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cold: one RSA-PSS link check (VCEK <- ASK; ARK and ASK were checked at construction)
    and one certificate parse. Warm: neither, only the report's ECDSA signature."""
    import certs.evidence.sev_snp as mod
    from certs.evidence.x509chain import ParsedCertificate, RsaPssLinks

    v = SevSnpVerifier([MILAN])
    calls = {"pss": 0, "parse": 0}
    real_pss, real_parse = RsaPssLinks.check, mod._parse_endorsement

    def pss(self: RsaPssLinks, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        calls["pss"] += 1
        real_pss(self, child, parent)

    def parse(data: bytes) -> object:
        calls["parse"] += 1
        return real_parse(data)

    monkeypatch.setattr(RsaPssLinks, "check", pss)
    monkeypatch.setattr(mod, "_parse_endorsement", parse)
    _verify(v, GOSEV)
    assert calls == {"pss": 1, "parse": 1}
    for _ in range(3):
        _verify(v, GOSEV)
    assert calls == {"pss": 1, "parse": 1}
    # A tampered report still fails when warm: the signature is always checked.
    assert _reason(v, GOSEV, _flip(GOSEV.evidence(), 0x90)) == "signature_invalid"
