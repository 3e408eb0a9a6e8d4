"""THE one function that binds a workload key to attestation evidence.

``report_data = SHA-512(DOMAIN || nonce || SHA-256(SPKI DER))`` — 64 bytes, placed in the TEE's
report-data field by the agent and recomputed by the control plane.
"""

from __future__ import annotations

import hashlib
import hmac

DOMAIN = b"attestmesh/v1/key-binding\x00"
NONCE_LEN = 32


def expected_report_data(nonce: bytes, spki_der: bytes) -> bytes:
    if len(nonce) != NONCE_LEN:
        raise ValueError(f"nonce must be {NONCE_LEN} bytes, got {len(nonce)}")
    if not spki_der:
        raise ValueError("public key must not be empty")
    return hashlib.sha512(DOMAIN + nonce + hashlib.sha256(spki_der).digest()).digest()


def binding_matches(report_data: bytes, nonce: bytes, spki_der: bytes) -> bool:
    """Constant-time comparison of the first 64 bytes of the evidence's report data."""
    return hmac.compare_digest(report_data[:64], expected_report_data(nonce, spki_der))
