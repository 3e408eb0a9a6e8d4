"""The shared X.509/DER toolkit on its own: the validity check, the DER helpers, the chain
verifier with both link schemes, and the strict CRL reader (the verifiers' tests cover it on
real vectors; these pin its contracts with a small synthetic PKI)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.x509chain import (
    ChainVerifier,
    EcdsaLinks,
    RsaPssLinks,
    Window,
    check_window,
    der_items,
    der_single,
    der_tlv,
    der_uint,
    parse_certificate,
    parse_crl,
    verify_raw_ecdsa,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
Key = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    cn: str,
    key: Key,
    issuer_cn: str,
    issuer_key: Key,
    *,
    ca: bool | None,
    days: tuple[int, int] = (0, 365),
) -> bytes:
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(issuer_cn))
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(T0 + timedelta(days=days[0]))
        .not_valid_after(T0 + timedelta(days=days[1]))
    )
    if ca is not None:
        builder = builder.add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
    if isinstance(issuer_key, rsa.RSAPrivateKey):
        cert = builder.sign(issuer_key, hashes.SHA384(), rsa_padding=PSS)
    else:
        cert = builder.sign(issuer_key, hashes.SHA384())
    return cert.public_bytes(Encoding.DER)


@pytest.fixture(scope="module")
def ecdsa_pki() -> dict[str, bytes]:
    root_k, mid_k, leaf_k = (ec.generate_private_key(ec.SECP384R1()) for _ in range(3))
    return {
        "root": _cert("root", root_k, "root", root_k, ca=True),
        "mid": _cert("mid", mid_k, "root", root_k, ca=True, days=(10, 200)),
        "mid_not_ca": _cert("mid", mid_k, "root", root_k, ca=False),
        "leaf": _cert("leaf", leaf_k, "mid", mid_k, ca=None, days=(20, 100)),
    }


def _ecdsa(root: bytes) -> ChainVerifier:
    return ChainVerifier(
        root, links=EcdsaLinks(ec.SECP384R1, hashes.SHA384), leaf_curve=ec.SECP384R1
    )


def _reason(fn: object, *args: object) -> str:
    with pytest.raises(EvidenceVerificationError) as err:
        fn(*args)  # type: ignore[operator]
    return err.value.reason


# ---------------------------------------------------------------------------------------------
# the validity check


def test_check_window_names_the_binding_bound_and_needs_an_aware_now() -> None:
    w = Window.intersection(
        [
            Window(T0, T0 + timedelta(days=9), "a", "a"),
            Window(T0 + timedelta(days=1), T0 + timedelta(days=5), "b", "b"),
        ]
    )
    assert (w.not_before, w.not_after) == (T0 + timedelta(days=1), T0 + timedelta(days=5))
    check_window(w, T0 + timedelta(days=3))
    with pytest.raises(EvidenceVerificationError) as early:
        check_window(w, T0, kind="collateral")
    assert early.value.reason == "collateral_not_yet_valid" and early.value.detail.startswith("b ")
    with pytest.raises(EvidenceVerificationError) as late:
        check_window(w, T0 + timedelta(days=6))
    assert late.value.reason == "certificate_expired" and late.value.detail.startswith("b ")
    with pytest.raises(ValueError, match="aware"):
        check_window(w, datetime(2025, 1, 3))  # naive: the point of the test


# ---------------------------------------------------------------------------------------------
# DER helpers


def test_der_helpers_split_and_reject_malformed_input() -> None:
    seq = bytes([0x30, 0x06, 0x02, 0x01, 0x05, 0x04, 0x01, 0xAA])
    assert der_tlv(seq) == (0x30, 2, 8)
    assert der_items(der_single(seq, 0x30)) == [(0x02, b"\x05"), (0x04, b"\xaa")]
    assert der_uint(b"\x00\x80") == 128
    long_form = bytes([0x04, 0x81, 0x80]) + bytes(128)
    assert der_single(long_form, 0x04) == bytes(128)
    for bad in (b"\x30", b"\x30\x05\x02", b"\x30\x84\x00\x00\x00\x01\x00"):
        with pytest.raises(ValueError):
            der_items(bad)
    with pytest.raises(ValueError):
        der_single(seq + b"\x05\x00", 0x30)  # two elements
    with pytest.raises(ValueError):
        der_single(seq, 0x31)  # wrong tag
    for bad_int in (b"", b"\x80"):
        with pytest.raises(ValueError):
            der_uint(bad_int)
    with pytest.raises(ValueError):
        der_uint(b"\x01" * 9, max_len=8)


def test_raw_ecdsa_signature_must_be_as_long_as_the_curve() -> None:
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    key = ec.generate_private_key(ec.SECP256R1())
    r, s = decode_dss_signature(key.sign(b"data", ec.ECDSA(hashes.SHA256())))
    rs = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    public = key.public_key()
    assert verify_raw_ecdsa(public, rs, b"data", hashes.SHA256())
    assert not verify_raw_ecdsa(public, rs, b"other", hashes.SHA256())
    # The same integers zero-padded to 33 bytes each: not the canonical encoding, refused.
    padded = r.to_bytes(33, "big") + s.to_bytes(33, "big")
    assert not verify_raw_ecdsa(public, padded, b"data", hashes.SHA256())


# ---------------------------------------------------------------------------------------------
# the chain verifier


def test_ecdsa_chain_verifies_and_its_window_is_the_intersection(
    ecdsa_pki: dict[str, bytes],
) -> None:
    v = _ecdsa(ecdsa_pki["root"])
    full = [ecdsa_pki["leaf"], ecdsa_pki["mid"], ecdsa_pki["root"]]
    chain = v.verify(full, T0 + timedelta(days=30))
    assert chain.leaf.subject_text == "CN=leaf" and chain.issuer.subject_text == "CN=mid"
    assert chain.window.not_before == T0 + timedelta(days=20)  # the leaf's start
    assert chain.window.not_after == T0 + timedelta(days=100)  # the leaf's end
    assert _reason(v.verify, [ecdsa_pki["leaf"], ecdsa_pki["mid"]], T0 + timedelta(days=15)) == (
        "certificate_not_yet_valid"
    )
    assert _reason(v.verify, [ecdsa_pki["leaf"], ecdsa_pki["mid"]], T0 + timedelta(days=101)) == (
        "certificate_expired"
    )


def test_ecdsa_chain_reasons(ecdsa_pki: dict[str, bytes]) -> None:
    v = _ecdsa(ecdsa_pki["root"])
    now = T0 + timedelta(days=30)
    other = ec.generate_private_key(ec.SECP384R1())
    foreign_root = _cert("root", other, "root", other, ca=True)
    # The top certificate not issued by the pinned root (same name, other key): untrusted_root.
    assert _reason(_ecdsa(foreign_root).verify, [ecdsa_pki["leaf"], ecdsa_pki["mid"]], now) == (
        "untrusted_root"
    )
    # An issuer that is not a CA: chain_invalid.
    assert _reason(v.verify, [ecdsa_pki["leaf"], ecdsa_pki["mid_not_ca"]], now) == "chain_invalid"
    # The leaf skipping its issuer: its issuer name is not the root's: untrusted_root.
    assert _reason(v.verify, [ecdsa_pki["leaf"]], now) == "untrusted_root"
    # A leaf key on another curve: chain_invalid.
    p256 = ChainVerifier(
        ecdsa_pki["root"], links=EcdsaLinks(ec.SECP384R1, hashes.SHA384), leaf_curve=ec.SECP256R1
    )
    assert _reason(p256.verify, [ecdsa_pki["leaf"], ecdsa_pki["mid"]], now) == "chain_invalid"
    # Another signature hash than the scheme's: the top link (checked first) fails, so the
    # chain does not reach the pinned root: untrusted_root.
    sha256 = ChainVerifier(
        ecdsa_pki["root"], links=EcdsaLinks(ec.SECP384R1, hashes.SHA256), leaf_curve=ec.SECP384R1
    )
    assert _reason(sha256.verify, [ecdsa_pki["leaf"], ecdsa_pki["mid"]], now) == "untrusted_root"
    # Malformed DER or too long a chain: format errors.
    with pytest.raises(EvidenceFormatError) as fmt:
        v.verify([b"\x30\x03junk"], now)
    assert fmt.value.reason == "certificate_invalid"
    with pytest.raises(EvidenceFormatError):
        v.verify([ecdsa_pki["leaf"]] * 9, now)


def test_rsa_pss_links_fix_the_parameters_and_cache_verified_issuers() -> None:
    ark_k, ask_k = (rsa.generate_private_key(public_exponent=65537, key_size=2048) for _ in "ab")
    leaf_k = ec.generate_private_key(ec.SECP384R1())
    ark = _cert("ARK", ark_k, "ARK", ark_k, ca=True)
    ask = _cert("ASK", ask_k, "ARK", ark_k, ca=True)
    leaf = _cert("VCEK", leaf_k, "ASK", ask_k, ca=None)
    links = RsaPssLinks()
    calls = {"n": 0}

    class Counting(RsaPssLinks):
        def check(self, child: object, parent: object) -> None:
            calls["n"] += 1
            links.check(child, parent)  # type: ignore[arg-type]

    v = ChainVerifier(ark, links=Counting(), leaf_curve=ec.SECP384R1, self_signed_root=True)
    assert calls["n"] == 1  # the root's self-signature, once
    v.verify_issuers([ask])
    assert calls["n"] == 2
    v.verify([leaf, ask], T0 + timedelta(days=1))
    v.verify([leaf, ask], T0 + timedelta(days=2))
    assert calls["n"] == 3  # only VCEK <- ASK was new; nothing is checked twice
    # Signed with PKCS#1 v1.5 instead of PSS: chain_invalid, whatever the certificate says.
    pkcs1 = (
        x509.CertificateBuilder()
        .subject_name(_name("VCEK"))
        .issuer_name(_name("ASK"))
        .public_key(leaf_k.public_key())
        .serial_number(8)
        .not_valid_before(T0)
        .not_valid_after(T0 + timedelta(days=365))
        .sign(ask_k, hashes.SHA384())
        .public_bytes(Encoding.DER)
    )
    assert _reason(v.verify, [pkcs1, ask], T0 + timedelta(days=1)) == "chain_invalid"
    # A root whose self-signature does not verify under the scheme is refused at construction.
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    forged = _cert("ARK", ark_k, "ARK", other, ca=True)
    with pytest.raises(EvidenceVerificationError) as err:
        ChainVerifier(forged, links=links, leaf_curve=ec.SECP384R1, self_signed_root=True)
    assert err.value.reason == "chain_invalid"


# ---------------------------------------------------------------------------------------------
# the strict CRL reader


def test_parse_crl_reads_strictly_and_runs_the_signature_check_inside() -> None:
    key = ec.generate_private_key(ec.SECP384R1())
    root = parse_certificate(_cert("root", key, "root", key, ca=True))
    revoked = x509.RevokedCertificateBuilder().serial_number(42).revocation_date(T0).build()
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(_name("root"))
        .last_update(T0)
        .next_update(T0 + timedelta(days=7))
        .add_revoked_certificate(revoked)
        .sign(key, hashes.SHA384())
    )
    der = crl.public_bytes(Encoding.DER)

    def fail(detail: str) -> EvidenceVerificationError:
        return EvidenceVerificationError("collateral_invalid", detail)

    root_key = root.public_key
    assert isinstance(root_key, ec.EllipticCurvePublicKey)
    parsed = parse_crl(der, fail, signature_valid=lambda c: c.is_signature_valid(root_key))
    assert parsed.revoked == frozenset({42}) and parsed.signature_valid is True
    assert parsed.issuer == root.subject and parsed.next_update == T0 + timedelta(days=7)
    pem = parse_crl(crl.public_bytes(Encoding.PEM), fail)
    assert pem.revoked == parsed.revoked and pem.signature_valid is None
    for bad in (b"\x30\x03junk", der[:-5], bytes(2 << 20)):
        with pytest.raises(EvidenceVerificationError) as err:
            parse_crl(bad, fail)
        assert err.value.reason == "collateral_invalid"
