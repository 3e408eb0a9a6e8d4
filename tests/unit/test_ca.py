from __future__ import annotations

import base64
import stat
from datetime import timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID
from hypothesis import given, settings
from hypothesis import strategies as st
from OpenSSL import crypto

from certs.ca import (
    BACKDATE,
    CLAIMS_OID,
    CertificateAuthority,
    CsrError,
    build_server_cert,
    decode_claims_extension,
    encode_claims_extension,
    leaf_validity,
    parse_csr,
)
from certs.ca.templates import build_crl, build_leaf
from certs.errors import AttestmeshError
from certs.evidence.claims import Tee
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, claims, csr_pem, new_key

SPIFFE = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
KEY_FILES = ("root.key", "intermediate.key")
ALL_FILES = ("root.pem", "root.key", "intermediate.pem", "intermediate.key")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(
        tmp_path_factory.mktemp("ca") / "ca", TRUST_DOMAIN, NOW
    )


def _leaf(
    ca: CertificateAuthority,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    spiffe_id: str = SPIFFE,
    ttl: timedelta = timedelta(hours=1),
    now: object = NOW,
    serial: int = 1234,
) -> x509.Certificate:
    csr = parse_csr(csr_pem(key or new_key()))
    ext = encode_claims_extension(claims(), "default/pol", NOW)
    return build_leaf(
        csr,
        spiffe_id=spiffe_id,
        claims_extension=ext,
        issuer=ca.intermediate,
        serial=serial,
        now=now,  # type: ignore[arg-type]
        ttl=ttl,
    )


def _openssl_verify(
    ca: CertificateAuthority, leaf: x509.Certificate, at: object = NOW
) -> list[x509.Certificate]:
    """Full path validation by OpenSSL (it enforces the URI name constraints, which
    cryptography's verifier does not support)."""
    store = crypto.X509Store()
    store.add_cert(crypto.X509.from_cryptography(ca.root))
    store.set_time(at)  # type: ignore[arg-type]
    ctx = crypto.X509StoreContext(
        store,
        crypto.X509.from_cryptography(leaf),
        [crypto.X509.from_cryptography(ca.intermediate.cert)],
    )
    return [c.to_cryptography() for c in ctx.get_verified_chain()]


# ---------------------------------------------------------------------------------------------
# load_or_create


def test_load_or_create_writes_private_files_and_reloads_the_same_ca(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "ca"
    first = CertificateAuthority.load_or_create(
        directory, TRUST_DOMAIN, NOW, serials={"root": 11, "intermediate": 12}
    )
    assert sorted(p.name for p in directory.iterdir()) == sorted(ALL_FILES)
    for name in ALL_FILES:
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name
    assert first.root.serial_number == 11
    assert first.intermediate.cert.serial_number == 12
    assert first.intermediate.cert.issuer == first.root.subject
    first.intermediate.cert.verify_directly_issued_by(first.root)
    first.root.verify_directly_issued_by(first.root)

    again = CertificateAuthority.load_or_create(directory, TRUST_DOMAIN, NOW + timedelta(days=3))
    assert again.root.fingerprint(hashes.SHA256()) == first.root.fingerprint(hashes.SHA256())
    assert again.intermediate.cert == first.intermediate.cert
    assert again.bundle_pem == first.bundle_pem
    assert _key_der(again.intermediate.key) == _key_der(first.intermediate.key)


def _key_der(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def test_ca_certificates_are_constrained_p256_cas(ca: CertificateAuthority) -> None:
    for cert, path_length in ((ca.root, 1), (ca.intermediate.cert, 0)):
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        assert bc.critical and bc.value.ca and bc.value.path_length == path_length
        ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
        assert ku.key_cert_sign and ku.crl_sign
        nc = cert.extensions.get_extension_for_class(x509.NameConstraints)
        assert nc.critical
        assert nc.value.permitted_subtrees == [x509.UniformResourceIdentifier(TRUST_DOMAIN)]
        key = cert.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
        assert cert.not_valid_before_utc == NOW - BACKDATE
    assert ca.root.not_valid_after_utc == NOW + timedelta(days=3650)
    assert ca.intermediate.cert.not_valid_after_utc == NOW + timedelta(days=365)


@pytest.mark.parametrize("present", [("root.key",), ("root.pem", "root.key", "intermediate.pem")])
def test_load_or_create_refuses_a_partial_directory(tmp_path: Path, present: tuple[str]) -> None:
    for name in present:
        (tmp_path / name).write_bytes(b"leftover")
    with pytest.raises(AttestmeshError) as info:
        CertificateAuthority.load_or_create(tmp_path, TRUST_DOMAIN, NOW)
    assert info.value.reason == "ca_incomplete"
    for name in present:
        assert (tmp_path / name).read_bytes() == b"leftover"  # nothing overwritten


def test_load_or_create_refuses_another_trust_domain(tmp_path: Path) -> None:
    CertificateAuthority.load_or_create(tmp_path, TRUST_DOMAIN, NOW)
    with pytest.raises(AttestmeshError) as info:
        CertificateAuthority.load_or_create(tmp_path, "other.example", NOW)
    assert info.value.reason == "ca_trust_domain_mismatch"


@pytest.mark.parametrize(
    ("swap", "source"),
    [
        ("intermediate.key", "root.key"),  # a key that does not match its certificate
        ("root.key", "intermediate.key"),
        ("intermediate.pem", "other/intermediate.pem"),  # not issued by this root
    ],
)
def test_load_or_create_refuses_an_inconsistent_ca(tmp_path: Path, swap: str, source: str) -> None:
    CertificateAuthority.load_or_create(tmp_path, TRUST_DOMAIN, NOW)
    CertificateAuthority.load_or_create(tmp_path / "other", TRUST_DOMAIN, NOW)
    (tmp_path / swap).write_bytes((tmp_path / source).read_bytes())
    with pytest.raises(AttestmeshError) as info:
        CertificateAuthority.load_or_create(tmp_path, TRUST_DOMAIN, NOW)
    assert info.value.reason == "ca_inconsistent"


# ---------------------------------------------------------------------------------------------
# leaf


def test_leaf_validity_backdates_and_caps() -> None:
    issuer_end = NOW + timedelta(hours=10)
    assert leaf_validity(NOW, timedelta(hours=1), issuer_end) == (
        NOW - timedelta(seconds=30),
        NOW + timedelta(hours=1),
    )
    assert leaf_validity(NOW, timedelta(hours=20), issuer_end) == (NOW - BACKDATE, issuer_end)


def test_leaf_validity_refuses_non_positive_ttl_and_an_expired_issuer() -> None:
    with pytest.raises(ValueError, match="ttl must be positive"):
        leaf_validity(NOW, timedelta(0), NOW + timedelta(days=1))
    with pytest.raises(AttestmeshError) as info:
        leaf_validity(NOW, timedelta(hours=1), NOW)
    assert info.value.reason == "ca_expired"


def test_leaf_has_the_mesh_profile(ca: CertificateAuthority) -> None:
    key = new_key()
    leaf = _leaf(ca, key=key, ttl=timedelta(minutes=20))
    assert leaf.subject == x509.Name([])
    assert leaf.issuer == ca.intermediate.cert.subject
    assert leaf.serial_number == 1234
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert san.critical  # the subject is empty
    assert list(san.value) == [x509.UniformResourceIdentifier(SPIFFE)]
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH}
    bc = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_cert_sign and not ku.crl_sign
    assert leaf.public_key() == key.public_key()
    assert leaf.not_valid_before_utc == NOW - timedelta(seconds=30)
    assert leaf.not_valid_after_utc == NOW + timedelta(minutes=20)
    claims_ext = leaf.extensions.get_extension_for_oid(CLAIMS_OID)
    assert not claims_ext.critical
    assert isinstance(claims_ext.value, x509.UnrecognizedExtension)
    assert decode_claims_extension(claims_ext.value.value) == {
        "tee": "sim",
        "measurements": dict(claims().measurements),
        "policy": "default/pol",
        "evidence_sha256": "ab" * 32,
        "attested_at": NOW.isoformat(),
        "tcb_status": None,
        "debug": False,
    }


def test_leaf_not_after_is_capped_at_the_intermediates(ca: CertificateAuthority) -> None:
    inter_end = ca.intermediate.cert.not_valid_after_utc
    near = inter_end - timedelta(minutes=10)
    leaf = _leaf(ca, now=near, ttl=timedelta(hours=1))
    assert leaf.not_valid_after_utc == inter_end
    assert leaf.not_valid_before_utc == near - BACKDATE
    with pytest.raises(AttestmeshError) as info:
        _leaf(ca, now=inter_end, ttl=timedelta(hours=1))
    assert info.value.reason == "ca_expired"


def test_leaf_chain_verifies_to_the_root(ca: CertificateAuthority) -> None:
    leaf = _leaf(ca)
    leaf.verify_directly_issued_by(ca.intermediate.cert)
    ca.intermediate.cert.verify_directly_issued_by(ca.root)
    chain = _openssl_verify(ca, leaf, NOW + timedelta(minutes=5))
    assert chain == [leaf, ca.intermediate.cert, ca.root]
    # The chain the API hands out is leaf + intermediate, in that order.
    assert x509.load_pem_x509_certificates(ca.chain_pem(leaf)) == [leaf, ca.intermediate.cert]


def test_openssl_refuses_the_leaf_outside_its_validity(ca: CertificateAuthority) -> None:
    leaf = _leaf(ca, ttl=timedelta(minutes=5))
    with pytest.raises(crypto.X509StoreContextError, match="certificate has expired"):
        _openssl_verify(ca, leaf, NOW + timedelta(minutes=6))


def test_name_constraints_keep_leaves_inside_the_trust_domain(ca: CertificateAuthority) -> None:
    leaf = _leaf(ca, spiffe_id="spiffe://evil.example/ns/default/sa/web")
    with pytest.raises(crypto.X509StoreContextError, match="permitted subtree violation"):
        _openssl_verify(ca, leaf)


def test_leaf_from_another_ca_does_not_verify(ca: CertificateAuthority, tmp_path: Path) -> None:
    other = CertificateAuthority.load_or_create(tmp_path, TRUST_DOMAIN, NOW)
    leaf = _leaf(other)
    with pytest.raises(crypto.X509StoreContextError):
        _openssl_verify(ca, leaf)


# ---------------------------------------------------------------------------------------------
# claims extension


@pytest.mark.parametrize("n_measurements", [0, 1, 30])
def test_claims_extension_round_trip_any_length(n_measurements: int) -> None:
    c = claims(
        Tee.TDX,
        measurements={f"rtmr{i}": f"{i:02x}" * 48 for i in range(n_measurements)},
        tcb_status="UpToDate",
        debug=True,
    )
    value = encode_claims_extension(c, "ns/p", NOW)
    decoded = decode_claims_extension(value)
    assert decoded["measurements"] == dict(c.measurements)
    assert decoded["tee"] == "tdx" and decoded["tcb_status"] == "UpToDate"
    assert decoded["debug"] is True
    # DER: UTF8String tag, definite length that covers exactly the body.
    assert value[0] == 0x0C
    if len(value) > 129:
        assert value[1] & 0x80
        count = value[1] & 0x7F
        assert int.from_bytes(value[2 : 2 + count], "big") == len(value) - 2 - count


def test_decode_claims_extension_refuses_other_types() -> None:
    with pytest.raises(ValueError, match="not a UTF8String"):
        decode_claims_extension(b"\x04\x02{}")
    with pytest.raises(ValueError, match="not an object"):
        decode_claims_extension(b"\x0c\x02[]")


# ---------------------------------------------------------------------------------------------
# CRL


def test_crl_lists_revoked_serials_and_is_signed_by_the_intermediate(
    ca: CertificateAuthority,
) -> None:
    revoked = [(2**100 + 5, NOW - timedelta(minutes=3)), (7, NOW - timedelta(minutes=1))]
    crl = build_crl(ca.intermediate, revoked, NOW, timedelta(hours=24))
    assert crl.issuer == ca.intermediate.cert.subject
    assert crl.is_signature_valid(ca.intermediate.key.public_key())
    assert not crl.is_signature_valid(new_key().public_key())
    assert sorted(r.serial_number for r in crl) == [7, 2**100 + 5]
    entry = crl.get_revoked_certificate_by_serial_number(7)
    assert entry is not None and entry.revocation_date_utc == NOW - timedelta(minutes=1)
    assert crl.get_revoked_certificate_by_serial_number(8) is None
    assert crl.last_update_utc == NOW - BACKDATE
    assert crl.next_update_utc == NOW + timedelta(hours=24)
    pem_crl = x509.load_pem_x509_crl(ca.crl_pem(revoked, NOW, timedelta(hours=24)))
    assert sorted(r.serial_number for r in pem_crl) == [7, 2**100 + 5]


def test_crl_entries_are_what_adding_them_one_by_one_encodes(ca: CertificateAuthority) -> None:
    """The entries are handed to the builder in one list (adding them one by one copied the
    list per entry, quadratic): the signed content is the same, sorted by serial, each date
    converted to UTC (an aware date in another zone included)."""
    east = timezone(timedelta(hours=5, minutes=30))
    revoked = [(s, (NOW - timedelta(seconds=s % 997)).astimezone(east)) for s in range(3000, 1, -7)]
    crl = build_crl(ca.intermediate, revoked, NOW, timedelta(hours=1))
    one_by_one = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.intermediate.cert.subject)
        .last_update(NOW - BACKDATE)
        .next_update(NOW + timedelta(hours=1))
        .add_extension(ca.intermediate.key_identifier, critical=False)
    )
    for serial, at in sorted(revoked):
        one_by_one = one_by_one.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(at).build()
        )
    expected = one_by_one.sign(ca.intermediate.key, hashes.SHA256())
    assert crl.tbs_certlist_bytes == expected.tbs_certlist_bytes
    assert [r.serial_number for r in crl] == sorted(s for s, _ in revoked)
    entry = crl.get_revoked_certificate_by_serial_number(3000)
    assert entry is not None and entry.revocation_date_utc == NOW - timedelta(seconds=3000 % 997)
    assert crl.is_signature_valid(ca.intermediate.key.public_key())


def test_crl_refuses_a_serial_out_of_range(ca: CertificateAuthority) -> None:
    with pytest.raises(ValueError):
        build_crl(ca.intermediate, [(0, NOW)], NOW, timedelta(hours=1))


def test_empty_crl_is_valid(ca: CertificateAuthority) -> None:
    crl = build_crl(ca.intermediate, [], NOW, timedelta(hours=1))
    assert len(crl) == 0 and crl.is_signature_valid(ca.intermediate.key.public_key())


def test_openssl_refuses_a_revoked_leaf_with_the_crl(ca: CertificateAuthority) -> None:
    leaf = _leaf(ca, serial=4242)
    crl = build_crl(ca.intermediate, [(4242, NOW)], NOW, timedelta(hours=1))
    store = crypto.X509Store()
    store.add_cert(crypto.X509.from_cryptography(ca.root))
    store.add_crl(crl)
    store.set_flags(crypto.X509StoreFlags.CRL_CHECK)
    store.set_time(NOW + timedelta(minutes=1))
    ctx = crypto.X509StoreContext(
        store,
        crypto.X509.from_cryptography(leaf),
        [crypto.X509.from_cryptography(ca.intermediate.cert)],
    )
    with pytest.raises(crypto.X509StoreContextError, match="certificate revoked"):
        ctx.verify_certificate()


# ---------------------------------------------------------------------------------------------
# parse_csr


def test_parse_csr_accepts_a_p256_csr() -> None:
    key = new_key()
    csr = parse_csr(csr_pem(key))
    assert csr.public_key() == key.public_key()


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"not a pem",
        b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
    ],
)
def test_parse_csr_refuses_malformed_pem(pem: bytes) -> None:
    with pytest.raises(CsrError) as info:
        parse_csr(pem)
    assert info.value.reason == "csr_malformed"


def test_parse_csr_refuses_a_certificate_instead_of_a_csr(ca: CertificateAuthority) -> None:
    with pytest.raises(CsrError) as info:
        parse_csr(ca.bundle_pem)
    assert info.value.reason == "csr_malformed"


def _tampered_csr() -> bytes:
    """A CSR whose signed content was changed after signing (the subject's CN)."""
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "aaaa")]))
        .sign(new_key(), hashes.SHA256())
    )
    der = csr.public_bytes(serialization.Encoding.DER)
    assert der.count(b"aaaa") == 1
    tampered = der.replace(b"aaaa", b"bbbb")
    return x509.load_der_x509_csr(tampered).public_bytes(serialization.Encoding.PEM)


def test_parse_csr_refuses_a_bad_signature() -> None:
    with pytest.raises(CsrError) as info:
        parse_csr(_tampered_csr())
    assert info.value.reason == "csr_signature_invalid"


@pytest.mark.parametrize(
    "key",
    [
        ec.generate_private_key(ec.SECP384R1()),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
    ],
    ids=["p384", "rsa"],
)
def test_parse_csr_refuses_other_key_types(key: object) -> None:
    with pytest.raises(CsrError) as info:
        parse_csr(csr_pem(key))
    assert info.value.reason == "csr_key_type"


def _csr_der(key: object = None) -> bytes:
    pem = csr_pem(key or new_key())
    return x509.load_pem_x509_csr(pem).public_bytes(serialization.Encoding.DER)


def _pem(der: bytes) -> bytes:
    body = base64.encodebytes(der)
    return b"-----BEGIN CERTIFICATE REQUEST-----\n" + body + b"-----END CERTIFICATE REQUEST-----\n"


ID_EC_PUBLIC_KEY = bytes.fromhex("06072a8648ce3d0201")
PRIME256V1 = bytes.fromhex("06082a8648ce3d030107")


@pytest.mark.parametrize(
    ("old", "new", "reason"),
    [
        # CSR version 5: cryptography raises InvalidVersion (not a ValueError)
        (b"\x02\x01\x00", b"\x02\x01\x05", "csr_malformed"),
        # an unknown public-key algorithm: UnsupportedAlgorithm from public_key()
        (ID_EC_PUBLIC_KEY, ID_EC_PUBLIC_KEY[:-1] + b"\x09", "csr_key_type"),
        # an unknown named curve
        (PRIME256V1, PRIME256V1[:-1] + b"\x63", "csr_key_type"),
    ],
    ids=["bad_version", "unknown_key_algorithm", "unknown_curve"],
)
def test_parse_csr_maps_every_library_error_to_csr_error(
    old: bytes, new: bytes, reason: str
) -> None:
    der = _csr_der()
    assert der.count(old) == 1
    with pytest.raises(CsrError) as info:
        parse_csr(_pem(der.replace(old, new)))
    assert info.value.reason == reason


def test_parse_csr_refuses_an_invalid_curve_point() -> None:
    der = bytearray(_csr_der())
    point = der.index(b"\x03\x42\x00\x04") + 4  # BIT STRING with the uncompressed point
    der[point + 63] ^= 0x01  # the point leaves the curve
    with pytest.raises(CsrError) as info:
        parse_csr(_pem(bytes(der)))
    assert info.value.reason == "csr_malformed"


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=300))
def test_parse_csr_arbitrary_bytes_raise_only_csr_error(data: bytes) -> None:
    for candidate in (data, _pem(data)):
        with pytest.raises(CsrError):
            parse_csr(candidate)


_VALID_CSR_DER = _csr_der()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(_VALID_CSR_DER) - 1), st.integers(0, 255)),
        min_size=1,
        max_size=3,
    )
)
def test_parse_csr_mutated_csr_raises_only_csr_error(edits: list[tuple[int, int]]) -> None:
    der = bytearray(_VALID_CSR_DER)
    for index, value in edits:
        der[index] = value
    try:
        csr = parse_csr(_pem(bytes(der)))
    except CsrError as exc:
        assert exc.reason in {"csr_malformed", "csr_signature_invalid", "csr_key_type"}
    else:  # a mutation that changes nothing signed (e.g. the DER's own framing)
        assert csr.is_signature_valid


# ---------------------------------------------------------------------------------------------
# control plane serving certificate


def test_build_server_cert(ca: CertificateAuthority) -> None:
    key = new_key()
    cert = build_server_cert(
        ca,
        key,
        spiffe_id=f"spiffe://{TRUST_DOMAIN}/attestmesh/control-plane",
        dns_names=["localhost", "cp.attestmesh.svc"],
        ips=["127.0.0.1", "::1"],
        serial=99,
        now=NOW,
        ttl=timedelta(days=30),
    )
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://{TRUST_DOMAIN}/attestmesh/control-plane"
    ]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "cp.attestmesh.svc"]
    assert [str(i) for i in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.public_key() == key.public_key()
    assert cert.not_valid_after_utc == NOW + timedelta(days=30)
    assert _openssl_verify(ca, cert, NOW + timedelta(days=1))[0] == cert
