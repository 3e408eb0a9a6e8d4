"""The mesh CA: a P-256 root and intermediates persisted in the state directory
(``certs.ca.slots``), the trust bundle, the CRLs, and intermediate rotation.

Templates are pure (``certs.ca.templates``); a mesh leaf is signed by ``certs.ca.issue`` only.
``CertificateAuthority.load_or_create`` reads (and, after
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.ca import slots
from certs.ca.der import certificate_pem
from certs.ca.slots import NEXT_SLOT, PREVIOUS_SLOT
from certs.ca.templates import BACKDATE, Issuer, ca_certificate, sign_crl
from certs.errors import AttestmeshError
from certs.keystore import FILE_KEYS, KeyStore
from certs.policy import MAX_TTL

ROOT_LIFETIME = timedelta(days=3650)
INTERMEDIATE_LIFETIME = timedelta(days=365)
# Leaves (mesh certificates, policy certificateTTL <= MAX_TTL; the control plane's serving
# certificate, 24 h) live at most this long, so the previous intermediate is kept that long.
PREVIOUS_RETENTION = MAX_TTL + BACKDATE
# A prepared intermediate shorter than this (the root is about to expire) is not worth creating.
MIN_INTERMEDIATE_LIFETIME = timedelta(days=30)


def preparation_time(cert: x509.Certificate) -> datetime:
    """When the next intermediate is prepared: half way through ``cert``'s lifetime."""
    return _point_in_life(cert, 1, 2)


def activation_time(cert: x509.Certificate) -> datetime:
    """When the prepared intermediate takes over signing: two thirds of ``cert``'s lifetime."""
    return _point_in_life(cert, 2, 3)


def _point_in_life(cert: x509.Certificate, numerator: int, denominator: int) -> datetime:
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) * numerator / denominator


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


@dataclass(frozen=True, slots=True, repr=False)
class SigningMaterial:
    """A CA's signing intermediate as bytes, for a worker process that signs leaves
    (``CertificateAuthority.signing_material`` / ``signing_only``); ``ident`` is the SHA-256 of
    the intermediate's DER, by which a worker keeps what it parsed. Never logged or stored."""

    ident: bytes
    root_der: bytes
    cert_der: bytes
    # a file key: PKCS#8 DER, unencrypted (handed only to this process's own workers); a
    # token's key: the reference to it the CA keeps (a pkcs11: object URI), and ``key_store``
    # the token's URI, which a worker opens with a session of its own (the key never leaves)
    key: bytes
    trust_domain: str
    key_store: str = "file"

    def __repr__(self) -> str:
        return f"SigningMaterial({self.ident.hex()[:16]})"


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
    # the root's PEM, which every certificate answer carries: encoded once per CA value
    _bundle_pem: bytes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bundle_pem", self.root.public_bytes(serialization.Encoding.PEM))

    @property
    def bundle_pem(self) -> bytes:
        return self._bundle_pem

    @property
    def intermediate_pem(self) -> bytes:
        return self.intermediate.pem

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
        return leaf.public_bytes(serialization.Encoding.PEM) + (issuer or self.issuer_of(leaf)).pem

    def crl_pem(
        self, revoked: Iterable[tuple[int, datetime]], now: datetime, next_update: timedelta
    ) -> bytes:
        """One CRL per live intermediate, concatenated (the signing one first). Revocations are
        not recorded per issuer, so each CRL lists every revoked serial: serials are random
        159-bit numbers, so a serial names one leaf whichever CRL lists it."""
        entries = list(revoked)
        return b"".join(
            certificate_pem(sign_crl(issuer, entries, now, next_update), b"X509 CRL")
            for issuer in self.issuers
        )

    # -- signing elsewhere: a worker process's copy -----------------------------------------------
    def signing_material(self) -> SigningMaterial | None:
        """What another process needs to sign leaves as this CA's signing intermediate, as
        bytes: a file key itself, or the reference to a token's key and the token's URI
        (None: a key store that cannot be opened elsewhere)."""
        issuer = self.intermediate
        store = self.key_store
        if store.spec == "file":
            try:
                key = issuer.key.private_bytes(
                    serialization.Encoding.DER,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            except (TypeError, ValueError, NotImplementedError, AttestmeshError):
                return None  # (a token's key refuses to be written out)
        elif store.spec:
            try:
                key = store.dump(issuer.key)
            except AttestmeshError:
                return None
        else:
            return None
        cert_der = issuer.cert.public_bytes(serialization.Encoding.DER)
        return SigningMaterial(
            ident=hashlib.sha256(cert_der).digest(),
            root_der=self.root.public_bytes(serialization.Encoding.DER),
            cert_der=cert_der,
            key=key,
            trust_domain=self.trust_domain,
            key_store=store.spec,
        )

    @classmethod
    def signing_only(
        cls, material: SigningMaterial, key_store: KeyStore | None = None
    ) -> CertificateAuthority:
        """A CA that can sign leaves as ``material``'s intermediate and nothing else (no
        directory, no rotation, no previous or prepared intermediate). A token's key is found
        in ``key_store`` (the token ``material.key_store`` names, opened by the caller)."""
        cert = x509.load_der_x509_certificate(material.cert_der)
        if material.key_store == "file":
            key = serialization.load_der_private_key(material.key, password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise AttestmeshError("ca_key_invalid", "signing material holds no EC private key")
        elif key_store is None:
            raise AttestmeshError("ca_key_store_mismatch", "signing material: no key store")
        else:
            key = key_store.load(material.key, "signing material")
        if cert.public_key() != key.public_key():
            raise AttestmeshError("ca_key_invalid", "signing material: key and certificate differ")
        return cls(
            root=x509.load_der_x509_certificate(material.root_der),
            intermediate=Issuer(cert, key),
            trust_domain=material.trust_domain,
            key_store=key_store or FILE_KEYS,
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
        root_key = slots.load_key(directory / "root.key", self.key_store)  # only while preparing
        if root_key.public_key() != self.root.public_key():
            raise AttestmeshError("ca_inconsistent", f"{directory}: root.key is not the root's")
        key = key or self.key_store.generate("intermediate")
        generation = x509.SubjectKeyIdentifier.from_public_key(key.public_key()).digest.hex()
        cert = ca_certificate(
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
        slots.write_private(directory / NEXT_SLOT, slots.slot_json(prepared, None, self.key_store))
        return replace(self, prepared=prepared)

    def activate(self, now: datetime) -> CertificateAuthority:
        """The prepared intermediate signs from now on; the signing one becomes previous."""
        if self.prepared is None:
            raise AttestmeshError("ca_nothing_prepared", "no prepared intermediate to activate")
        directory = self._persisted_in()
        new = self.prepared
        intent = slots.slot_json(self.intermediate, now, self.key_store)
        slots.write_private(directory / PREVIOUS_SLOT, intent)
        slots.finish_activation(directory, new, key_store=self.key_store)
        return replace(
            self, intermediate=new, previous=self.intermediate, prepared=None, activated_at=now
        )

    def retire(self) -> CertificateAuthority:
        """Drop the previous intermediate (its leaves have all expired)."""
        slots.remove(self._persisted_in() / PREVIOUS_SLOT)
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
        root_cert = ca_certificate(
            f"attestmesh root {trust_domain}",
            root_key,
            None,
            now,
            ROOT_LIFETIME,
            s.get("root", x509.random_serial_number()),
            trust_domain,
            1,
        )
        inter_cert = ca_certificate(
            f"attestmesh intermediate {trust_domain}",
            inter_key,
            Issuer(root_cert, root_key),
            now,
            INTERMEDIATE_LIFETIME,
            s.get("intermediate", x509.random_serial_number()),
            trust_domain,
            0,
        )
        slots.write_private(paths["root.key"], key_store.dump(root_key))
        slots.write_private(paths["intermediate.key"], key_store.dump(inter_key))
        slots.write_private(
            paths["intermediate.pem"], inter_cert.public_bytes(serialization.Encoding.PEM)
        )
        slots.write_private(paths["root.pem"], root_cert.public_bytes(serialization.Encoding.PEM))
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
        root_key = slots.load_key(paths["root.key"], key_store)
        if root_key.public_key() != root.public_key():
            raise AttestmeshError(
                "ca_inconsistent", f"{directory}: a CA key does not match its certificate"
            )
        on_disk = Issuer(
            x509.load_pem_x509_certificate(paths["intermediate.pem"].read_bytes()),
            slots.load_key(paths["intermediate.key"], key_store),
        )
        prepared: Issuer | None = None
        previous: Issuer | None = None
        activated_at: datetime | None = None
        if (directory / NEXT_SLOT).exists():
            prepared, _ = slots.read_slot(directory / NEXT_SLOT, key_store)
        if (directory / PREVIOUS_SLOT).exists():
            previous, activated_at = slots.read_slot(directory / PREVIOUS_SLOT, key_store)
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
            slots.finish_activation(directory, current, on_disk, key_store)
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
