"""A mesh leaf's DER, assembled from pieces. Pure: no keys, clocks or randomness here.

``x509.CertificateBuilder`` re-validates and re-encodes every field and extension of every
certificate (125-270 us per leaf, several times the ECDSA signature it wraps). Most of a mesh
leaf is the same for every leaf an intermediate signs: the issuer's Name, the algorithm
identifiers, the constraints, key usages and the authority key identifier. ``tbs_certificate``
writes the TBSCertificate (RFC 5280 §4.1) from those bytes, precomputed once per issuer
(``certs.ca.templates.Issuer``), and the per-certificate fields (serial, validity, subject,
subjectPublicKeyInfo, SAN, subject key identifier, the claims and CMW extensions) encoded in
place; ``certificate`` appends the signature algorithm and the signature. What comes out is
byte for byte what the builder makes from the same inputs (a property test compares them).
"""

from __future__ import annotations

import binascii
import functools
import hashlib
from collections.abc import Iterable
from datetime import UTC, datetime

# AlgorithmIdentifier ecdsa-with-SHA256 (RFC 5758 §3.2: the parameters are absent)
ECDSA_WITH_SHA256 = bytes.fromhex("300a06082a8648ce3d040302")
_VERSION_3 = bytes.fromhex("a003020102")  # [0] EXPLICIT INTEGER 2
_VERSION_2 = bytes.fromhex("020101")  # a CRL's INTEGER 1 (v2)
_TRUE = bytes.fromhex("0101ff")
MAX_SERIAL_BITS = 159  # what the builder accepts (RFC 5280 §4.1.2.2: at most 20 octets)


def length(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes((0x80 | len(raw),)) + raw


def tlv(tag: int, content: bytes) -> bytes:
    return bytes((tag,)) + length(len(content)) + content


def sequence(*parts: bytes) -> bytes:
    return tlv(0x30, b"".join(parts))


def integer(n: int) -> bytes:
    """A non-negative INTEGER, minimal (a leading zero octet when the high bit is set)."""
    if n < 0:
        raise ValueError("only non-negative integers")
    return tlv(0x02, n.to_bytes(n.bit_length() // 8 + 1, "big"))


def oid(dotted: str) -> bytes:
    arcs = [int(a) for a in dotted.split(".")]
    if len(arcs) < 2 or arcs[0] > 2 or (arcs[0] < 2 and arcs[1] >= 40):
        raise ValueError(f"not an object identifier: {dotted}")
    out = bytearray()
    for arc in [40 * arcs[0] + arcs[1], *arcs[2:]]:
        chunk = [arc & 0x7F]
        arc >>= 7
        while arc:
            chunk.append(0x80 | (arc & 0x7F))
            arc >>= 7
        out += bytes(reversed(chunk))
    return tlv(0x06, bytes(out))


def extension(oid_der: bytes, value: bytes, *, critical: bool) -> bytes:
    """An Extension: its OID's DER, criticality (DEFAULT FALSE: absent when false), and
    ``value`` (the extnValue's content: the DER of the extension's own type)."""
    return sequence(oid_der, _TRUE if critical else b"", tlv(0x04, value))


def time(at: datetime) -> bytes:
    """RFC 5280 §4.1.2.5: UTCTime through 2049, GeneralizedTime from 2050; whole seconds
    (fractions dropped, as the builder drops them); a naive datetime is UTC."""
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    if at.year < 1950:
        raise ValueError("a certificate time must be on or after 1950-01-01")
    if at.year < 2050:
        return tlv(0x17, at.strftime("%y%m%d%H%M%SZ").encode("ascii"))
    return tlv(0x18, f"{at.year:04d}{at.strftime('%m%d%H%M%S')}Z".encode("ascii"))


def _read(der: bytes, offset: int) -> tuple[int, int, int]:
    """(tag, start of content, end of content) of the TLV at ``offset``."""
    tag, first = der[offset], der[offset + 1]
    start = offset + 2
    if first < 0x80:
        return tag, start, start + first
    count = first & 0x7F
    n = int.from_bytes(der[start : start + count], "big")
    return tag, start + count, start + count + n


def subject_public_key(spki: bytes) -> bytes:
    """The subjectPublicKey BIT STRING's bits (for an EC key: the X9.62 point) of a DER
    SubjectPublicKeyInfo."""
    tag, start, end = _read(spki, 0)
    if tag != 0x30 or end != len(spki):
        raise ValueError("not a DER SubjectPublicKeyInfo")
    _, _, after_algorithm = _read(spki, start)
    tag, bits, bits_end = _read(spki, after_algorithm)
    if tag != 0x03 or bits_end != end or spki[bits] != 0:
        raise ValueError("not a DER SubjectPublicKeyInfo")
    return spki[bits + 1 : bits_end]


def key_identifier(spki: bytes) -> bytes:
    """RFC 5280 §4.2.1.2 method 1 (what ``SubjectKeyIdentifier.from_public_key`` computes):
    SHA-1 of the subjectPublicKey bits."""
    return hashlib.sha1(subject_public_key(spki), usedforsecurity=False).digest()


def _serial(serial: int) -> bytes:
    if serial <= 0 or serial.bit_length() > MAX_SERIAL_BITS:
        raise ValueError(f"a serial number is positive and at most {MAX_SERIAL_BITS} bits")
    return integer(serial)


def tbs_certificate(
    *,
    serial: int,
    issuer_name: bytes,
    not_before: datetime,
    not_after: datetime,
    subject_name: bytes,
    spki: bytes,
    extensions: Iterable[bytes],
) -> bytes:
    """The TBSCertificate (v3, ecdsa-with-SHA256) from DER pieces: the Names, the
    SubjectPublicKeyInfo and each Extension as DER."""
    if not_after < not_before:
        raise ValueError("notAfter is before notBefore")
    return sequence(
        _VERSION_3,
        _serial(serial),
        ECDSA_WITH_SHA256,
        issuer_name,
        sequence(time(not_before), time(not_after)),
        subject_name,
        spki,
        tlv(0xA3, sequence(*extensions)),
    )


@functools.lru_cache(maxsize=1 << 15)
def _revoked_entry(serial: int, at: datetime) -> bytes:
    """One revokedCertificates entry. A revocation stays listed, unchanged, in every CRL until
    its certificate expires: each CRL re-signed after it re-uses its DER (a pure function of
    its arguments; bounded)."""
    return sequence(_serial(serial), time(at))


def tbs_cert_list(
    *,
    issuer_name: bytes,
    this_update: datetime,
    next_update: datetime,
    revoked: Iterable[tuple[int, datetime]],
    extensions: Iterable[bytes],
) -> bytes:
    """A v2 TBSCertList (RFC 5280 §5.1, ecdsa-with-SHA256): each revoked (serial, date) in the
    given order, without entry extensions; no revokedCertificates when there are none."""
    entries = b"".join([_revoked_entry(serial, at) for serial, at in revoked])
    return sequence(
        _VERSION_2,
        ECDSA_WITH_SHA256,
        issuer_name,
        time(this_update),
        time(next_update),
        tlv(0x30, entries) if entries else b"",
        tlv(0xA0, sequence(*extensions)),
    )


def certificate(tbs: bytes, signature: bytes) -> bytes:
    """The Certificate (or CertificateList): ``tbs``, ecdsa-with-SHA256 and ``signature`` (the
    DER ECDSA-Sig-Value the signer made over ``tbs``) as a BIT STRING."""
    return sequence(tbs, ECDSA_WITH_SHA256, tlv(0x03, b"\x00" + signature))


def certificate_pem(der: bytes, label: bytes = b"CERTIFICATE") -> bytes:
    """PEM of a DER certificate (or of another ``label``: ``X509 CRL``) (RFC 7468: 64-column
    base64 lines, each of 48 bytes), as ``public_bytes`` writes it."""
    lines = b"".join([binascii.b2a_base64(der[i : i + 48]) for i in range(0, len(der), 48)])
    return b"-----BEGIN " + label + b"-----\n" + lines + b"-----END " + label + b"-----\n"


__all__ = [
    "ECDSA_WITH_SHA256",
    "certificate",
    "certificate_pem",
    "extension",
    "integer",
    "key_identifier",
    "length",
    "oid",
    "sequence",
    "subject_public_key",
    "tbs_cert_list",
    "tbs_certificate",
    "time",
    "tlv",
]
