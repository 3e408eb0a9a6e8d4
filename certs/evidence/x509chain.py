"""Verify a short X.509 chain to one pinned ECDSA root, with a bounded cache of verified links.

Shared by the Nitro and NVIDIA verifiers, whose vendor chains are all-ECDSA on one curve and
hash. Signatures do not depend on time, so a verified ``(child, issuer)`` link is cached (keyed by
both DER encodings); validity windows are checked against ``now`` on every call.

Reasons: ``untrusted_root`` (the chain does not end at the pinned root), ``chain_invalid``
(issuer name or signature mismatch, wrong key type, an issuer that is not a CA),
``certificate_expired`` / ``certificate_not_yet_valid`` (some certificate is outside its validity
at ``now``), and ``certificate_invalid`` (a certificate does not parse; a format error).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding

from certs.errors import EvidenceFormatError, EvidenceVerificationError

MAX_CHAIN = 8
MAX_CERT_DER = 8192
_DER = Encoding.DER


def load_certificate(data: bytes) -> x509.Certificate:
    """Load one DER or PEM certificate; raise EvidenceFormatError on anything else."""
    if len(data) > 4 * MAX_CERT_DER:
        raise EvidenceFormatError("certificate_invalid", "certificate too large")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except (ValueError, TypeError) as exc:
        raise EvidenceFormatError("certificate_invalid", str(exc)) from None


def load_pem_chain(data: bytes) -> tuple[bytes, ...]:
    """Split a PEM bundle into DER certificates (in file order)."""
    try:
        certs = x509.load_pem_x509_certificates(data)
    except (ValueError, TypeError) as exc:
        raise EvidenceFormatError("certificate_invalid", f"PEM chain: {exc}") from None
    if not 0 < len(certs) <= MAX_CHAIN:
        raise EvidenceFormatError("certificate_invalid", f"chain has {len(certs)} certificates")
    return tuple(c.public_bytes(_DER) for c in certs)


@dataclass(frozen=True, slots=True)
class VerifiedChain:
    """A chain whose links verified; ``not_before``/``not_after`` bound every certificate."""

    leaf_key: ec.EllipticCurvePublicKey
    leaf: x509.Certificate
    not_before: datetime
    not_after: datetime

    def check_time(self, now: datetime) -> None:
        if now < self.not_before:
            raise EvidenceVerificationError(
                "certificate_not_yet_valid", f"a chain certificate is valid from {self.not_before}"
            )
        if now > self.not_after:
            raise EvidenceVerificationError(
                "certificate_expired", f"a chain certificate expired at {self.not_after}"
            )


class _Lru:
    def __init__(self, size: int) -> None:
        self._size = size
        self._data: OrderedDict[object, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: object) -> object | None:
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key: object, value: object) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)


class ChainVerifier:
    """Verifies leaf-first DER chains to one pinned root.

    The chain may end with the root itself (byte-identical) or with a certificate the root
    issued. Every certificate key must be ECDSA on ``curve``; every signature must use ``hash``.
    """

    def __init__(
        self,
        root: bytes,
        *,
        curve: type[ec.EllipticCurve] = ec.SECP384R1,
        hash_algorithm: type[hashes.HashAlgorithm] = hashes.SHA384,
        cache_size: int = 512,
    ) -> None:
        self._root = load_certificate(root)
        self._root_der = self._root.public_bytes(_DER)
        self._curve = curve
        self._hash = hash_algorithm
        self._links = _Lru(cache_size)
        self._parsed = _Lru(cache_size)
        self._chains = _Lru(cache_size)

    @property
    def root_der(self) -> bytes:
        return self._root_der

    def _parse(self, der: bytes) -> x509.Certificate:
        cached = self._parsed.get(der)
        if isinstance(cached, x509.Certificate):
            return cached
        if len(der) > MAX_CERT_DER:
            raise EvidenceFormatError("certificate_invalid", "certificate too large")
        try:
            cert = x509.load_der_x509_certificate(der)
        except (ValueError, TypeError) as exc:
            raise EvidenceFormatError("certificate_invalid", str(exc)) from None
        self._parsed.put(der, cert)
        return cert

    def _key(self, cert: x509.Certificate) -> ec.EllipticCurvePublicKey:
        try:
            key = cert.public_key()
        except (ValueError, TypeError) as exc:
            raise EvidenceVerificationError("chain_invalid", f"unreadable key: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, self._curve):
            raise EvidenceVerificationError(
                "chain_invalid", f"{cert.subject.rfc4514_string()}: key is not {self._curve.name}"
            )
        return key

    def _check_link(
        self, child_der: bytes, child: x509.Certificate, parent_der: bytes, parent: x509.Certificate
    ) -> None:
        if self._links.get((child_der, parent_der)) is not None:
            return
        self._key(parent)
        try:
            constraints = parent.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            constraints = None
        except ValueError as exc:
            raise EvidenceVerificationError("chain_invalid", f"bad extensions: {exc}") from None
        if constraints is None or not constraints.ca:
            raise EvidenceVerificationError(
                "chain_invalid", f"{parent.subject.rfc4514_string()} is not a CA"
            )
        algorithm = child.signature_hash_algorithm
        if not isinstance(algorithm, self._hash):
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject.rfc4514_string()}: signature hash is not {self._hash.name}",
            )
        try:
            child.verify_directly_issued_by(parent)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject.rfc4514_string()} not issued by "
                f"{parent.subject.rfc4514_string()}: {exc or 'bad signature'}",
            ) from None
        self._links.put((child_der, parent_der), True)

    def verify(self, chain: Sequence[bytes], now: datetime) -> VerifiedChain:
        """Verify leaf-first ``chain`` (DER) to the pinned root at ``now``."""
        key = tuple(chain)
        cached = self._chains.get(key)
        if isinstance(cached, VerifiedChain):
            cached.check_time(now)
            return cached
        if not 0 < len(key) <= MAX_CHAIN:
            raise EvidenceFormatError("certificate_invalid", f"chain has {len(key)} certificates")
        ders = list(key)
        if len(ders) > 1 and ders[-1] == self._root_der:
            ders.pop()
        certs = [self._parse(d) for d in ders]
        top = certs[-1]
        if ders[-1] == self._root_der:
            pass  # a lone root as chain: the leaf is the root itself
        elif top.issuer != self._root.subject:
            raise EvidenceVerificationError(
                "untrusted_root",
                f"chain ends at {top.issuer.rfc4514_string()}, not the pinned "
                f"{self._root.subject.rfc4514_string()}",
            )
        else:
            try:
                self._check_link(ders[-1], top, self._root_der, self._root)
            except EvidenceVerificationError as exc:
                raise EvidenceVerificationError("untrusted_root", exc.detail) from None
        for i in range(len(certs) - 1):
            self._check_link(ders[i], certs[i], ders[i + 1], certs[i + 1])
        everything = [*certs, self._root]
        verified = VerifiedChain(
            leaf_key=self._key(certs[0]),
            leaf=certs[0],
            not_before=max(c.not_valid_before_utc for c in everything),
            not_after=min(c.not_valid_after_utc for c in everything),
        )
        self._chains.put(key, verified)
        verified.check_time(now)
        return verified
