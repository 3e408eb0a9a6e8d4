"""The project's one X.509/DER toolkit: every verifier (Nitro, NVIDIA, SEV-SNP, Intel DCAP) and
the collateral code use it, and nothing else parses certificates, walks DER or checks validity.

* ``parse_certificate``/``parse_certificates``: the one strict certificate loader. Everything
  ``cryptography`` raises or warns about while decoding the parts we read (names, key, signature
  algorithm, extensions, validity) becomes ``EvidenceFormatError("certificate_invalid")``, and the
  parts the signature does not cover (the outer signatureAlgorithm, the signature's unused bits)
  must be canonical. ``decode_strictly`` is the same discipline for other ``cryptography``
  decoding (CRLs).
* ``der_tlv``/``der_items``/``der_single``/``der_uint``: the one set of DER helpers, for vendor
  extensions ``cryptography`` leaves undecoded (Intel's SGX extension, AMD's TCB and hwID).
* ``Window``/``check_window``: the one validity check; ``now`` is always an argument.
  Reasons ``<kind>_not_yet_valid`` / ``<kind>_expired`` (kind ``certificate`` or ``collateral``).
* ``ChainVerifier``/``VerifiedChain``: the one chain verifier, to one pinned root, with the
  vendor's link algorithm as a ``LinkScheme`` (``EcdsaLinks``, ``RsaPssLinks``). Signatures do not
  depend on time, so verified links and chains are cached (keyed by DER); validity is checked
  against ``now`` on every call. Reasons: ``untrusted_root`` (the chain does not end at the
  pinned root), ``chain_invalid`` (issuer name or signature mismatch, wrong key type or
  algorithm, an issuer that is not a CA), ``certificate_expired`` /
  ``certificate_not_yet_valid``, ``certificate_invalid`` (a certificate does not parse; a format
  error).
* ``parse_crl``: the one strict CRL reader (Intel PCK/Root CA CRLs, AMD KDS CRLs).
* ``verify_raw_ecdsa``: vendor signatures carried as big-endian ``r || s``.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Final, Generic, Protocol, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
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

    def raw_extension(self, oid: x509.ObjectIdentifier) -> bytes | None:
        """The DER value of an extension ``cryptography`` does not decode (a vendor's: Intel's
        SGX extension, AMD's TCB and hwID, the TCG DICE TcbInfo); None when absent, or when
        ``cryptography`` knows the type (then it is not the vendor's)."""
        try:
            value = self.extensions.get_extension_for_oid(oid).value
        except x509.ExtensionNotFound:
            return None
        return value.value if isinstance(value, x509.UnrecognizedExtension) else None

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


# ---------------------------------------------------------------------------------------------
# DER: the one set of helpers for the parts ``cryptography`` leaves undecoded (vendor extensions,
# the unsigned parts of a certificate). Short tags, definite lengths of at most 3 bytes; every
# malformation is ValueError (callers translate it to their reason).


def der_tlv(data: bytes, pos: int = 0, end: int | None = None) -> tuple[int, int, int]:
    """(tag, content start, content end) of the DER element at ``pos`` inside ``data[:end]``."""
    end = len(data) if end is None else end
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


def der_items(content: bytes) -> list[tuple[int, bytes]]:
    """Split DER content (e.g. a SEQUENCE's) into its (tag, content) elements."""
    items: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(content):
        tag, start, pos = der_tlv(content, pos)
        items.append((tag, content[start:pos]))
    return items


def der_single(data: bytes, tag: int) -> bytes:
    """The content of ``data``, which must be exactly one element with ``tag``."""
    items = der_items(data)
    if len(items) != 1 or items[0][0] != tag:
        raise ValueError(f"not one DER element with tag {tag:#04x}")
    return items[0][1]


def der_uint(content: bytes, *, max_len: int | None = None) -> int:
    """A non-negative INTEGER from its content octets (at most ``max_len`` of them)."""
    if not content or content[0] & 0x80:
        raise ValueError("not a non-negative integer")
    if max_len is not None and len(content) > max_len:
        raise ValueError(f"integer longer than {max_len} bytes")
    return int.from_bytes(content, "big")


TAG_INTEGER: Final = 0x02
TAG_OCTET_STRING: Final = 0x04
TAG_OID: Final = 0x06
TAG_IA5_STRING: Final = 0x16
TAG_SEQUENCE: Final = 0x30


def _check_outer_signature(der: bytes) -> None:
    """The parts of a certificate its signature does not cover must be canonical: the outer
    signatureAlgorithm equals the signed one in tbsCertificate (RFC 5280 4.1.1.2, byte for byte;
    without this, e.g., RSASSA-PSS parameters in the outer copy could be altered freely), and the
    signature BIT STRING has no unused bits."""
    _, start, end = der_tlv(der, 0, len(der))
    _, tbs_start, tbs_end = der_tlv(der, start, end)
    _, _, alg_end = der_tlv(der, tbs_end, end)
    outer = der[tbs_end:alg_end]
    tag, bits_start, bits_end = der_tlv(der, alg_end, end)
    if tag != 0x03 or bits_end != end or bits_start == bits_end or der[bits_start] != 0:
        raise ValueError("signature BIT STRING has unused bits or trailing data")
    pos = tbs_start
    tag, _, field_end = der_tlv(der, pos, tbs_end)
    if tag == 0xA0:  # [0] version
        pos = field_end
    _, _, pos = der_tlv(der, pos, tbs_end)  # serialNumber
    _, _, inner_end = der_tlv(der, pos, tbs_end)
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


# ---------------------------------------------------------------------------------------------
# strict CRL reading

MAX_CRL_BYTES: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class ParsedCrl:
    """A CRL every part of which this project reads was decoded once, without error or warning
    (built only by ``parse_crl``). ``signature_valid`` is the caller's check, run inside the
    strict decode (None when none was asked for)."""

    crl: x509.CertificateRevocationList
    issuer: x509.Name
    issuer_text: str
    last_update: datetime
    next_update: datetime | None
    revoked: frozenset[int]
    signature: bytes
    tbs: bytes
    signature_valid: bool | None


def parse_crl(
    data: bytes,
    fail: Callable[[str], AttestmeshError],
    *,
    signature_valid: Callable[[x509.CertificateRevocationList], bool] | None = None,
    max_size: int = MAX_CRL_BYTES,
) -> ParsedCrl:
    """Parse a DER or PEM CRL strictly: anything ``cryptography`` raises or warns about while
    decoding it (names, entries, algorithms, or the optional ``signature_valid`` check) is
    ``fail(detail)``."""
    if len(data) > max_size:
        raise fail(f"{len(data)} bytes is too large")

    def read() -> ParsedCrl:
        if data.lstrip().startswith(b"-----BEGIN"):
            crl = x509.load_pem_x509_crl(data)
        else:
            crl = x509.load_der_x509_crl(data)
        name = crl.issuer
        return ParsedCrl(
            crl=crl,
            issuer=name,
            issuer_text=name.rfc4514_string(),
            last_update=crl.last_update_utc,
            next_update=crl.next_update_utc,
            revoked=frozenset(r.serial_number for r in crl),
            signature=crl.signature,
            tbs=crl.tbs_certlist_bytes,
            signature_valid=None if signature_valid is None else signature_valid(crl),
        )

    return decode_strictly(read, fail)


# ---------------------------------------------------------------------------------------------
# names and validity windows


def common_name(name: x509.Name) -> str:
    """The first CN of ``name`` (a decoded name: formatting only), else its RFC 4514 text."""
    attrs = name.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    if not attrs:
        return name.rfc4514_string()
    value = attrs[0].value
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class Window:
    """A validity period; ``starts``/``ends`` name what its bounds come from (for details)."""

    not_before: datetime
    not_after: datetime
    starts: str = ""
    ends: str = ""

    def contains(self, now: datetime) -> bool:
        return self.not_before <= now <= self.not_after

    @staticmethod
    def of(cert: ParsedCertificate) -> Window:
        name = cert.subject_text
        return Window(cert.not_before, cert.not_after, name, name)

    @staticmethod
    def intersection(windows: Iterable[Window]) -> Window:
        """The period inside every window (empty when the latest start is after the earliest end),
        naming the windows that bind it."""
        items = list(windows)
        start = max(items, key=lambda w: w.not_before)
        end = min(items, key=lambda w: w.not_after)
        return Window(start.not_before, end.not_after, start.starts, end.ends)


def check_window(window: Window, now: datetime, *, kind: str = "certificate") -> None:
    """The one validity check: raise ``<kind>_not_yet_valid`` / ``<kind>_expired`` when ``now``
    (an aware datetime, passed in: nothing here reads a clock) is outside ``window``."""
    if now.tzinfo is None:
        raise ValueError("now must be an aware datetime")
    if now < window.not_before:
        raise EvidenceVerificationError(
            f"{kind}_not_yet_valid", f"{window.starts} valid from {window.not_before.isoformat()}"
        )
    if now > window.not_after:
        raise EvidenceVerificationError(
            f"{kind}_expired", f"{window.ends} valid until {window.not_after.isoformat()}"
        )


# ---------------------------------------------------------------------------------------------
# raw signatures


def raw_ecdsa_signature(rs: bytes) -> bytes:
    """DER ECDSA-Sig-Value from big-endian ``r || s`` of equal halves (ValueError otherwise)."""
    if not rs or len(rs) % 2:
        raise ValueError("raw ECDSA signature must be r || s of equal length")
    half = len(rs) // 2
    return encode_dss_signature(int.from_bytes(rs[:half], "big"), int.from_bytes(rs[half:], "big"))


def verify_raw_ecdsa(
    key: ec.EllipticCurvePublicKey, rs: bytes, data: bytes, hash_algorithm: hashes.HashAlgorithm
) -> bool:
    """Whether ``rs`` (big-endian ``r || s``, each as long as the curve's order) is ``key``'s
    ECDSA signature over ``data``."""
    if len(rs) != 2 * ((key.curve.key_size + 7) // 8):
        return False
    try:
        key.verify(raw_ecdsa_signature(rs), data, ec.ECDSA(hash_algorithm))
    except (InvalidSignature, ValueError):
        return False
    return True


# ---------------------------------------------------------------------------------------------
# caches


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


# ---------------------------------------------------------------------------------------------
# the one chain verifier


class LinkScheme(Protocol):
    """How a certificate's signature by its issuer is checked (the vendor's algorithm)."""

    def check(self, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        """Raise ``EvidenceVerificationError("chain_invalid", ...)`` unless ``parent`` signed
        ``child`` the scheme's way."""


_LINK_ERRORS = (ValueError, TypeError, UnsupportedAlgorithm, InvalidSignature)
"""What ``verify_directly_issued_by`` raises for a link that does not verify."""


@dataclass(frozen=True, slots=True)
class EcdsaLinks:
    """ECDSA links: the issuer key on ``curve``, the signature with ``hash_algorithm``
    (Nitro and NVIDIA: P-384/SHA-384; Intel DCAP: P-256/SHA-256)."""

    curve: type[ec.EllipticCurve]
    hash_algorithm: type[hashes.HashAlgorithm]

    def check(self, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        key = parent.public_key
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, self.curve):
            raise EvidenceVerificationError(
                "chain_invalid", f"{parent.subject_text}: key is not {self.curve.name}"
            )
        if not isinstance(child.signature_hash, self.hash_algorithm):
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject_text}: signature hash is not {self.hash_algorithm.name}",
            )
        try:
            child.cert.verify_directly_issued_by(parent.cert)
        except _LINK_ERRORS as exc:
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject_text} not issued by {parent.subject_text}: "
                f"{exc or 'bad signature'}",
            ) from None


@dataclass(frozen=True, slots=True)
class RsaPssLinks:
    """RSASSA-PSS links with parameters fixed here, not read from the certificate (AMD: SHA-384,
    MGF1-SHA-384, salt 48). The strict parser already requires the unsigned outer
    signatureAlgorithm (with its PSS parameters) to equal the signed one."""

    hash_algorithm: type[hashes.HashAlgorithm] = hashes.SHA384
    salt_length: int = 48

    def check(self, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        if child.issuer != parent.subject:
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject_text}: issuer {child.issuer_text!r} != {parent.subject_text!r}",
            )
        key = parent.public_key
        if not isinstance(key, rsa.RSAPublicKey):
            raise EvidenceVerificationError(
                "chain_invalid", f"{parent.subject_text}: key is not RSA"
            )
        if child.signature_algorithm_oid != x509.SignatureAlgorithmOID.RSASSA_PSS or not (
            isinstance(child.signature_hash, self.hash_algorithm)
        ):
            raise EvidenceVerificationError(
                "chain_invalid",
                f"{child.subject_text}: not RSASSA-PSS/{self.hash_algorithm.name}",
            )
        if not self.signed(key, child.cert.signature, child.cert.tbs_certificate_bytes):
            raise EvidenceVerificationError(
                "chain_invalid", f"{child.subject_text} not issued by {parent.subject_text}"
            )

    def signed(self, key: rsa.RSAPublicKey, signature: bytes, data: bytes) -> bool:
        """Whether ``signature`` is ``key``'s RSASSA-PSS signature (these parameters) on ``data``
        (a certificate's TBS, or a CRL's)."""
        pss = padding.PSS(mgf=padding.MGF1(self.hash_algorithm()), salt_length=self.salt_length)
        try:
            key.verify(signature, data, pss, self.hash_algorithm())
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True, slots=True)
class VerifiedChain:
    """A chain whose links verified up to the pinned root (time-free: ``check_time`` is the
    validity check, at the caller's ``now``)."""

    certs: tuple[ParsedCertificate, ...]
    """Non-root certificates, leaf first (the root itself when it is the whole chain)."""
    root: ParsedCertificate
    leaf_key: ec.EllipticCurvePublicKey
    window: Window
    """Where every certificate of the chain, the root included, is valid."""

    @property
    def leaf(self) -> ParsedCertificate:
        return self.certs[0]

    @property
    def issuer(self) -> ParsedCertificate:
        """The leaf's issuer (the root for a one-certificate chain)."""
        return self.certs[1] if len(self.certs) > 1 else self.root

    def check_time(self, now: datetime) -> None:
        check_window(self.window, now, kind="certificate")


def _der_of(cert: bytes | ParsedCertificate) -> bytes:
    return cert if isinstance(cert, bytes) else cert.der


class ChainVerifier:
    """Verifies leaf-first chains to one pinned root: the one chain verifier of the project.

    The chain may end with the root itself (byte-identical) or with a certificate the root
    issued. ``links`` checks every signature (the top certificate's by the root: a failure
    there, or a top issuer that is not the root, is ``untrusted_root``; any other link's is
    ``chain_invalid``); every issuer must be a CA (BasicConstraints); the leaf key must be ECDSA on
    ``leaf_curve``. Certificates given as DER are parsed strictly first (``parse_certificate``),
    so a malformed one is ``certificate_invalid``. Verified links and chains are cached (bounded,
    keyed by DER); validity is checked against ``now`` on every call.
    """

    def __init__(
        self,
        root: bytes | ParsedCertificate,
        *,
        links: LinkScheme,
        leaf_curve: type[ec.EllipticCurve],
        max_chain: int = MAX_CHAIN,
        max_cert_size: int = MAX_CERT_DER,
        allow_nonpositive_serial: bool = False,
        self_signed_root: bool = False,
        cache_size: int = 512,
    ) -> None:
        """``self_signed_root``: also check the root's own signature (once, here)."""
        if isinstance(root, ParsedCertificate):
            self._root = root
        else:
            self._root = parse_certificate(
                root, max_size=4 * max_cert_size, allow_nonpositive_serial=allow_nonpositive_serial
            )
        self._links_scheme = links
        self._leaf_curve = leaf_curve
        self._max_chain = max_chain
        self._max_size = max_cert_size
        self._allow_nonpositive_serial = allow_nonpositive_serial
        self._links: Lru[tuple[bytes, bytes], bool] = Lru(cache_size)
        self._parsed: Lru[bytes, ParsedCertificate] = Lru(cache_size)
        self._chains: Lru[tuple[bytes, ...], VerifiedChain] = Lru(cache_size)
        if self_signed_root:
            links.check(self._root, self._root)

    @property
    def root(self) -> ParsedCertificate:
        return self._root

    @property
    def root_der(self) -> bytes:
        return self._root.der

    def parse(self, der: bytes) -> ParsedCertificate:
        """One chain certificate (DER only), parsed strictly; cached by its bytes."""
        cached = self._parsed.get(der)
        if cached is not None:
            return cached
        if der.lstrip()[:10] == b"-----BEGIN":
            raise EvidenceFormatError("certificate_invalid", "chain certificates must be DER")
        cert = parse_certificate(
            der, max_size=self._max_size, allow_nonpositive_serial=self._allow_nonpositive_serial
        )
        self._parsed.put(der, cert)
        return cert

    def _check_link(self, child: ParsedCertificate, parent: ParsedCertificate) -> None:
        if self._links.get((child.der, parent.der)) is not None:
            return
        constraints = parent.basic_constraints()
        if constraints is None or not constraints.ca:
            raise EvidenceVerificationError("chain_invalid", f"{parent.subject_text} is not a CA")
        self._links_scheme.check(child, parent)
        self._links.put((child.der, parent.der), True)

    def _path(self, chain: Sequence[bytes | ParsedCertificate]) -> list[ParsedCertificate]:
        """Parse ``chain`` (a trailing copy of the root dropped) and verify every link."""
        if not 0 < len(chain) <= self._max_chain:
            raise EvidenceFormatError("certificate_invalid", f"chain has {len(chain)} certificates")
        root_der = self._root.der
        items = list(chain)
        if len(items) > 1 and _der_of(items[-1]) == root_der:
            items.pop()
        certs = [self.parse(c) if isinstance(c, bytes) else c for c in items]
        top = certs[-1]
        if top.der == root_der:
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
        return certs

    def verify_issuers(self, chain: Sequence[bytes | ParsedCertificate]) -> None:
        """Verify CA certificates (leaf-first, e.g. a pinned intermediate) to the root: the links
        only, no signing key, no time; verified links are cached for later ``verify`` calls."""
        self._path(chain)

    def verify_links(self, chain: Sequence[bytes | ParsedCertificate]) -> VerifiedChain:
        """Verify leaf-first ``chain`` (DER, or certificates already parsed strictly) to the
        pinned root, without the validity check."""
        key = tuple(_der_of(c) for c in chain)
        cached = self._chains.get(key)
        if cached is not None:
            return cached
        certs = self._path(chain)
        leaf_key = certs[0].public_key
        if not isinstance(leaf_key, ec.EllipticCurvePublicKey) or not isinstance(
            leaf_key.curve, self._leaf_curve
        ):
            raise EvidenceVerificationError(
                "chain_invalid", f"{certs[0].subject_text}: key is not {self._leaf_curve.name}"
            )
        verified = VerifiedChain(
            certs=tuple(certs),
            root=self._root,
            leaf_key=leaf_key,
            window=Window.intersection(Window.of(c) for c in [*certs, self._root]),
        )
        self._chains.put(key, verified)
        return verified

    def verify(self, chain: Sequence[bytes | ParsedCertificate], now: datetime) -> VerifiedChain:
        """Verify leaf-first ``chain`` to the pinned root, valid at ``now``."""
        verified = self.verify_links(chain)
        verified.check_time(now)
        return verified
