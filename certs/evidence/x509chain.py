"""Verify a short X.509 chain to one pinned ECDSA root, with a bounded cache of verified links.

Shared by the Nitro and NVIDIA verifiers, whose vendor chains are all-ECDSA on one curve and
hash. Signatures do not depend on time, so a verified ``(child, issuer)`` link is cached (keyed by
both DER encodings); validity windows are checked against ``now`` on every call.

Reasons: ``untrusted_root`` (the chain does not end at the pinned root), ``chain_invalid``
(issuer name or signature mismatch, wrong key type, an issuer that is not a CA),
``certificate_expired`` / ``certificate_not_yet_valid`` (some certificate is outside its validity
at ``now``), and ``certificate_invalid`` (a certificate does not parse; a format error).

``parse_certificate``/``parse_certificates`` are the project's one strict certificate loader (also
used by the Intel DCAP and SEV-SNP verifiers): everything ``cryptography`` raises or warns about
while decoding the parts we read (names, key, signature algorithm, extensions, validity) becomes
``EvidenceFormatError("certificate_invalid")``, and the parts the signature does not cover (the
outer signatureAlgorithm, the signature's unused bits) must be canonical.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Generic, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.utils import CryptographyDeprecationWarning

from certs.errors import AttestmeshError, EvidenceFormatError, EvidenceVerificationError

MAX_CHAIN = 8
MAX_CERT_DER = 8192
_DER = Encoding.DER

# ---------------------------------------------------------------------------------------------
# strict certificate parsing: every cryptography exception or warning becomes certificate_invalid

_NONPOSITIVE_SERIAL = "Parsed a serial number which wasn't positive"
_CRYPTOGRAPHY_ERRORS: Final = (
    ValueError,
    TypeError,
    UnsupportedAlgorithm,
    x509.InvalidVersion,
    x509.DuplicateExtension,
    x509.UnsupportedGeneralNameType,
)
"""What ``cryptography`` raises on malformed certificate content (parse or lazy decode)."""

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class ParsedCertificate:
    """A certificate every part of which this project reads was decoded once, without error.

    Built only by ``parse_certificate``/``parse_certificates``: after that, reading these fields
    (or the same attributes of ``cert``) cannot raise or warn. One exception: with
    ``allow_nonpositive_serial`` the tolerated warning recurs on ``cert.serial_number``, so read
    ``serial_number`` here instead.
    """

    cert: x509.Certificate
    der: bytes
    subject: x509.Name
    issuer: x509.Name
    serial_number: int
    public_key: CertificatePublicKeyTypes
    signature_hash: hashes.HashAlgorithm | None
    signature_algorithm_oid: x509.ObjectIdentifier
    extensions: x509.Extensions
    not_before: datetime
    not_after: datetime

    @property
    def subject_text(self) -> str:
        """RFC 4514 text of the (already decoded) subject: formatting only, cannot fail."""
        return self.subject.rfc4514_string()

    @property
    def issuer_text(self) -> str:
        return self.issuer.rfc4514_string()

    def basic_constraints(self) -> x509.BasicConstraints | None:
        try:
            return self.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            return None


def decode_strictly(
    read: Callable[[], _T],
    fail: Callable[[str], AttestmeshError],
    *,
    allow_nonpositive_serial: bool = False,
) -> _T:
    """Run ``read`` (``cryptography`` decoding of untrusted bytes, nothing else) and raise
    ``fail(detail)`` for any error or warning it produces.

    The warnings block is narrow: it covers this call only, and tolerates at most the one
    non-positive-serial warning when asked to. (``catch_warnings`` is process-wide, so a warning
    another thread raises meanwhile is seen here too and fails this decode: fail-closed, not
    cached, and on the cold path only.)
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = read()
        except _CRYPTOGRAPHY_ERRORS as exc:
            raise fail(str(exc) or type(exc).__name__) from None
    for warning in caught:
        tolerated = (
            allow_nonpositive_serial
            and issubclass(warning.category, CryptographyDeprecationWarning)
            and str(warning.message).startswith(_NONPOSITIVE_SERIAL)
        )
        if not tolerated:
            raise fail(str(warning.message))
    return value


def _certificate_invalid(what: str) -> Callable[[str], AttestmeshError]:
    return lambda detail: EvidenceFormatError("certificate_invalid", f"{what}: {detail}")


def _tlv(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER element at ``pos`` (short tags only)."""
    if pos + 2 > end:
        raise ValueError("DER element runs past its parent")
    tag, length = data[pos], data[pos + 1]
    pos += 2
    if length & 0x80:
        count = length & 0x7F
        if not 0 < count <= 3 or pos + count > end:
            raise ValueError("unsupported DER length")
        length = int.from_bytes(data[pos : pos + count], "big")
        pos += count
    if pos + length > end:
        raise ValueError("DER element runs past its parent")
    return tag, pos, pos + length


def _check_outer_signature(der: bytes) -> None:
    """The parts of a certificate its signature does not cover must be canonical: the outer
    signatureAlgorithm equals the signed one in tbsCertificate (RFC 5280 4.1.1.2, byte for byte;
    without this, e.g., RSASSA-PSS parameters in the outer copy could be altered freely), and the
    signature BIT STRING has no unused bits."""
    _, start, end = _tlv(der, 0, len(der))
    _, tbs_start, tbs_end = _tlv(der, start, end)
    _, _, alg_end = _tlv(der, tbs_end, end)
    outer = der[tbs_end:alg_end]
    tag, bits_start, bits_end = _tlv(der, alg_end, end)
    if tag != 0x03 or bits_end != end or bits_start == bits_end or der[bits_start] != 0:
        raise ValueError("signature BIT STRING has unused bits or trailing data")
    pos = tbs_start
    tag, _, field_end = _tlv(der, pos, tbs_end)
    if tag == 0xA0:  # [0] version
        pos = field_end
    _, _, pos = _tlv(der, pos, tbs_end)  # serialNumber
    _, _, inner_end = _tlv(der, pos, tbs_end)
    if der[pos:inner_end] != outer:
        raise ValueError("outer signatureAlgorithm differs from the signed one in tbsCertificate")


def _inspect(cert: x509.Certificate) -> ParsedCertificate:
    """Decode every part of ``cert`` we read (names, key, algorithms, extensions, validity)."""
    der = cert.public_bytes(_DER)
    _check_outer_signature(der)
    subject, issuer = cert.subject, cert.issuer
    cert.signature_algorithm_parameters  # noqa: B018 -- decoded for its errors only
    return ParsedCertificate(
        cert=cert,
        der=der,
        subject=subject,
        issuer=issuer,
        serial_number=cert.serial_number,
        public_key=cert.public_key(),
        signature_hash=cert.signature_hash_algorithm,
        signature_algorithm_oid=cert.signature_algorithm_oid,
        extensions=cert.extensions,
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
    )


def parse_certificate(
    data: bytes, *, max_size: int = MAX_CERT_DER, allow_nonpositive_serial: bool = False
) -> ParsedCertificate:
    """Parse one DER or PEM certificate strictly; raise only EvidenceFormatError.

    ``allow_nonpositive_serial``: tolerate (only) cryptography's warning about a serial number
    that is zero or negative (AMD issues VCEK/VLEK certificates with serial 0).
    """
    pem = data.lstrip()[:10] == b"-----BEGIN"
    if len(data) > (2 if pem else 1) * max_size:
        raise EvidenceFormatError("certificate_invalid", "certificate too large")

    def read() -> ParsedCertificate:
        if pem:
            return _inspect(x509.load_pem_x509_certificate(data))
        return _inspect(x509.load_der_x509_certificate(data))

    return decode_strictly(
        read, _certificate_invalid("certificate"), allow_nonpositive_serial=allow_nonpositive_serial
    )


def parse_certificates(
    data: bytes,
    *,
    max_count: int = MAX_CHAIN,
    max_size: int = MAX_CERT_DER,
    allow_nonpositive_serial: bool = False,
) -> tuple[ParsedCertificate, ...]:
    """Parse a PEM bundle (file order, 1 to ``max_count`` certificates) or one DER certificate
    strictly; raise only EvidenceFormatError."""
    if b"-----BEGIN" not in data:
        return (
            parse_certificate(
                data, max_size=max_size, allow_nonpositive_serial=allow_nonpositive_serial
            ),
        )
    if len(data) > 2 * max_size * max_count:
        raise EvidenceFormatError("certificate_invalid", "certificate bundle too large")

    def read() -> tuple[ParsedCertificate, ...]:
        certs = x509.load_pem_x509_certificates(data)
        if not 0 < len(certs) <= max_count:
            raise EvidenceFormatError("certificate_invalid", f"{len(certs)} certificates")
        return tuple(_inspect(c) for c in certs)

    return decode_strictly(
        read,
        _certificate_invalid("certificate bundle"),
        allow_nonpositive_serial=allow_nonpositive_serial,
    )


def load_pem_chain(data: bytes) -> tuple[bytes, ...]:
    """Split a PEM bundle into DER certificates (in file order), each parsed strictly."""
    if b"-----BEGIN" not in data:
        raise EvidenceFormatError("certificate_invalid", "PEM chain: no PEM certificate")
    return tuple(c.der for c in parse_certificates(data))


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


K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """A small thread-safe LRU map for immutable verification results (the verifiers' caches).

    ``get_or`` computes outside the lock: two threads may both compute a missing value, which
    is harmless for pure verification results."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def get_or(self, key: K, make: Callable[[], V]) -> V:
        hit = self.get(key)
        if hit is not None:
            return hit
        value = make()
        self.put(key, value)
        return value


class ChainVerifier:
    """Verifies leaf-first DER chains to one pinned root.

    The chain may end with the root itself (byte-identical) or with a certificate the root
    issued. Every certificate key must be ECDSA on ``curve``; every signature must use ``hash``.
    Every certificate is parsed strictly first (``parse_certificate``), so a malformed one is
    ``certificate_invalid`` and nothing later reads an undecodable part.
    """

    def __init__(
        self,
        root: bytes,
        *,
        curve: type[ec.EllipticCurve] = ec.SECP384R1,
        hash_algorithm: type[hashes.HashAlgorithm] = hashes.SHA384,
        cache_size: int = 512,
    ) -> None:
        self._root = parse_certificate(root, max_size=4 * MAX_CERT_DER)
        self._root_der = self._root.der
        self._curve = curve
        self._hash = hash_algorithm
        self._links: Lru[tuple[bytes, bytes], bool] = Lru(cache_size)
        self._parsed: Lru[bytes, ParsedCertificate] = Lru(cache_size)
        self._chains: Lru[tuple[bytes, ...], VerifiedChain] = Lru(cache_size)

    @property
    def root_der(self) -> bytes:
        return self._root_der

    def _parse(self, der: bytes) -> ParsedCertificate:
        cached = self._parsed.get(der)
        if cached is not None:
            return cached
        if der.lstrip()[:10] == b"-----BEGIN":
            raise EvidenceFormatError("certificate_invalid", "chain certificates must be DER")
        cert = parse_certificate(der)
        self._parsed.put(der, cert)
        return cert

    def _key(self, cert: ParsedCertificate) -> ec.EllipticCurvePublicKey:
        key = cert.public_key
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, self._curve):
            raise EvidenceVerificationError(
                "chain_invalid", f"{cert.subject_text}: key is not {self._curve.name}"
            )
        return key

    def _check_link(self, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        if self._links.get((child.der, parent.der)) is not None:
            return
        self._key(parent)
        constraints = parent.basic_constraints()
        if constraints is None or not constraints.ca:
            raise EvidenceVerificationError("chain_invalid", f"{parent.subject_text} is not a CA")
        if not isinstance(child.signature_hash, self._hash):
            raise EvidenceVerificationError(
                "chain_invalid", f"{child.subject_text}: signature hash is not {self._hash.name}"
            )
        try:
            child.cert.verify_directly_issued_by(parent.cert)
        except (ValueError, TypeError, UnsupportedAlgorithm, InvalidSignature) as exc:
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject_text} not issued by {parent.subject_text}: "
                f"{exc or 'bad signature'}",
            ) from None
        self._links.put((child.der, parent.der), True)

    def verify(self, chain: Sequence[bytes], now: datetime) -> VerifiedChain:
        """Verify leaf-first ``chain`` (DER) to the pinned root at ``now``."""
        key = tuple(chain)
        cached = self._chains.get(key)
        if cached is not None:
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
                f"chain ends at {top.issuer_text}, not the pinned {self._root.subject_text}",
            )
        else:
            try:
                self._check_link(top, self._root)
            except EvidenceVerificationError as exc:
                raise EvidenceVerificationError("untrusted_root", exc.detail) from None
        for child, parent in itertools.pairwise(certs):
            self._check_link(child, parent)
        everything = [*certs, self._root]
        verified = VerifiedChain(
            leaf_key=self._key(certs[0]),
            leaf=certs[0].cert,
            not_before=max(c.not_before for c in everything),
            not_after=min(c.not_after for c in everything),
        )
        self._chains.put(key, verified)
        verified.check_time(now)
        return verified
