"""The simulated TEE: evidence signed by a configured simulated platform key.

For local runs and tests only. It is its own verifier, registered only when a platform key is
configured, and accepted only by a policy whose ``allowedTees`` names ``sim`` explicitly;
nothing ever falls back to it.

Wire format (big-endian)::

    b"AMSIM1" | u16 body length | body (canonical JSON) | 64-byte ECDSA P-256 r||s over
    SHA-256 of everything before it

Body fields: ``measurement`` (hex, 48 bytes), ``report_data`` (hex, 64 bytes), ``debug``
(bool), ``platform`` (str, at most 64 chars), ``svn`` (int).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import (
    decode_dss_signature,
    encode_dss_signature,
)

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Collateral, Tee, evidence_digest

MAGIC = b"AMSIM1"
MAX_BODY = 4096
SIG_LEN = 64
_FIELDS = {"measurement": str, "report_data": str, "debug": bool, "platform": str, "svn": int}


@dataclass(frozen=True, slots=True)
class SimReport:
    measurement: bytes
    report_data: bytes
    debug: bool
    platform: str
    svn: int
    signed: bytes
    signature: bytes


def looks_like(evidence: bytes) -> bool:
    return evidence.startswith(MAGIC)


def _body(report_data: bytes, measurement: bytes, debug: bool, platform: str, svn: int) -> bytes:
    return json.dumps(
        {
            "debug": debug,
            "measurement": measurement.hex(),
            "platform": platform,
            "report_data": report_data.hex(),
            "svn": svn,
        },
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def build_report(
    key: ec.EllipticCurvePrivateKey,
    *,
    report_data: bytes,
    measurement: bytes,
    debug: bool = False,
    platform: str = "sim-platform",
    svn: int = 1,
) -> bytes:
    """What the simulated hardware does: sign a report binding ``report_data``."""
    if len(report_data) != 64 or len(measurement) != 48:
        raise ValueError("report_data must be 64 bytes and measurement 48 bytes")
    body = _body(report_data, measurement, debug, platform, svn)
    signed = MAGIC + struct.pack(">H", len(body)) + body
    der = key.sign(signed, ec.ECDSA(hashes.SHA256()))
    r, s = decode_dss_signature(der)
    return signed + r.to_bytes(32, "big") + s.to_bytes(32, "big")


def parse_report(evidence: bytes) -> SimReport:
    if not evidence.startswith(MAGIC):
        raise EvidenceFormatError("bad_magic", "not a simulated TEE report")
    if len(evidence) < len(MAGIC) + 2:
        raise EvidenceFormatError("truncated", "missing body length")
    (length,) = struct.unpack_from(">H", evidence, len(MAGIC))
    if length > MAX_BODY:
        raise EvidenceFormatError("too_large", f"body of {length} bytes")
    end = len(MAGIC) + 2 + length
    if len(evidence) != end + SIG_LEN:
        raise EvidenceFormatError(
            "truncated", f"expected {end + SIG_LEN} bytes, got {len(evidence)}"
        )
    try:
        body = json.loads(evidence[len(MAGIC) + 2 : end].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting: RecursionError
        raise EvidenceFormatError("body_invalid", "body is not JSON") from None
    if not isinstance(body, dict) or set(body) != set(_FIELDS):
        raise EvidenceFormatError("body_invalid", f"body must have exactly {sorted(_FIELDS)}")
    for name, kind in _FIELDS.items():
        value = body[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise EvidenceFormatError("field_type", f"{name} must be {kind.__name__}")
    try:
        measurement = bytes.fromhex(body["measurement"])
        report_data = bytes.fromhex(body["report_data"])
    except ValueError:
        raise EvidenceFormatError("field_type", "measurement/report_data must be hex") from None
    if len(measurement) != 48 or len(report_data) != 64 or len(body["platform"]) > 64:
        raise EvidenceFormatError("field_length", "measurement 48, report_data 64, platform <= 64")
    if not 0 <= body["svn"] < 2**32:
        raise EvidenceFormatError("field_range", "svn out of range")
    return SimReport(
        measurement=measurement,
        report_data=report_data,
        debug=body["debug"],
        platform=body["platform"],
        svn=body["svn"],
        signed=evidence[:end],
        signature=evidence[end:],
    )


class SimVerifier:
    """Verifies simulated reports against the configured platform public keys."""

    def __init__(self, platform_keys: Sequence[ec.EllipticCurvePublicKey]) -> None:
        if not platform_keys:
            raise ValueError("the sim verifier needs at least one platform key")
        self._keys = tuple(platform_keys)

    @property
    def tee(self) -> Tee:
        return Tee.SIM

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        report = parse_report(evidence)
        der = encode_dss_signature(
            int.from_bytes(report.signature[:32], "big"),
            int.from_bytes(report.signature[32:], "big"),
        )
        for key in self._keys:
            try:
                key.verify(der, report.signed, ec.ECDSA(hashes.SHA256()))
                break
            except InvalidSignature:
                continue
        else:
            raise EvidenceVerificationError(
                "signature_invalid", "not signed by a configured simulated platform key"
            )
        return Claims(
            tee=Tee.SIM,
            measurements={"measurement": report.measurement.hex()},
            report_data=report.report_data,
            debug=report.debug,
            evidence_sha256=evidence_digest(evidence),
            svn=report.svn,
            platform_id=report.platform,
            details={"platform": report.platform},
        )


def load_platform_public_key(pem: bytes) -> ec.EllipticCurvePublicKey:
    key = serialization.load_pem_public_key(pem)
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise ValueError("the simulated platform key must be an EC public key")
    return key
