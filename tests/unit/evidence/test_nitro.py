from __future__ import annotations

import base64
import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import cbor2
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certs.binding import binding_matches, expected_report_data
from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence import nitro
from certs.evidence.claims import Tee, evidence_digest
from certs.evidence.nitro import NitroVerifier, looks_like, parse_attestation_document
from certs.policy import AttestationPolicy, ReferenceValues, Rejected, Selector, appraise
from tests.vectors import VECTORS, pin

NITRO = VECTORS / "nitro"
ROOT = (NITRO / "aws_nitro_enclaves_root_g1.pem").read_bytes()
ZERO48 = "00" * 48


@dataclass(frozen=True)
class Vector:
    file: str
    pin: str
    not_before: str
    not_after: str
    module_id: str
    timestamp_ms: int
    pcrs: dict[str, str]
    debug: bool
    user_data: bytes
    nonce_prefix: str
    nonce_len: int
    public_key: bytes


VECTORS_NITRO = [
    Vector(
        "veracruz_eu-west-1_20221109.cbor",
        "2022-11-09T23:00:00Z",
        "2022-11-09T22:51:57Z",
        "2022-11-10T01:52:00Z",
        "i-04fd167167daacf3b-enc01845e97d0b3eb4e",
        1668034320696,
        {
            "pcr0": (
                "22f9e1c949208da55eb01b9b9fc88f87454f77ba133f0d82"
                "320b509621c92482152a99d0a12335b97178c02d6f977d01"
            ),
            "pcr1": (
                "bcdf05fefccaa8e55bf2c8d6dee9e79bbff31e34bf28a99a"
                "a19e6b29c37ee80b214a414b7607236edf26fcb78654e63f"
            ),
            "pcr2": (
                "00943ea859140fed74e1025fe41aedb38780eae5656b3f9e"
                "f9b4b0e6111350315544db3efcda05725108f72b2ab141f7"
            ),
            "pcr4": (
                "4554042339e6a1ddfac89db7da58231d5619073729344333"
                "aff055429abeec6b006f81b19d1176001b8291f885283106"
            ),
            "pcr8": ZERO48,
        },
        False,
        bytes.fromhex("7c37108079b3e8a36d8a7970de1d6d4ff1461e0e35d9557c4d789df5e0576620"),
        "c678c86135de539d183acff58886d98dfb9823041af9f934bf909ac0f8d96245",
        32,
        b"",
    ),
    Vector(
        "evervault_us-east-1_20221013.cbor",
        "2022-10-13T09:00:00Z",
        "2022-10-13T08:57:59Z",
        "2022-10-13T11:58:02Z",
        "i-020b6af9246d90e92-enc0183d09086c24190",
        1665651482136,
        {
            "pcr0": (
                "f4d48b81a460c9916d1e685119074bf24660afd3e34fae9f"
                "ca0a0d28d9d5599936332687e6f66fc890ac8cf150142d8b"
            ),
            "pcr1": (
                "bcdf05fefccaa8e55bf2c8d6dee9e79bbff31e34bf28a99a"
                "a19e6b29c37ee80b214a414b7607236edf26fcb78654e63f"
            ),
            "pcr2": (
                "d8f114da658de5481f8d9ec73907feb553560787522f705c"
                "92d7d96beed8e15e2aa611984e098c576832c292e8dc469a"
            ),
            "pcr8": (
                "8790eb3cce6c83d07e84b126dc61ca923333d6f66615c4a7"
                "9157de48c5ab2418bdc60746ea7b7afbff03a1c6210201cb"
            ),
        },
        False,
        b"",
        "cb3dc2eb76c0c134",
        256,
        b"",
    ),
    Vector(
        "evervault_debug_us-east-1_20221012.cbor",
        "2022-10-12T14:00:00Z",
        "2022-10-12T13:49:51Z",
        "2022-10-12T16:49:54Z",
        "i-03ad7cdb817437eeb-enc0183cc7569b3f6e1",
        1665582606081,
        {"pcr0": ZERO48, "pcr1": ZERO48, "pcr2": ZERO48, "pcr8": ZERO48},
        True,
        b"hello, world!",
        "",
        0,
        b"my super secret key",
    ),
    Vector(
        "evervault_debug_us-east-1_20230918.cbor.b64",
        "2023-09-18T15:10:00Z",
        "2023-09-18T14:37:09Z",
        "2023-09-18T17:37:12Z",
        "i-0918f6c55e3b61d89-enc018aa8b8e2285d13",
        1695049410860,
        {"pcr0": ZERO48, "pcr1": ZERO48, "pcr2": ZERO48, "pcr8": ZERO48},
        True,
        b"",  # checked separately: a 91-byte SPKI
        "",
        256,
        b"",
    ),
]


def load(name: str) -> bytes:
    data = (NITRO / name).read_bytes()
    return base64.b64decode(data, validate=False) if name.endswith(".b64") else data


GOOD = load("veracruz_eu-west-1_20221109.cbor")
GOOD_PIN = pin("2022-11-09T23:00:00Z")


@pytest.fixture(scope="module")
def verifier() -> NitroVerifier:
    return NitroVerifier(ROOT)


@pytest.mark.parametrize("vec", VECTORS_NITRO, ids=lambda v: v.file)
def test_vector_verifies_with_documented_fields(verifier: NitroVerifier, vec: Vector) -> None:
    evidence = load(vec.file)
    claims = verifier.verify(evidence, now=pin(vec.pin), collateral={})
    assert claims.tee is Tee.NITRO
    assert claims.platform_id == vec.module_id
    assert claims.details["timestamp_ms"] == vec.timestamp_ms
    assert claims.details["digest"] == "SHA384"
    assert set(claims.measurements) == {f"pcr{i}" for i in range(16)}
    for key, value in vec.pcrs.items():
        assert claims.measurements[key] == value
    assert claims.debug is vec.debug
    assert claims.details["nonce_len"] == vec.nonce_len
    assert str(claims.details["nonce"]).startswith(vec.nonce_prefix)
    assert claims.details["public_key"] == vec.public_key.hex()
    assert claims.details["public_key_len"] == len(vec.public_key)
    assert claims.evidence_sha256 == evidence_digest(evidence)
    if vec.file.endswith(".b64"):
        spki = serialization.load_der_public_key(claims.report_data)
        assert isinstance(spki, ec.EllipticCurvePublicKey)
        assert spki.curve.name == "secp256r1"
        assert len(claims.report_data) == claims.details["user_data_len"] == 91
    else:
        assert claims.report_data == vec.user_data


@pytest.mark.parametrize("vec", VECTORS_NITRO, ids=lambda v: v.file)
def test_vector_window_edges(vec: Vector) -> None:
    verifier = NitroVerifier(ROOT)  # fresh: the cache must not hide time checks
    evidence = load(vec.file)
    verifier.verify(evidence, now=pin(vec.not_before), collateral={})
    verifier.verify(evidence, now=pin(vec.not_after), collateral={})
    with pytest.raises(EvidenceVerificationError) as early:
        verifier.verify(evidence, now=pin(vec.not_before) - timedelta(seconds=1), collateral={})
    assert early.value.reason == "certificate_not_yet_valid"
    with pytest.raises(EvidenceVerificationError) as late:
        verifier.verify(evidence, now=pin(vec.not_after) + timedelta(seconds=1), collateral={})
    assert late.value.reason == "certificate_expired"


def test_bad_sig_vector_fails_signature(verifier: NitroVerifier) -> None:
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(
            load("veracruz_eu-west-1_20221109_bad_sig.cbor"), now=GOOD_PIN, collateral={}
        )
    assert err.value.reason == "signature_invalid"


def test_flipped_payload_byte_fails_signature(verifier: NitroVerifier) -> None:
    # Change one character of module_id inside the payload: still well-formed, no longer signed.
    at = GOOD.index(b"i-04fd167167daacf3b")
    evidence = GOOD[: at + 2] + b"1" + GOOD[at + 3 :]
    assert parse_attestation_document(evidence).module_id.startswith("i-14fd")
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(evidence, now=GOOD_PIN, collateral={})
    assert err.value.reason == "signature_invalid"


def test_flipped_pcr_byte_fails_signature(verifier: NitroVerifier) -> None:
    pcr0 = bytes.fromhex(VECTORS_NITRO[0].pcrs["pcr0"])
    at = GOOD.index(pcr0)
    evidence = GOOD[:at] + bytes([GOOD[at] ^ 1]) + GOOD[at + 1 :]
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(evidence, now=GOOD_PIN, collateral={})
    assert err.value.reason == "signature_invalid"


@pytest.mark.parametrize("offset", [0, 47, 48, 95])
def test_flipped_signature_byte_fails(verifier: NitroVerifier, offset: int) -> None:
    at = len(GOOD) - 96 + offset
    evidence = GOOD[:at] + bytes([GOOD[at] ^ 0x80]) + GOOD[at + 1 :]
    with pytest.raises(EvidenceVerificationError) as err:
        verifier.verify(evidence, now=GOOD_PIN, collateral={})
    assert err.value.reason == "signature_invalid"


@pytest.mark.parametrize("cut", [1, 2, 10, 100, 2000, len(GOOD) - 1])
def test_truncation_is_a_format_error(verifier: NitroVerifier, cut: int) -> None:
    with pytest.raises(EvidenceFormatError) as err:
        verifier.verify(GOOD[:cut], now=GOOD_PIN, collateral={})
    assert err.value.reason == "truncated"


def test_trailing_bytes_are_rejected() -> None:
    with pytest.raises(EvidenceFormatError) as err:
        parse_attestation_document(GOOD + b"\x00")
    assert err.value.reason == "trailing_data"


def test_empty_and_oversized_inputs() -> None:
    with pytest.raises(EvidenceFormatError) as empty:
        parse_attestation_document(b"")
    assert empty.value.reason == "truncated"
    with pytest.raises(EvidenceFormatError) as big:
        parse_attestation_document(b"\x84" + bytes(nitro.MAX_DOCUMENT))
    assert big.value.reason == "too_large"


def test_raw_base64_text_is_not_a_document() -> None:
    text = (NITRO / "evervault_debug_us-east-1_20230918.cbor.b64").read_bytes()
    assert not looks_like(text)
    with pytest.raises(EvidenceFormatError) as err:
        parse_attestation_document(text)
    assert err.value.reason in {"cose_invalid", "trailing_data"}


def test_tag_18_document_verifies(verifier: NitroVerifier) -> None:
    tagged = b"\xd2" + GOOD
    assert looks_like(tagged)
    claims = verifier.verify(tagged, now=GOOD_PIN, collateral={})
    assert claims.platform_id == VECTORS_NITRO[0].module_id
    with pytest.raises(EvidenceFormatError) as err:
        parse_attestation_document(b"\xd3" + GOOD)  # tag 19 is not COSE_Sign1
    assert err.value.reason == "cose_invalid"


def test_wrong_root_is_untrusted() -> None:
    other = (VECTORS / "nvidia" / "nvidia_device_identity_root.pem").read_bytes()
    with pytest.raises(EvidenceVerificationError) as err:
        NitroVerifier(other).verify(GOOD, now=GOOD_PIN, collateral={})
    assert err.value.reason == "untrusted_root"


def test_debug_is_detected_and_rejected_by_policy(verifier: NitroVerifier) -> None:
    claims = verifier.verify(
        load("evervault_debug_us-east-1_20221012.cbor"),
        now=pin("2022-10-12T14:00:00Z"),
        collateral={},
    )
    assert claims.debug
    policy = AttestationPolicy(
        name="default/p",
        selector=Selector("default", frozenset({"sa"})),
        allowed_tees=frozenset({Tee.NITRO}),
        reference_values={Tee.NITRO: ReferenceValues(measurements={"pcr0": frozenset({ZERO48})})},
    )
    decision = appraise(claims, policy, pin("2022-10-12T14:00:00Z"))
    assert isinstance(decision, Rejected)
    assert decision.reason == "debug_not_allowed"


def test_vector_report_data_does_not_match_a_foreign_binding(verifier: NitroVerifier) -> None:
    claims = verifier.verify(GOOD, now=GOOD_PIN, collateral={})
    spki = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    nonce = bytes.fromhex(str(claims.details["nonce"]))
    assert not binding_matches(claims.report_data, nonce, spki)


def test_looks_like() -> None:
    for vec in VECTORS_NITRO:
        assert looks_like(load(vec.file))
    assert not looks_like((VECTORS / "sev-snp" / "milan_v2_gosevguest" / "report.bin").read_bytes())
    assert not looks_like((VECTORS / "nvidia" / "hopper_trustee" / "report.hex").read_bytes())
    assert not looks_like(b"")


# ---------------------------------------------------------------------------------------------
# Synthetic documents signed by a test PKI: binding round trip and chain rules.


@dataclass
class Pki:
    root_pem: bytes
    bundle: list[bytes]
    leaf_der: bytes
    leaf_key: ec.EllipticCurvePrivateKey


NOW = datetime(2030, 1, 1, tzinfo=UTC)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool | None,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - timedelta(hours=1))
        .not_valid_after(NOW + timedelta(hours=1))
    )
    if ca is not None:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
    return builder.sign(issuer_key, hashes.SHA384())


def make_pki(*, intermediate_ca: bool | None = True) -> Pki:
    keys = [ec.generate_private_key(ec.SECP384R1()) for _ in range(3)]
    root = _cert("root", keys[0], "root", keys[0], ca=True)
    mid = _cert("mid", keys[1], "root", keys[0], ca=intermediate_ca)
    leaf = _cert("leaf", keys[2], "mid", keys[1], ca=False)
    der = serialization.Encoding.DER
    return Pki(
        root.public_bytes(serialization.Encoding.PEM),
        [root.public_bytes(der), mid.public_bytes(der)],
        leaf.public_bytes(der),
        keys[2],
    )


def sign_document(
    pki: Pki,
    *,
    user_data: bytes | None,
    tag: bool = False,
    extra: dict[str, object] | None = None,
) -> bytes:
    payload = {
        "module_id": "i-0123-enc0456",
        "digest": "SHA384",
        "timestamp": 1893456000000,
        "pcrs": {i: bytes([i]) * 48 for i in range(16)},
        "certificate": pki.leaf_der,
        "cabundle": pki.bundle,
        "public_key": None,
        "user_data": user_data,
        "nonce": None,
        **(extra or {}),
    }
    protected = cbor2.dumps({1: -35})
    body = cbor2.dumps(payload)
    der = pki.leaf_key.sign(nitro.sig_structure(protected, body), ec.ECDSA(hashes.SHA384()))
    r, s = decode_dss_signature(der)
    sig = r.to_bytes(48, "big") + s.to_bytes(48, "big")
    doc: object = [protected, {}, body, sig]
    if tag:
        doc = cbor2.CBORTag(18, doc)
    return bytes(cbor2.dumps(doc))


def test_key_binding_round_trip_through_user_data() -> None:
    pki = make_pki()
    nonce = bytes(range(32))
    spki = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    evidence = sign_document(pki, user_data=expected_report_data(nonce, spki), tag=True)
    claims = NitroVerifier(pki.root_pem).verify(evidence, now=NOW, collateral={})
    assert binding_matches(claims.report_data, nonce, spki)
    assert not binding_matches(claims.report_data, bytes(32), spki)
    assert not claims.debug


def test_intermediate_without_ca_constraint_breaks_the_chain() -> None:
    for ca in (False, None):
        pki = make_pki(intermediate_ca=ca)
        with pytest.raises(EvidenceVerificationError) as err:
            NitroVerifier(pki.root_pem).verify(
                sign_document(pki, user_data=None), now=NOW, collateral={}
            )
        assert err.value.reason == "chain_invalid"


def test_leaf_from_another_issuer_breaks_the_chain() -> None:
    pki, other = make_pki(), make_pki()
    evidence = sign_document(
        Pki(pki.root_pem, pki.bundle, other.leaf_der, other.leaf_key), user_data=None
    )
    with pytest.raises(EvidenceVerificationError) as err:
        NitroVerifier(pki.root_pem).verify(evidence, now=NOW, collateral={})
    assert err.value.reason == "chain_invalid"


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"digest": "SHA256"}, "field_value"),
        ({"timestamp": "now"}, "field_type"),
        ({"pcrs": {0: b"short"}}, "field_value"),
        ({"pcrs": {"0": bytes(48)}}, "field_type"),
        ({"cabundle": []}, "field_value"),
        ({"nonce": "text"}, "field_type"),
        ({"nonce": bytes(1025)}, "field_value"),
        ({"surprise": 1}, "field_unknown"),
        ({"module_id": b"bytes"}, "field_type"),
    ],
)
def test_payload_field_rules(extra: dict[str, object], reason: str) -> None:
    pki = make_pki()
    with pytest.raises(EvidenceFormatError) as err:
        parse_attestation_document(sign_document(pki, user_data=None, extra=extra))
    assert err.value.reason == reason


def test_missing_field_and_wrong_algorithm() -> None:
    doc = cbor2.loads(GOOD)
    payload = cbor2.loads(doc[2])
    del payload["certificate"]
    with pytest.raises(EvidenceFormatError) as missing:
        parse_attestation_document(cbor2.dumps([doc[0], {}, cbor2.dumps(payload), doc[3]]))
    assert missing.value.reason == "field_missing"
    with pytest.raises(EvidenceFormatError) as alg:
        parse_attestation_document(cbor2.dumps([cbor2.dumps({1: -7}), {}, doc[2], doc[3]]))
    assert alg.value.reason == "algorithm_unsupported"
    with pytest.raises(EvidenceFormatError) as shape:
        parse_attestation_document(cbor2.dumps([doc[0], {}, doc[2]]))
    assert shape.value.reason == "cose_invalid"


# ---------------------------------------------------------------------------------------------
# Robustness: the parser raises only EvidenceFormatError, the verifier only the project's errors.


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_format_errors(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_attestation_document(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=512).map(lambda b: b"\x84" + b))
def test_array_prefixed_bytes_raise_only_format_errors(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_attestation_document(data)


_MUTATION_VERIFIER = NitroVerifier(ROOT)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)), min_size=1, max_size=4),
    st.integers(0, len(GOOD)),
)
def test_mutated_vector_raises_only_project_errors(flips: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(GOOD[: max(cut, 1)])
    for at, mask in flips:
        if at < len(data):
            data[at] ^= mask
    with contextlib.suppress(EvidenceFormatError, EvidenceVerificationError):
        _MUTATION_VERIFIER.verify(bytes(data), now=GOOD_PIN, collateral={})
