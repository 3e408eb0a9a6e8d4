"""The mesh leaf and the CRL from DER pieces (certs.ca.der, certs.ca.templates.sign_leaf and
sign_crl) are byte for byte what x509.CertificateBuilder and CertificateRevocationListBuilder
make of the same inputs: the builder paths are kept here, as the reference, and compared over
random inputs (both signed deterministically, RFC 6979)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.ca import CertificateAuthority, der
from certs.ca.claims import CLAIMS_CLASS_ORG, CLAIMS_OID
from certs.ca.templates import (
    BACKDATE,
    Issuer,
    build_leaf,
    ca_certificate,
    leaf_validity,
    sign_crl,
    sign_leaf,
)
from certs.ear import CMW_OID


def reference_leaf(
    key: ec.EllipticCurvePublicKey,
    *,
    spiffe_id: str,
    claims_extension: bytes,
    issuer: Issuer,
    serial: int,
    now: datetime,
    ttl: timedelta,
    claims_class: str | None = None,
    cmw_extension: bytes | None = None,
) -> bytes:
    """The leaf as the CertificateBuilder made it before the DER template (the reference)."""
    not_before, not_after = leaf_validity(now, ttl, issuer.cert.not_valid_after_utc)
    subject = (
        x509.Name([])
        if claims_class is None
        else x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, CLAIMS_CLASS_ORG),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, claims_class),
            ]
        )
    )
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.cert.subject)
        .public_key(key)
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(spiffe_id)]), critical=True
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key), critical=False)
        .add_extension(issuer.key_identifier, critical=False)
        .add_extension(x509.UnrecognizedExtension(CLAIMS_OID, claims_extension), critical=False)
    )
    if cmw_extension is not None:
        builder = builder.add_extension(
            x509.UnrecognizedExtension(CMW_OID, cmw_extension), critical=False
        )
    cert = builder.sign(issuer.key, hashes.SHA256(), ecdsa_deterministic=True)
    return cert.public_bytes(serialization.Encoding.DER)


class DeterministicKey(ec.EllipticCurvePrivateKey):
    """An issuer key that signs as the builder's ``ecdsa_deterministic`` does (RFC 6979), so
    two leaves of the same TBS are the same bytes."""

    def __init__(self, key: ec.EllipticCurvePrivateKey) -> None:
        self._key = key

    def sign(self, data: object, signature_algorithm: object) -> bytes:
        assert isinstance(signature_algorithm, ec.ECDSA)
        return self._key.sign(
            data,  # type: ignore[arg-type]
            ec.ECDSA(signature_algorithm.algorithm, deterministic_signing=True),
        )

    def exchange(self, algorithm: object, peer_public_key: object) -> bytes:
        raise NotImplementedError

    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self._key.public_key()

    @property
    def curve(self) -> ec.EllipticCurve:
        return self._key.curve

    @property
    def key_size(self) -> int:
        return self._key.key_size

    def private_numbers(self) -> ec.EllipticCurvePrivateNumbers:
        return self._key.private_numbers()

    def private_bytes(self, *args: object, **kwargs: object) -> bytes:
        raise NotImplementedError

    def __copy__(self) -> DeterministicKey:
        return self

    def __deepcopy__(self, memo: object) -> DeterministicKey:
        return self


NOW = datetime(2026, 12, 2, 8, 0, 0, tzinfo=UTC)
TD = "spiffe://td.test"


def _issuers() -> list[tuple[Issuer, Issuer]]:
    """(reference issuer, same issuer with a deterministic key): a first-generation
    intermediate, a rotated one (its Name has a serialNumber), one living past 2050."""
    root_key = ec.generate_private_key(ec.SECP256R1())
    root = Issuer(
        ca_certificate("root", root_key, None, NOW, timedelta(days=40000), 1, TD, 1), root_key
    )
    out = []
    for generation, life in ((None, 365), ("ab" * 20, 365), (None, 30000)):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = ca_certificate(
            "intermediate", key, root, NOW, timedelta(days=life), 2, TD, 0, generation
        )
        out.append((Issuer(cert, key), Issuer(cert, DeterministicKey(key))))
    return out


ISSUERS = _issuers()
KEYS = [ec.generate_private_key(ec.SECP256R1()).public_key() for _ in range(4)]

leaf_inputs = st.fixed_dictionaries(
    {
        "key": st.sampled_from(KEYS),
        "issuers": st.sampled_from(ISSUERS),
        "spiffe_id": st.text(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=300
        ).map(lambda path: f"{TD}/{path}"),
        "claims_extension": st.binary(max_size=400),
        "serial": st.integers(min_value=1, max_value=(1 << 159) - 1),
        "now": st.datetimes(
            min_value=datetime(1951, 1, 1), max_value=datetime(2090, 1, 1), timezones=st.just(UTC)
        ),
        "ttl": st.timedeltas(min_value=timedelta(seconds=1), max_value=timedelta(days=400)),
        "claims_class": st.none()
        | st.text("0123456789abcdef", min_size=48, max_size=48).map(lambda h: "claims-" + h),
        "cmw_extension": st.none() | st.binary(max_size=70000),
    }
)


@settings(max_examples=300, deadline=None)
@given(leaf_inputs)
def test_leaf_from_der_pieces_is_the_builders_leaf_byte_for_byte(inputs: dict[str, object]) -> None:
    pair = inputs.pop("issuers")
    assert isinstance(pair, tuple)
    reference_issuer, issuer = pair
    assert isinstance(reference_issuer, Issuer) and isinstance(issuer, Issuer)
    key = inputs.pop("key")
    assert isinstance(key, ec.EllipticCurvePublicKey)
    now = inputs["now"]
    assert isinstance(now, datetime)
    if now >= reference_issuer.cert.not_valid_after_utc:  # the CA expired: both refuse
        return
    spki = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    expected = reference_leaf(key, issuer=reference_issuer, **inputs)  # type: ignore[arg-type]
    assert sign_leaf(spki, issuer=issuer, **inputs) == expected  # type: ignore[arg-type]


def test_a_signed_leaf_parses_and_verifies() -> None:
    """Parsed once with cryptography: the fields are where a verifier looks for them, and the
    appended signature is the issuer's over the TBSCertificate."""
    issuer, _ = ISSUERS[1]
    cert = build_leaf(
        x509.load_pem_x509_csr(_csr_pem()),
        spiffe_id=f"{TD}/ns/a/sa/b",
        claims_extension=b"\x0c\x02{}",
        issuer=issuer,
        serial=(1 << 158) + 5,
        now=NOW,
        ttl=timedelta(hours=1),
        claims_class="claims-" + "0" * 48,
        cmw_extension=b"\x04\x01\x00",
    )
    cert.verify_directly_issued_by(issuer.cert)
    assert cert.serial_number == (1 << 158) + 5
    assert cert.not_valid_after_utc == NOW + timedelta(hours=1)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"{TD}/ns/a/sa/b"]
    assert cert.extensions.get_extension_for_oid(CMW_OID).value.value == b"\x04\x01\x00"  # type: ignore[attr-defined]
    assert cert.issuer == issuer.cert.subject


def _csr_pem() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("serial", 0, "positive"),
        ("serial", 1 << 159, "159 bits"),
        ("spiffe_id", f"{TD}/é", "ASCII"),
        ("claims_class", "claims-XYZ", "not a claims class"),
    ],
)
def test_fields_the_builder_refuses_are_refused(field: str, value: object, match: str) -> None:
    issuer, _ = ISSUERS[0]
    spki = KEYS[0].public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    args: dict[str, object] = {
        "spiffe_id": f"{TD}/ns/a/sa/b",
        "claims_extension": b"\x0c\x00",
        "issuer": issuer,
        "serial": 7,
        "now": NOW,
        "ttl": timedelta(hours=1),
        field: value,
    }
    with pytest.raises(ValueError, match=match):
        sign_leaf(spki, **args)  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=1 << 200))
def test_integer_is_minimal_twos_complement(n: int) -> None:
    encoded = der.integer(n)
    assert encoded[0] == 0x02
    body = encoded[2:] if encoded[1] < 0x80 else encoded[2 + (encoded[1] & 0x7F) :]
    assert int.from_bytes(body, "big", signed=True) == n
    assert len(body) == 1 or not (body[0] == 0 and body[1] < 0x80)


@given(st.binary(max_size=3000))
def test_certificate_pem_wraps_base64_at_64_columns(data: bytes) -> None:
    text = base64.b64encode(data).decode()
    lines = [text[i : i + 64] + "\n" for i in range(0, len(text), 64)]
    expected = "-----BEGIN CERTIFICATE-----\n" + "".join(lines) + "-----END CERTIFICATE-----\n"
    assert der.certificate_pem(data) == expected.encode()


def reference_crl(
    issuer: Issuer, revoked: list[tuple[int, datetime]], now: datetime, next_update: timedelta
) -> bytes:
    """The CRL as the CertificateRevocationListBuilder made it before the DER template."""
    entries = [
        x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(at).build()
        for serial, at in sorted(revoked)
    ]
    builder = (
        x509.CertificateRevocationListBuilder(revoked_certificates=entries)
        .issuer_name(issuer.cert.subject)
        .last_update(now - BACKDATE)
        .next_update(now + next_update)
        .add_extension(issuer.key_identifier, critical=False)
    )
    crl = builder.sign(issuer.key, hashes.SHA256(), ecdsa_deterministic=True)
    return crl.public_bytes(serialization.Encoding.DER)


times = st.datetimes(
    min_value=datetime(1951, 1, 1), max_value=datetime(2090, 1, 1), timezones=st.just(UTC)
)


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(ISSUERS),
    st.lists(st.tuples(st.integers(min_value=1, max_value=(1 << 159) - 1), times), max_size=60),
    times,
    st.timedeltas(min_value=timedelta(seconds=1), max_value=timedelta(days=400)),
)
def test_crl_from_der_pieces_is_the_builders_crl_byte_for_byte(
    issuers: tuple[Issuer, Issuer],
    revoked: list[tuple[int, datetime]],
    now: datetime,
    next_update: timedelta,
) -> None:
    reference_issuer, issuer = issuers
    expected = reference_crl(reference_issuer, revoked, now, next_update)
    assert sign_crl(issuer, revoked, now, next_update) == expected


def test_the_crl_pem_set_parses_and_is_signed_by_each_issuer(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW)
    pem = ca.crl_pem([(5, NOW), (3, NOW - timedelta(hours=1))], NOW, timedelta(hours=24))
    crl = x509.load_pem_x509_crl(pem)  # (one live intermediate: one CRL)
    assert crl.is_signature_valid(ca.intermediate.cert.public_key())  # type: ignore[arg-type]
    assert [r.serial_number for r in crl] == [3, 5]
    assert crl.next_update_utc == NOW + timedelta(hours=24)
