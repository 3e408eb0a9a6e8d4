"""The mesh CA: a P-256 root and intermediate persisted in the state directory, leaf issuance
with capped lifetimes, the trust bundle and the CRL.

Templates and lifetimes are pure (``build_leaf``, ``leaf_validity``, ``build_crl``): time and
serial numbers come in as arguments. ``CertificateAuthority.load_or_create`` is the only I/O.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.errors import AttestmeshError
from certs.evidence.claims import Claims

# 2.25.<uuid as integer> — an arc of the project's own (ITU-T X.667), fixed forever.
CLAIMS_OID = x509.ObjectIdentifier("2.25.191056338567094339622416036213146734331")
BACKDATE = timedelta(seconds=30)
ROOT_LIFETIME = timedelta(days=3650)
INTERMEDIATE_LIFETIME = timedelta(days=365)


class CsrError(AttestmeshError):
    """A certificate signing request is malformed, badly signed, or has the wrong key."""


@dataclass(frozen=True, slots=True)
class Issuer:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey


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


def encode_claims_extension(claims: Claims, policy: str, attested_at: datetime) -> bytes:
    """DER UTF8String holding canonical JSON of the appraised claims."""
    doc = {
        "tee": claims.tee.value,
        "measurements": dict(sorted(claims.measurements.items())),
        "policy": policy,
        "evidence_sha256": claims.evidence_sha256,
        "attested_at": attested_at.isoformat(),
        "tcb_status": claims.tcb_status,
        "debug": claims.debug,
    }
    body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return b"\x0c" + _der_length(len(body)) + body


def decode_claims_extension(value: bytes) -> dict[str, object]:
    if not value or value[0] != 0x0C:
        raise ValueError("not a UTF8String")
    length, offset = _der_read_length(value, 1)
    parsed = json.loads(value[offset : offset + length])
    if not isinstance(parsed, dict):
        raise ValueError("claims extension is not an object")
    return parsed


def _der_length(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw


def _der_read_length(data: bytes, offset: int) -> tuple[int, int]:
    first = data[offset]
    if first < 0x80:
        return first, offset + 1
    count = first & 0x7F
    return int.from_bytes(data[offset + 1 : offset + 1 + count], "big"), offset + 1 + count


def parse_csr(pem: bytes) -> x509.CertificateSigningRequest:
    """Parse and check a CSR: PEM, self-signature valid, P-256 key."""
    try:
        csr = x509.load_pem_x509_csr(pem)
        key = csr.public_key()
    except (ValueError, x509.InvalidVersion) as exc:
        raise CsrError("csr_malformed", str(exc)) from None
    except UnsupportedAlgorithm:
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    try:
        signature_valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm):
        signature_valid = False
    if not signature_valid:
        raise CsrError("csr_signature_invalid", "the CSR is not signed by its own key")
    return csr


def spki_der(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def build_leaf(
    csr: x509.CertificateSigningRequest,
    *,
    spiffe_id: str,
    claims_extension: bytes,
    issuer: Issuer,
    serial: int,
    now: datetime,
    ttl: timedelta,
) -> x509.Certificate:
    """Sign a mesh leaf: SPIFFE URI SAN only, client+server auth, claims extension."""
    not_before, not_after = leaf_validity(now, ttl, issuer.cert.not_valid_after_utc)
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
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
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
        .add_extension(x509.UnrecognizedExtension(CLAIMS_OID, claims_extension), critical=False)
    )
    return builder.sign(issuer.key, hashes.SHA256())


def build_crl(
    issuer: Issuer, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
) -> x509.CertificateRevocationList:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.cert.subject)
        .last_update(now - BACKDATE)
        .next_update(now + next_update)
    )
    for serial, revoked_at in sorted(revoked):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(revoked_at)
            .build()
        )
    return builder.sign(issuer.key, hashes.SHA256())


def _ca_cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: Issuer | None,
    now: datetime,
    lifetime: timedelta,
    serial: int,
    trust_domain: str,
    path_length: int,
) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "attestmesh"),
            x509.NameAttribute(NameOID.COMMON_NAME, subject),
        ]
    )
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


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise AttestmeshError("ca_key_invalid", f"{path} is not an EC private key")
    return key


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    root: x509.Certificate
    intermediate: Issuer
    trust_domain: str

    @property
    def bundle_pem(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.PEM)

    @property
    def intermediate_pem(self) -> bytes:
        return self.intermediate.cert.public_bytes(serialization.Encoding.PEM)

    def chain_pem(self, leaf: x509.Certificate) -> bytes:
        return leaf.public_bytes(serialization.Encoding.PEM) + self.intermediate_pem

    def crl_pem(
        self, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
    ) -> bytes:
        return build_crl(self.intermediate, revoked, now, next_update).public_bytes(
            serialization.Encoding.PEM
        )

    @classmethod
    def load_or_create(
        cls,
        directory: Path,
        trust_domain: str,
        now: datetime,
        serials: Mapping[str, int] | None = None,
    ) -> CertificateAuthority:
        """Load the CA from ``directory`` or create it there (keys 0600). A CA persisted once is
        reused after restarts: a new CA would split trust between peers."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        paths = {
            n: directory / f"{n}"
            for n in ("root.pem", "root.key", "intermediate.pem", "intermediate.key")
        }
        if all(p.exists() for p in paths.values()):
            root = x509.load_pem_x509_certificate(paths["root.pem"].read_bytes())
            inter = x509.load_pem_x509_certificate(paths["intermediate.pem"].read_bytes())
            inter_key = _load_key(paths["intermediate.key"])
            root_key = _load_key(paths["root.key"])
            try:
                inter.verify_directly_issued_by(root)
            except (ValueError, TypeError, InvalidSignature):
                raise AttestmeshError(
                    "ca_inconsistent", f"{directory}: the intermediate is not issued by the root"
                ) from None
            keys_match = (
                inter_key.public_key() == inter.public_key()
                and root_key.public_key() == root.public_key()
            )
            if not keys_match:
                raise AttestmeshError(
                    "ca_inconsistent", f"{directory}: a CA key does not match its certificate"
                )
            ca = cls(root, Issuer(inter, inter_key), trust_domain)
            constraints = inter.extensions.get_extension_for_class(x509.NameConstraints).value
            permitted = [g.value for g in constraints.permitted_subtrees or []]
            if trust_domain not in permitted:
                raise AttestmeshError(
                    "ca_trust_domain_mismatch",
                    f"CA in {directory} is not for trust domain {trust_domain}",
                )
            return ca
        if any(p.exists() for p in paths.values()):
            raise AttestmeshError(
                "ca_incomplete", f"{directory} holds a partial CA; refusing to overwrite it"
            )
        s = serials or {}
        root_key = ec.generate_private_key(ec.SECP256R1())
        inter_key = ec.generate_private_key(ec.SECP256R1())
        root_cert = _ca_cert(
            f"attestmesh root {trust_domain}",
            root_key,
            None,
            now,
            ROOT_LIFETIME,
            s.get("root", x509.random_serial_number()),
            trust_domain,
            1,
        )
        inter_cert = _ca_cert(
            f"attestmesh intermediate {trust_domain}",
            inter_key,
            Issuer(root_cert, root_key),
            now,
            INTERMEDIATE_LIFETIME,
            s.get("intermediate", x509.random_serial_number()),
            trust_domain,
            0,
        )
        _write_private(paths["root.key"], _key_pem(root_key))
        _write_private(paths["intermediate.key"], _key_pem(inter_key))
        _write_private(
            paths["intermediate.pem"], inter_cert.public_bytes(serialization.Encoding.PEM)
        )
        _write_private(paths["root.pem"], root_cert.public_bytes(serialization.Encoding.PEM))
        return cls(root_cert, Issuer(inter_cert, inter_key), trust_domain)


def build_server_cert(
    ca: CertificateAuthority,
    key: ec.EllipticCurvePrivateKey,
    *,
    spiffe_id: str,
    dns_names: Iterable[str],
    ips: Iterable[str],
    serial: int,
    now: datetime,
    ttl: timedelta,
) -> x509.Certificate:
    """The control plane's own serving certificate (attestation API, xDS) from the mesh CA."""
    not_before, not_after = leaf_validity(now, ttl, ca.intermediate.cert.not_valid_after_utc)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id)]
    names += [x509.DNSName(d) for d in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    return (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "attestmesh control plane")])
        )
        .issuer_name(ca.intermediate.cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca.intermediate.key, hashes.SHA256())
    )


def issue_serving_credentials(
    ca: CertificateAuthority,
    directory: Path,
    stem: str,
    *,
    spiffe_id: str,
    dns_names: Iterable[str],
    ips: Iterable[str],
    now: datetime,
    ttl: timedelta,
) -> tuple[Path, Path]:
    """A fresh key and serving certificate from the mesh CA, written as ``<stem>.pem`` (chain)
    and ``<stem>.key`` (0600) in ``directory``, ready for ``SSLContext.load_cert_chain``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build_server_cert(
        ca,
        key,
        spiffe_id=spiffe_id,
        dns_names=dns_names,
        ips=ips,
        serial=x509.random_serial_number(),
        now=now,
        ttl=ttl,
    )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(ca.chain_pem(cert))
    return cert_path, key_path
