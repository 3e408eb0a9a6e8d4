"""Certificate templates: mesh leaves, CA certificates, CRLs, the control plane's serving
certificate. Pure: keys, time and serial numbers come in as arguments; nothing is read or written.

A mesh leaf is signed from an ``Admission`` only (``certs.ca.issue``): ``sign_leaf`` is the
template it fills, and no module above ``certs.ca`` imports this one (the ``leaf`` contract in
pyproject.toml). The leaf is assembled from DER pieces (``certs.ca.der``: the issuer's are
computed once per ``Issuer``) and signed with the issuer key's ``sign`` (a file key or a
PKCS#11 one alike); it is byte for byte what ``x509.CertificateBuilder`` makes of the same
fields (tests/unit/test_leaf_der.py keeps the builder as the reference).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from certs.ca import der
from certs.ca.claims import CLAIMS_CLASS_ORG, CLAIMS_CLASS_PATTERN, CLAIMS_OID
from certs.csr import CsrError, spki_der
from certs.ear import CMW_OID
from certs.errors import AttestmeshError

BACKDATE = timedelta(seconds=30)

# The extensions every mesh leaf carries alike, as DER (RFC 5280 §4.2.1): basic constraints
# (not a CA) and key usage (digitalSignature, keyAgreement), critical; extended key usage
# (serverAuth, clientAuth).
LEAF_KEY_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=True,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)
LEAF_EXTENDED_KEY_USAGE = x509.ExtendedKeyUsage(
    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
)
_SAN = der.oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME.dotted_string)
_SKI = der.oid(ExtensionOID.SUBJECT_KEY_IDENTIFIER.dotted_string)
_CONSTRAINTS = (
    der.extension(
        der.oid(ExtensionOID.BASIC_CONSTRAINTS.dotted_string),
        x509.BasicConstraints(ca=False, path_length=None).public_bytes(),
        critical=True,
    )
    + der.extension(
        der.oid(ExtensionOID.KEY_USAGE.dotted_string),
        LEAF_KEY_USAGE.public_bytes(),
        critical=True,
    )
    + der.extension(
        der.oid(ExtensionOID.EXTENDED_KEY_USAGE.dotted_string),
        LEAF_EXTENDED_KEY_USAGE.public_bytes(),
        critical=False,
    )
)
_CLAIMS = der.oid(CLAIMS_OID.dotted_string)
_CMW = der.oid(CMW_OID.dotted_string)
_NO_SUBJECT = x509.Name([]).public_bytes()
_ORGANIZATION = der.oid(NameOID.ORGANIZATION_NAME.dotted_string)
_UNIT = der.oid(NameOID.ORGANIZATIONAL_UNIT_NAME.dotted_string)


@dataclass(frozen=True, slots=True)
class Issuer:
    """A CA certificate and its key; what every leaf and CRL it signs repeats about it (its PEM
    for chains, its key identifier) is computed once."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    pem: bytes = field(init=False, compare=False, repr=False)
    key_identifier: x509.AuthorityKeyIdentifier = field(init=False, compare=False, repr=False)
    # DER a leaf repeats: the issuer's Name; the authority key identifier Extension
    name_der: bytes = field(init=False, compare=False, repr=False)
    key_identifier_der: bytes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pem", self.cert.public_bytes(serialization.Encoding.PEM))
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key())
        object.__setattr__(self, "key_identifier", aki)
        object.__setattr__(self, "name_der", self.cert.subject.public_bytes())
        aki_der = der.extension(
            der.oid(ExtensionOID.AUTHORITY_KEY_IDENTIFIER.dotted_string),
            aki.public_bytes(),
            critical=False,
        )
        object.__setattr__(self, "key_identifier_der", aki_der)


def leaf_validity(
    now: datetime, ttl: timedelta, issuer_not_after: datetime
) -> tuple[datetime, datetime]:
    """notBefore backdated a little for clock skew; notAfter never past the issuer's."""
    if ttl <= timedelta(0):
        raise ValueError("ttl must be positive")
    not_after = min(now + ttl, issuer_not_after)
    if not_after <= now:
        raise AttestmeshError("ca_expired", "the issuing CA has expired")
    return now - BACKDATE, not_after


def build_leaf(
    csr: x509.CertificateSigningRequest,
    *,
    spiffe_id: str,
    claims_extension: bytes,
    issuer: Issuer,
    serial: int,
    now: datetime,
    ttl: timedelta,
    claims_class: str | None = None,
    cmw_extension: bytes | None = None,
) -> x509.Certificate:
    """``sign_leaf`` for the CSR's key, parsed."""
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    leaf = sign_leaf(
        spki_der(key),
        spiffe_id=spiffe_id,
        claims_extension=claims_extension,
        issuer=issuer,
        serial=serial,
        now=now,
        ttl=ttl,
        claims_class=claims_class,
        cmw_extension=cmw_extension,
    )
    return x509.load_der_x509_certificate(leaf)


def leaf_tbs(
    spki: bytes,
    *,
    spiffe_id: str,
    claims_extension: bytes,
    issuer: Issuer,
    serial: int,
    not_before: datetime,
    not_after: datetime,
    claims_class: str | None = None,
    cmw_extension: bytes | None = None,
) -> bytes:
    """A mesh leaf's TBSCertificate: SPIFFE URI SAN only, client+server auth, claims extension.
    With ``claims_class`` the Subject is ``O=attestmesh, OU=<claims_class>`` (Envoy forwards it
    in x-forwarded-client-cert, which claims-conditioned RBAC matches); without, it is empty.
    ``cmw_extension``: the attestation result in standard form (``certs.ear``), non-critical.
    ``spki``: the subject's DER SubjectPublicKeyInfo."""
    if claims_class is None:
        subject = _NO_SUBJECT
    elif not CLAIMS_CLASS_PATTERN.fullmatch(claims_class):
        raise ValueError(f"not a claims class: {claims_class!r}")
    else:
        subject = _claims_subject(claims_class)
    try:
        uri = spiffe_id.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError(f"a SPIFFE ID is ASCII: {spiffe_id!r}") from None
    extensions = [
        der.extension(_SAN, der.sequence(der.tlv(0x86, uri)), critical=True),
        _CONSTRAINTS,
        der.extension(_SKI, der.tlv(0x04, der.key_identifier(spki)), critical=False),
        issuer.key_identifier_der,
        der.extension(_CLAIMS, claims_extension, critical=False),
    ]
    if cmw_extension is not None:
        extensions.append(der.extension(_CMW, cmw_extension, critical=False))
    return der.tbs_certificate(
        serial=serial,
        issuer_name=issuer.name_der,
        not_before=not_before,
        not_after=not_after,
        subject_name=subject,
        spki=spki,
        extensions=extensions,
    )


def sign_leaf(
    spki: bytes,
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
    """Sign a mesh leaf (``leaf_tbs``) for ``spki`` valid from ``now`` (backdated) for
    ``ttl`` (capped at the issuer's notAfter): its DER."""
    not_before, not_after = leaf_validity(now, ttl, issuer.cert.not_valid_after_utc)
    tbs = leaf_tbs(
        spki,
        spiffe_id=spiffe_id,
        claims_extension=claims_extension,
        issuer=issuer,
        serial=serial,
        not_before=not_before,
        not_after=not_after,
        claims_class=claims_class,
        cmw_extension=cmw_extension,
    )
    return der.certificate(tbs, issuer.key.sign(tbs, ec.ECDSA(hashes.SHA256())))


def _claims_subject(claims_class: str) -> bytes:
    """``O=attestmesh, OU=<claims_class>``, each a UTF8String (the builder's default)."""
    return der.sequence(
        der.tlv(0x31, der.sequence(_ORGANIZATION, der.tlv(0x0C, CLAIMS_CLASS_ORG.encode()))),
        der.tlv(0x31, der.sequence(_UNIT, der.tlv(0x0C, claims_class.encode("ascii")))),
    )


def build_crl(
    issuer: Issuer, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
) -> x509.CertificateRevocationList:
    """``sign_crl``, parsed."""
    return x509.load_der_x509_crl(sign_crl(issuer, revoked, now, next_update))


def sign_crl(
    issuer: Issuer, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
) -> bytes:
    """The CRL (DER) of ``issuer`` listing ``revoked`` (serial, revocation date), sorted,
    valid from ``now`` (backdated) for ``next_update``. Assembled from DER pieces, as the leaf
    is: the builder took 11 ms for 1,500 entries in one call that held the GIL (every renewal
    past a workload's live certificates adds one), and the event loop waited that long."""
    tbs = der.tbs_cert_list(
        issuer_name=issuer.name_der,
        this_update=now - BACKDATE,
        next_update=now + next_update,
        revoked=sorted(revoked),
        extensions=[issuer.key_identifier_der],
    )
    return der.certificate(tbs, issuer.key.sign(tbs, ec.ECDSA(hashes.SHA256())))


def ca_certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: Issuer | None,
    now: datetime,
    lifetime: timedelta,
    serial: int,
    trust_domain: str,
    path_length: int,
    generation: str | None = None,
) -> x509.Certificate:
    attributes = [
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "attestmesh"),
        x509.NameAttribute(NameOID.COMMON_NAME, subject),
    ]
    if generation is not None:  # rotated intermediates: a distinct name per key (CRL matching)
        attributes.append(x509.NameAttribute(NameOID.SERIAL_NUMBER, generation))
    name = x509.Name(attributes)
    signer_key = issuer.key if issuer else key
    not_after = now + lifetime
    if issuer is not None:
        not_after = min(not_after, issuer.cert.not_valid_after_utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer.cert.subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=path_length), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.NameConstraints(
                permitted_subtrees=[x509.UniformResourceIdentifier(trust_domain)],
                excluded_subtrees=None,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(signer_key, hashes.SHA256())
    )
