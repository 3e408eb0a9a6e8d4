from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.binding import binding_matches
from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence import nvidia_gpu
from certs.evidence.claims import Tee, evidence_digest
from certs.evidence.nvidia_gpu import NvidiaGpuVerifier, looks_like, parse_measurement_report
from tests.vectors import VECTORS, pin

NV = VECTORS / "nvidia"
ROOT = (NV / "nvidia_device_identity_root.pem").read_bytes()
NOW = pin("2025-01-01T00:00:00Z")


@dataclass(frozen=True)
class Vector:
    folder: str
    nonce: str
    driver: str
    vbios: str | None
    fwid: str
    opaque_len: int
    trailing: int
    opaque_version: int


VECTORS_NV = [
    Vector(
        "hopper_trustee",
        "931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb",
        "550.90.07",
        "009f009601000000",
        "f5c384aebb579217a2c66b17ed0f28e6a9b8d639041acd7b4721cec004f7275494ba94bb5cdfdb3055ee051762b1f75d",
        422,
        0,
        0,
    ),
    Vector(
        "hopper_coco_trustee",
        "87d8e24ab336adafe228d49e83d745f6dba4ae505372b6a5704820856b343fec",
        "580.95.05",
        None,
        "",
        434,
        1,
        1,
    ),
]


def report(folder: str) -> bytes:
    return (NV / folder / "report.hex").read_bytes()


def chain(folder: str) -> bytes:
    return (NV / folder / "cert_chain.pem").read_bytes()


GOOD = bytes.fromhex(report("hopper_trustee").decode())
GOOD_CHAIN = {"cert_chain": chain("hopper_trustee")}


@pytest.fixture(scope="module")
def verifier() -> NvidiaGpuVerifier:
    return NvidiaGpuVerifier(ROOT)


@pytest.mark.parametrize("vec", VECTORS_NV, ids=lambda v: v.folder)
def test_vector_verifies_with_documented_fields(verifier: NvidiaGpuVerifier, vec: Vector) -> None:
    evidence = report(vec.folder)
    claims = verifier.verify(evidence, now=NOW, collateral={"cert_chain": chain(vec.folder)})
    assert claims.tee is Tee.NVIDIA_GPU
    assert claims.report_data.hex() == vec.nonce
    assert set(claims.measurements) == {f"measurement_{i}" for i in range(1, 65)}
    assert all(len(v) == 96 for v in claims.measurements.values())
    assert claims.details["driver_version"] == vec.driver
    if vec.vbios:
        assert claims.details["vbios_version"] == vec.vbios
    if vec.fwid:
        assert claims.details["fwid"] == vec.fwid
    assert claims.details["chip_sku"] == "882"
    assert claims.details["project"] == "1010"
    assert claims.details["measurement_blocks"] == 64
    assert claims.details["trailing_bytes"] == vec.trailing
    assert claims.details["opaque_data_version"] == vec.opaque_version
    assert claims.debug is False
    assert claims.evidence_sha256 == evidence_digest(evidence)
    parsed = parse_measurement_report(evidence)
    assert sum(4 + len(v) for v in parsed.opaque.values()) == vec.opaque_len
    assert len(parsed.signed) + 96 + vec.trailing == len(bytes.fromhex(evidence.decode()))


def test_binary_and_hex_forms_give_the_same_claims(verifier: NvidiaGpuVerifier) -> None:
    from_hex = verifier.verify(report("hopper_trustee"), now=NOW, collateral=GOOD_CHAIN)
    from_bin = verifier.verify(GOOD, now=NOW, collateral=GOOD_CHAIN)
    assert from_hex.measurements == from_bin.measurements
    assert from_hex.details == from_bin.details


def test_constructor_chain_and_missing_chain() -> None:
    with_chain = NvidiaGpuVerifier(ROOT, cert_chain=chain("hopper_trustee"))
    assert with_chain.verify(GOOD, now=NOW, collateral={}).report_data == GOOD[4:36]
    with pytest.raises(EvidenceVerificationError) as err:
        NvidiaGpuVerifier(ROOT).verify(GOOD, now=NOW, collateral={})
    assert err.value.reason == "collateral_missing"


def test_other_devices_chain_fails_signature(verifier: NvidiaGpuVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(GOOD, now=NOW, collateral={"cert_chain": chain("hopper_coco_trustee")})
    assert err.value.reason == "signature_invalid"


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_flipped_measurement_byte_fails_signature(verifier: NvidiaGpuVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(_flip(GOOD, 37 + 8 + 7 + 10), now=NOW, collateral=GOOD_CHAIN)
    assert err.value.reason == "signature_invalid"


def test_flipped_nonce_byte_fails_signature(verifier: NvidiaGpuVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(_flip(GOOD, 4), now=NOW, collateral=GOOD_CHAIN)
    assert err.value.reason == "signature_invalid"


@pytest.mark.parametrize("offset", [0, 47, 48, 95])
def test_flipped_signature_byte_fails(verifier: NvidiaGpuVerifier, offset: int) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(_flip(GOOD, len(GOOD) - 96 + offset), now=NOW, collateral=GOOD_CHAIN)
    assert err.value.reason == "signature_invalid"


@pytest.mark.parametrize("cut", [0, 3, 36, 40, 45, 1000, len(GOOD) - 1])
def test_truncation_is_a_format_error(verifier: NvidiaGpuVerifier, cut: int) -> None:
    with pytest.raises(EvidenceFormatError) as err:
        verifier.verify(GOOD[:cut], now=NOW, collateral=GOOD_CHAIN)
    assert err.value.reason in {"truncated", "hex_invalid"}
    if cut >= 2:
        assert err.value.reason == "truncated"


def test_too_many_trailing_bytes_and_bad_hex() -> None:
    with pytest.raises(EvidenceFormatError) as trailing:
        parse_measurement_report(GOOD + bytes(nvidia_gpu.MAX_TRAILING + 1))
    assert trailing.value.reason == "spdm_invalid"
    with pytest.raises(EvidenceFormatError) as bad_hex:
        parse_measurement_report(b"11e0zz")
    assert bad_hex.value.reason == "hex_invalid"
    with pytest.raises(EvidenceFormatError) as unsigned:
        parse_measurement_report(GOOD[:2] + b"\x00" + GOOD[3:])
    assert unsigned.value.reason == "spdm_invalid"


def test_wrong_root_is_untrusted() -> None:
    nitro_root = (VECTORS / "nitro" / "aws_nitro_enclaves_root_g1.pem").read_bytes()
    with pytest.raises(EvidenceVerificationError) as err:
        NvidiaGpuVerifier(nitro_root).verify(GOOD, now=NOW, collateral=GOOD_CHAIN)
    assert err.value.reason == "untrusted_root"


def test_chain_without_the_root_still_anchors(verifier: NvidiaGpuVerifier) -> None:
    pems = chain("hopper_trustee").split(b"-----END CERTIFICATE-----")
    without_root = b"-----END CERTIFICATE-----".join(pems[:4]) + b"-----END CERTIFICATE-----\n"
    claims = verifier.verify(GOOD, now=NOW, collateral={"cert_chain": without_root})
    assert claims.details["measurement_blocks"] == 64


def test_before_the_chain_is_valid(verifier: NvidiaGpuVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(GOOD, now=pin("2020-01-01T00:00:00Z"), collateral=GOOD_CHAIN)
    assert err.value.reason == "certificate_not_yet_valid"


def test_nonce_is_report_data_not_a_foreign_binding(verifier: NvidiaGpuVerifier) -> None:
    claims = verifier.verify(GOOD, now=NOW, collateral=GOOD_CHAIN)
    spki = b"\x30\x00"
    assert len(claims.report_data) == 32
    assert not binding_matches(claims.report_data, claims.report_data, spki)


def test_looks_like() -> None:
    for vec in VECTORS_NV:
        assert looks_like(report(vec.folder))
    assert looks_like(GOOD)
    assert not looks_like((VECTORS / "nitro" / "veracruz_eu-west-1_20221109.cbor").read_bytes())
    assert not looks_like(b"")


# ---------------------------------------------------------------------------------------------
# Synthetic reports from a test PKI: FWID rules.

T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _der(tag: int, body: bytes) -> bytes:
    if len(body) < 0x80:
        return bytes((tag, len(body))) + body
    assert len(body) < 0x100
    return bytes((tag, 0x81, len(body))) + body


def tcb_info(fwid: bytes) -> bytes:
    sha384_oid = bytes.fromhex("0609608648016503040202")
    return _der(0x30, _der(0xA6, _der(0x30, sha384_oid + _der(0x04, fwid))))


def make_leaf(
    fwid: bytes | None, tcb: bytes | None = None
) -> tuple[bytes, ec.EllipticCurvePrivateKey]:
    """A chain whose leaf carries ``tcb`` as its TcbInfo (default: ``tcb_info(fwid)``)."""
    root_key, leaf_key = (ec.generate_private_key(ec.SECP384R1()) for _ in range(2))

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def base(subject: str, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name("root"))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(T0 - timedelta(days=1))
            .not_valid_after(T0 + timedelta(days=1))
        )

    root = base("root", root_key).add_extension(x509.BasicConstraints(True, None), True)
    leaf = base("leaf", leaf_key)
    if fwid is not None or tcb is not None:
        value = tcb if tcb is not None else tcb_info(fwid or b"")
        oid = x509.ObjectIdentifier("2.23.133.5.4.1")
        leaf = leaf.add_extension(x509.UnrecognizedExtension(oid, value), False)
    pem = serialization.Encoding.PEM
    bundle = leaf.sign(root_key, hashes.SHA384()).public_bytes(pem) + root.sign(
        root_key, hashes.SHA384()
    ).public_bytes(pem)
    return bundle, leaf_key


def build_report(key: ec.EllipticCurvePrivateKey, fwid: bytes, nonce: bytes) -> bytes:
    request = b"\x11\xe0\x01\xff" + nonce + b"\x00"
    value = bytes(range(48))
    block = bytes((1, 1)) + struct.pack("<H", 51) + b"\x01" + struct.pack("<H", 48) + value
    opaque = struct.pack("<HH", 20, len(fwid)) + fwid + struct.pack("<HH", 3, 4) + b"1.0\x00"
    response = (
        b"\x11\x60\x00\x00\x01"
        + len(block).to_bytes(3, "little")
        + block
        + bytes(32)
        + struct.pack("<H", len(opaque))
        + opaque
    )
    r, s = decode_dss_signature(key.sign(request + response, ec.ECDSA(hashes.SHA384())))
    return request + response + r.to_bytes(48, "big") + s.to_bytes(48, "big")


def test_synthetic_report_with_matching_fwid_verifies() -> None:
    fwid = bytes(range(48))
    bundle, key = make_leaf(fwid)
    root_pem = bundle[bundle.index(b"-----BEGIN", 10) :]
    claims = NvidiaGpuVerifier(root_pem).verify(
        build_report(key, fwid, bytes(32)), now=T0, collateral={"cert_chain": bundle}
    )
    assert claims.measurements == {"measurement_1": bytes(range(48)).hex()}
    assert claims.details["driver_version"] == "1.0"


@pytest.mark.parametrize("leaf_fwid", [bytes(48), None])
def test_fwid_mismatch(leaf_fwid: bytes | None) -> None:
    bundle, key = make_leaf(leaf_fwid)
    root_pem = bundle[bundle.index(b"-----BEGIN", 10) :]
    with pytest.raises(EvidenceVerificationError) as err:
        NvidiaGpuVerifier(root_pem).verify(
            build_report(key, b"\x01" * 48, bytes(32)), now=T0, collateral={"cert_chain": bundle}
        )
    assert err.value.reason == "fwid_mismatch"


SHA384 = bytes.fromhex("0609608648016503040202")
SHA256 = bytes.fromhex("0609608648016503040201")
REPORTED = b"\x07" * 48


def _verify_with_tcb(tcb: bytes) -> None:
    bundle, key = make_leaf(None, tcb)
    root_pem = bundle[bundle.index(b"-----BEGIN", 10) :]
    NvidiaGpuVerifier(root_pem).verify(
        build_report(key, REPORTED, bytes(32)), now=T0, collateral={"cert_chain": bundle}
    )


def test_the_reported_fwid_may_be_any_sha384_entry_of_the_fwid_list() -> None:
    other = _der(0x30, SHA384 + _der(0x04, b"\x01" * 48))
    mine = _der(0x30, SHA384 + _der(0x04, REPORTED))
    _verify_with_tcb(_der(0x30, _der(0xA6, mine + other)))  # not the last octet string


def test_nvidia_layout_fwid_directly_in_the_sequence_is_read() -> None:
    _verify_with_tcb(_der(0x30, b"\x02\x01\x01" + _der(0x30, SHA384 + _der(0x04, REPORTED))))


@pytest.mark.parametrize(
    ("tcb", "message"),
    [
        # the right bytes at the tail, but a SHA-256 FWID
        (_der(0x30, _der(0xA6, _der(0x30, SHA256 + _der(0x04, REPORTED)))), "no SHA-384"),
        # the right bytes at the tail, but a bare OCTET STRING (vendorInfo-like), no FWID
        (_der(0x30, b"\x02\x01\x01" + _der(0x04, REPORTED)), "no SHA-384"),
        # the right bytes at the tail of something that is not DER
        (b"\x30\x7f\x02\x01\x01" + _der(0x04, REPORTED), "not DER"),
        (_der(0x30, _der(0xA6, _der(0x30, SHA384 + _der(0x04, b"\x01" * 48)))), "differs"),
    ],
)
def test_fwid_is_read_from_the_structure_not_the_tail(tcb: bytes, message: str) -> None:
    assert tcb.endswith(_der(0x04, REPORTED)) or message == "differs"
    with pytest.raises(EvidenceVerificationError) as err:
        _verify_with_tcb(tcb)
    assert err.value.reason == "fwid_mismatch"
    assert message in str(err.value)


def test_the_vectors_leaves_carry_exactly_the_reported_fwid() -> None:
    for vec in (v for v in VECTORS_NV if v.fwid):
        certs = x509.load_pem_x509_certificates(chain(vec.folder))
        ext = certs[0].extensions.get_extension_for_oid(nvidia_gpu.FWID_OID).value
        assert isinstance(ext, x509.UnrecognizedExtension)
        fwids = nvidia_gpu.leaf_fwids(ext.value)
        assert [d.hex() for a, d in fwids if a == nvidia_gpu.SHA384_OID] == [vec.fwid]


# ---------------------------------------------------------------------------------------------
# Robustness


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_format_errors(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_measurement_report(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600).map(lambda b: GOOD[:45] + b))
def test_valid_prefix_then_garbage_raises_only_format_errors(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_measurement_report(data)


_MUTATION_VERIFIER = NvidiaGpuVerifier(ROOT, cert_chain=chain("hopper_trustee"))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), max_size=4),
    st.integers(1, len(GOOD)),
)
def test_mutated_vector_raises_only_project_errors(flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(GOOD[:cut])
    for at, mask in flips:
        if at < len(data):
            data[at] ^= mask
    with contextlib.suppress(EvidenceFormatError, EvidenceVerificationError):
        _MUTATION_VERIFIER.verify(bytes(data), now=NOW, collateral={})
