"""The claims a leaf carries: the claims extension codec and the claims class. Pure.

The extension (``CLAIMS_OID``, non-critical) is a DER UTF8String of canonical JSON of the
appraised claims; the class (``claims-`` + 48 hex digits) names equal claims alike and goes in the
leaf's Subject, so a ``whenClaims`` mesh rule holds per certificate (``xds.meshpolicy`` computes
the same class from the claims on record).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import datetime

from cryptography import x509

from certs.evidence.claims import Claims

# 2.25.<uuid as integer> — an arc of the project's own (ITU-T X.667), fixed forever.
CLAIMS_OID = x509.ObjectIdentifier("2.25.191056338567094339622416036213146734331")
# A leaf's Subject names the class of its admitted claims (see ``claims_class``).
CLAIMS_CLASS_ORG = "attestmesh"
CLAIMS_CLASS_PREFIX = "claims-"
CLAIMS_CLASS_PATTERN = re.compile(r"claims-[0-9a-f]{48}")


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


__all__ = [
    "CLAIMS_CLASS_ORG",
    "CLAIMS_CLASS_PATTERN",
    "CLAIMS_CLASS_PREFIX",
    "CLAIMS_OID",
    "claims_class",
    "decode_claims_extension",
    "encode_claims_extension",
]
