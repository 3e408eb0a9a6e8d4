"""The mesh CA: a P-256 root and intermediate persisted in the state directory, leaf issuance
with capped lifetimes, the trust bundle and the CRLs.

Templates and lifetimes are pure (``build_leaf``, ``leaf_validity``, ``build_crl``): time and
serial numbers come in as arguments. ``CertificateAuthority.load_or_create`` reads (and, after
a crash, repairs) the state directory; ``prepare``/``activate``/``retire`` write it.

Intermediate rotation (two slots, as SPIRE does it). The root signs every intermediate and is
the whole trust bundle, so rotating the intermediate never splits trust. Pure predicates on the
signing intermediate decide; a ticker (the control plane's deadline loop) acts on them:

- ``should_prepare(now)`` at 1/2 of the signing intermediate's lifetime: a new intermediate is
  created and persisted in the ``next`` slot; it signs nothing yet but gets its (empty) CRL in
  the CRL set, so every Envoy already holds it when the first leaf it signs arrives.
- ``should_activate(now)`` at 2/3: the prepared intermediate signs from now on; the old one
  becomes ``previous``: its CRL stays in the set and chains of its leaves stay valid.
- ``should_retire(now)``: ``previous`` is dropped once it has expired or once ``MAX_TTL``
  (the longest leaf lifetime) has passed since the activation: no leaf it signed is alive.

Root rotation is out of scope: the root lives 10 years and every intermediate's notAfter is
capped at the root's; ``should_prepare`` stops preparing when the root has less than
``MIN_INTERMEDIATE_LIFETIME`` left, and replacing the root then is an operator's task (a new
trust bundle distributed before the old root expires).

On disk (directory 0700, files 0600, each written to a temporary file and renamed):
``root.pem``/``root.key`` (never rewritten), ``intermediate.pem``/``intermediate.key`` (the
signing intermediate, the original layout), ``intermediate-next.json`` (the prepared slot) and
``intermediate-previous.json`` (the previous slot with its activation time). Activation writes
``previous``, then the signing key, then the signing certificate, then removes ``next``; the
first step records the intent, so ``load_or_create`` finishes an interrupted activation (the
prepared slot is the evidence) and never pairs a key with another intermediate's certificate.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.ear import CMW_OID
from certs.errors import AttestmeshError
from certs.evidence.claims import Claims
from certs.keystore import FILE_KEYS, KeyStore
from certs.policy import MAX_TTL

# 2.25.<uuid as integer> — an arc of the project's own (ITU-T X.667), fixed forever.
CLAIMS_OID = x509.ObjectIdentifier("2.25.191056338567094339622416036213146734331")
BACKDATE = timedelta(seconds=30)
ROOT_LIFETIME = timedelta(days=3650)
INTERMEDIATE_LIFETIME = timedelta(days=365)
# Leaves (mesh certificates, policy certificateTTL <= MAX_TTL; the control plane's serving
# certificate, 24 h) live at most this long, so the previous intermediate is kept that long.
PREVIOUS_RETENTION = MAX_TTL + BACKDATE
# A prepared intermediate shorter than this (the root is about to expire) is not worth creating.
MIN_INTERMEDIATE_LIFETIME = timedelta(days=30)
# A leaf's Subject names the class of its admitted claims (see ``claims_class``).
CLAIMS_CLASS_ORG = "attestmesh"
CLAIMS_CLASS_PREFIX = "claims-"
_CLAIMS_CLASS = re.compile(r"claims-[0-9a-f]{48}")
NEXT_SLOT = "intermediate-next.json"
PREVIOUS_SLOT = "intermediate-previous.json"
_SLOT_MAX_BYTES = 64 * 1024


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


def claims_class(tee: str, measurements: Mapping[str, str]) -> str:
    """The class of a workload's admitted claims: ``claims-`` + 48 hex digits (192 bits) of a
    SHA-256 over the canonical (tee, sorted measurements, values lowercase). Pure; the CA puts
    it in each leaf's Subject (``OU``) and the xDS builder computes it from the claims on record,
    so a ``whenClaims`` mesh rule can hold per certificate, not per service account. Equal
    claims give an equal class: a renewal changes nothing Envoy authorizes on."""
    canonical = json.dumps(
        [tee, sorted((k, v.lower()) for k, v in measurements.items())],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return CLAIMS_CLASS_PREFIX + hashlib.sha256(canonical.encode()).hexdigest()[:48]


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
    """Sign a mesh leaf: SPIFFE URI SAN only, client+server auth, claims extension. With
    ``claims_class`` the Subject is ``O=attestmesh, OU=<claims_class>`` (Envoy forwards it in
    x-forwarded-client-cert, which claims-conditioned RBAC matches); without, it is empty.
    ``cmw_extension``: the attestation result in standard form (``certs.ear``), non-critical."""
    not_before, not_after = leaf_validity(now, ttl, issuer.cert.not_valid_after_utc)
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    if claims_class is not None and not _CLAIMS_CLASS.fullmatch(claims_class):
        raise ValueError(f"not a claims class: {claims_class!r}")
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
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
        .add_extension(x509.UnrecognizedExtension(CLAIMS_OID, claims_extension), critical=False)
    )
    if cmw_extension is not None:
        builder = builder.add_extension(
            x509.UnrecognizedExtension(CMW_OID, cmw_extension), critical=False
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
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer.key.public_key()),
            critical=False,
        )
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


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    _commit(tmp, path)


def _commit(tmp: Path, path: Path) -> None:
    """The one step that makes a write visible: rename, then make the rename durable."""
    tmp.replace(path)
    _sync_directory(path.parent)


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    _sync_directory(path.parent)


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_key(path: Path, key_store: KeyStore = FILE_KEYS) -> ec.EllipticCurvePrivateKey:
    """The key (file store) or the token's key the file refers to (PKCS#11 store)."""
    return key_store.load(path.read_bytes(), str(path))


def preparation_time(cert: x509.Certificate) -> datetime:
    """When the next intermediate is prepared: half way through ``cert``'s lifetime."""
    return _point_in_life(cert, 1, 2)


def activation_time(cert: x509.Certificate) -> datetime:
    """When the prepared intermediate takes over signing: two thirds of ``cert``'s lifetime."""
    return _point_in_life(cert, 2, 3)


def _point_in_life(cert: x509.Certificate, numerator: int, denominator: int) -> datetime:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * numerator / denominator


def _slot_json(
    issuer: Issuer, activated_at: datetime | None, key_store: KeyStore = FILE_KEYS
) -> bytes:
    doc: dict[str, str] = {
        "certificate": issuer.cert.public_bytes(serialization.Encoding.PEM).decode(),
        "key": key_store.dump(issuer.key).decode(),
    }
    if activated_at is not None:
        doc["activated_at"] = activated_at.isoformat()
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def _read_slot(path: Path, key_store: KeyStore = FILE_KEYS) -> tuple[Issuer, datetime | None]:
    """A slot file as written by ``_slot_json`` (written atomically: anything else is damage)."""
    try:
        raw = path.read_bytes()
        if len(raw) > _SLOT_MAX_BYTES:
            raise ValueError("slot file too large")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        cert = x509.load_pem_x509_certificate(str(doc["certificate"]).encode())
        key = key_store.load(str(doc["key"]).encode(), str(path))
        at = doc.get("activated_at")
        activated_at = None if at is None else datetime.fromisoformat(str(at))
        if activated_at is not None and activated_at.utcoffset() is None:
            raise ValueError("activated_at without a time zone")
    except (ValueError, TypeError, KeyError, UnsupportedAlgorithm) as exc:
        raise AttestmeshError("ca_inconsistent", f"{path}: unreadable CA slot: {exc}") from None
    return Issuer(cert, key), activated_at


def _check_intermediate(
    directory: Path, root: x509.Certificate, issuer: Issuer, trust_domain: str
) -> None:
    try:
        issuer.cert.verify_directly_issued_by(root)
    except (ValueError, TypeError, InvalidSignature):
        raise AttestmeshError(
            "ca_inconsistent", f"{directory}: the intermediate is not issued by the root"
        ) from None
    if issuer.key.public_key() != issuer.cert.public_key():
        raise AttestmeshError(
            "ca_inconsistent", f"{directory}: a CA key does not match its certificate"
        )
    try:
        constraints = issuer.cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        constraints = x509.NameConstraints(permitted_subtrees=None, excluded_subtrees=None)
    permitted = [g.value for g in constraints.permitted_subtrees or []]
    if trust_domain not in permitted:
        raise AttestmeshError(
            "ca_trust_domain_mismatch",
            f"CA in {directory} is not for trust domain {trust_domain}",
        )


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """The mesh CA. ``intermediate`` signs; ``prepared`` (the next slot) will sign after the
    activation; ``previous`` signed before it (``activated_at``) and is kept for the CRLs and
    chains of the leaves it signed. Values are immutable: each rotation step returns a new CA."""

    root: x509.Certificate
    intermediate: Issuer
    trust_domain: str
    previous: Issuer | None = None
    prepared: Issuer | None = None
    activated_at: datetime | None = None
    directory: Path | None = None
    key_store: KeyStore = field(default=FILE_KEYS, compare=False, repr=False)  # where keys live

    @property
    def bundle_pem(self) -> bytes:
        return self.root.public_bytes(serialization.Encoding.PEM)

    @property
    def intermediate_pem(self) -> bytes:
        return self.intermediate.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def issuers(self) -> tuple[Issuer, ...]:
        """Every live intermediate, the signing one first: each needs a CRL in the trust set."""
        return tuple(i for i in (self.intermediate, self.previous, self.prepared) if i is not None)

    def issuer_of(self, leaf: x509.Certificate) -> Issuer:
        """The live intermediate that signed ``leaf`` (the signing one if none did)."""
        for issuer in self.issuers:
            if leaf.issuer != issuer.cert.subject:
                continue
            try:
                leaf.verify_directly_issued_by(issuer.cert)
            except (ValueError, TypeError, InvalidSignature):
                continue
            return issuer
        return self.intermediate

    def chain_pem(self, leaf: x509.Certificate, issuer: Issuer | None = None) -> bytes:
        """The leaf and the intermediate that signed it, in that order. ``issuer``: the one
        known to have just signed it (saves finding it by verifying the leaf's signature)."""
        return leaf.public_bytes(serialization.Encoding.PEM) + (
            issuer or self.issuer_of(leaf)
        ).cert.public_bytes(serialization.Encoding.PEM)

    def crl_pem(
        self, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
    ) -> bytes:
        """One CRL per live intermediate, concatenated (the signing one first). Revocations are
        not recorded per issuer, so each CRL lists every revoked serial: serials are random
        159-bit numbers, so a serial names one leaf whichever CRL lists it."""
        entries = list(revoked)
        return b"".join(
            build_crl(issuer, entries, now, next_update).public_bytes(serialization.Encoding.PEM)
            for issuer in self.issuers
        )

    # -- rotation: pure predicates --------------------------------------------------------------
    def should_prepare(self, now: datetime) -> bool:
        """Half way through the signing intermediate's life, unless a usable one is prepared
        (or the root has too little life left to be worth it: root rotation is manual)."""
        if self.prepared is not None and now < self.prepared.cert.not_valid_after_utc:
            return False
        if now < preparation_time(self.intermediate.cert):
            return False
        return self.root.not_valid_after_utc - now >= MIN_INTERMEDIATE_LIFETIME

    def should_activate(self, now: datetime) -> bool:
        """Two thirds through the signing intermediate's life, if a valid one is prepared."""
        if self.prepared is None:
            return False
        cert = self.prepared.cert
        if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
            return False
        return now >= activation_time(self.intermediate.cert)

    def should_retire(self, now: datetime) -> bool:
        """The previous intermediate has expired, or every leaf it signed has."""
        if self.previous is None:
            return False
        if now >= self.previous.cert.not_valid_after_utc:
            return True
        return self.activated_at is not None and now >= self.activated_at + PREVIOUS_RETENTION

    # -- rotation: steps (persisted before they are returned) -----------------------------------
    def prepare(
        self,
        now: datetime,
        *,
        key: ec.EllipticCurvePrivateKey | None = None,
        serial: int | None = None,
    ) -> CertificateAuthority:
        """Create the next intermediate under the root and persist it in the ``next`` slot."""
        directory = self._persisted_in()
        root_key = _load_key(directory / "root.key", self.key_store)  # only while preparing
        if root_key.public_key() != self.root.public_key():
            raise AttestmeshError("ca_inconsistent", f"{directory}: root.key is not the root's")
        key = key or self.key_store.generate("intermediate")
        generation = x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest.hex()
        cert = _ca_cert(
            f"attestmesh intermediate {self.trust_domain}",
            key,
            Issuer(self.root, root_key),
            now,
            INTERMEDIATE_LIFETIME,
            x509.random_serial_number() if serial is None else serial,
            self.trust_domain,
            0,
            generation,
        )
        prepared = Issuer(cert, key)
        _write_private(directory / NEXT_SLOT, _slot_json(prepared, None, self.key_store))
        return replace(self, prepared=prepared)

    def activate(self, now: datetime) -> CertificateAuthority:
        """The prepared intermediate signs from now on; the signing one becomes previous."""
        if self.prepared is None:
            raise AttestmeshError("ca_nothing_prepared", "no prepared intermediate to activate")
        directory = self._persisted_in()
        new = self.prepared
        intent = _slot_json(self.intermediate, now, self.key_store)
        _write_private(directory / PREVIOUS_SLOT, intent)
        _finish_activation(directory, new, key_store=self.key_store)
        return replace(
            self, intermediate=new, previous=self.intermediate, prepared=None, activated_at=now
        )

    def retire(self) -> CertificateAuthority:
        """Drop the previous intermediate (its leaves have all expired)."""
        _remove(self._persisted_in() / PREVIOUS_SLOT)
        return replace(self, previous=None, activated_at=None)

    def _persisted_in(self) -> Path:
        if self.directory is None:
            raise AttestmeshError("ca_not_persisted", "this CA has no state directory")
        return self.directory

    @classmethod
    def load_or_create(
        cls,
        directory: Path,
        trust_domain: str,
        now: datetime,
        serials: Mapping[str, int] | None = None,
        key_store: KeyStore = FILE_KEYS,
    ) -> CertificateAuthority:
        """Load the CA from ``directory`` or create it there (keys 0600). A CA persisted once is
        reused after restarts: a new CA would split trust between peers. An activation that a
        crash interrupted is finished here. ``key_store``: where the private keys live (files,
        or a PKCS#11 token: then the ``*.key`` files hold references, ``certs.keystore``)."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        paths = {
            n: directory / f"{n}"
            for n in ("root.pem", "root.key", "intermediate.pem", "intermediate.key")
        }
        if all(p.exists() for p in paths.values()):
            return cls._load(directory, trust_domain, paths, key_store)
        if any(p.exists() for p in paths.values()):
            raise AttestmeshError(
                "ca_incomplete", f"{directory} holds a partial CA; refusing to overwrite it"
            )
        s = serials or {}
        root_key = key_store.generate("root")
        inter_key = key_store.generate("intermediate")
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
        _write_private(paths["root.key"], key_store.dump(root_key))
        _write_private(paths["intermediate.key"], key_store.dump(inter_key))
        _write_private(
            paths["intermediate.pem"], inter_cert.public_bytes(serialization.Encoding.PEM)
        )
        _write_private(paths["root.pem"], root_cert.public_bytes(serialization.Encoding.PEM))
        return cls(
            root_cert,
            Issuer(inter_cert, inter_key),
            trust_domain,
            directory=directory,
            key_store=key_store,
        )

    @classmethod
    def _load(
        cls,
        directory: Path,
        trust_domain: str,
        paths: Mapping[str, Path],
        key_store: KeyStore = FILE_KEYS,
    ) -> CertificateAuthority:
        root = x509.load_pem_x509_certificate(paths["root.pem"].read_bytes())
        root_key = _load_key(paths["root.key"], key_store)
        if root_key.public_key() != root.public_key():
            raise AttestmeshError(
                "ca_inconsistent", f"{directory}: a CA key does not match its certificate"
            )
        on_disk = Issuer(
            x509.load_pem_x509_certificate(paths["intermediate.pem"].read_bytes()),
            _load_key(paths["intermediate.key"], key_store),
        )
        prepared: Issuer | None = None
        previous: Issuer | None = None
        activated_at: datetime | None = None
        if (directory / NEXT_SLOT).exists():
            prepared, _ = _read_slot(directory / NEXT_SLOT, key_store)
        if (directory / PREVIOUS_SLOT).exists():
            previous, activated_at = _read_slot(directory / PREVIOUS_SLOT, key_store)
        interrupted = prepared is not None and _activation_began(on_disk, prepared, previous)
        if prepared is not None and interrupted:
            current, prepared = prepared, None  # finish the activation (below, once checked)
        else:
            current = on_disk
            if previous is not None and previous.cert == on_disk.cert:
                previous = activated_at = None  # not reachable by our writes; a duplicate
        for issuer in (current, previous, prepared):
            if issuer is not None:
                _check_intermediate(directory, root, issuer, trust_domain)
        if previous is not None and activated_at is None:
            raise AttestmeshError("ca_inconsistent", f"{directory}: previous slot has no time")
        if interrupted:
            _finish_activation(directory, current, on_disk, key_store)
        return cls(
            root, current, trust_domain, previous, prepared, activated_at, directory, key_store
        )


def rotation_step(ca: CertificateAuthority, now: datetime) -> CertificateAuthority | None:
    """The step the predicates call for at ``now`` (prepare, activate, retire: in that order),
    persisted and applied; None when none is due. The ticker calls it until it returns None,
    keeping each returned CA: a failure leaves the last persisted step in force."""
    if ca.should_prepare(now):
        return ca.prepare(now)
    if ca.should_activate(now):
        return ca.activate(now)
    if ca.should_retire(now):
        return ca.retire()
    return None


def _activation_began(on_disk: Issuer, prepared: Issuer, previous: Issuer | None) -> bool:
    """Whether an activation of ``prepared`` wrote its first step (the previous slot now holds
    the intermediate files' certificate) or more (a file of the signing pair is the prepared
    one's)."""
    wanted = prepared.cert.public_key()
    return (
        on_disk.cert == prepared.cert
        or on_disk.key.public_key() == wanted
        or (previous is not None and previous.cert == on_disk.cert)
    )


def _finish_activation(
    directory: Path,
    new: Issuer,
    on_disk: Issuer | None = None,
    key_store: KeyStore = FILE_KEYS,
) -> None:
    """Make ``new`` the signing pair on disk (key, then certificate), then empty ``next``.
    Each write is skipped when it is already done, so finishing again is a no-op."""
    if on_disk is None or on_disk.key.public_key() != new.cert.public_key():
        _write_private(directory / "intermediate.key", key_store.dump(new.key))
    if on_disk is None or on_disk.cert != new.cert:
        _write_private(
            directory / "intermediate.pem", new.cert.public_bytes(serialization.Encoding.PEM)
        )
    _remove(directory / NEXT_SLOT)


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
