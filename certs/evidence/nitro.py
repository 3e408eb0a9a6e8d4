"""AWS Nitro Enclaves attestation documents: strict COSE_Sign1 parser and ES384 verifier.

A document is a COSE_Sign1 (RFC 9052), untagged or with tag 18: ``[protected, unprotected,
payload, signature]``. The protected header must say ES384 (``{1: -35}``); the signature is raw
``r||s`` (96 bytes) over ``cbor(["Signature1", protected, b"", payload])`` with SHA-384 by the
key of ``payload.certificate``, whose chain is ``payload.cabundle`` (root first) up to the pinned
AWS Nitro Enclaves root.

Claims: ``measurements`` are ``pcr<i>`` (lowercase hex) for every PCR in the document;
``report_data`` is ``user_data`` (``b""`` when absent); ``debug`` is true when PCR0, PCR1 and PCR2
are all zero (what a debug-mode enclave reports); ``platform_id`` is ``module_id``. ``details``:
``timestamp_ms``, ``digest``, ``nonce`` (hex, ``""`` when absent), ``nonce_len``, ``public_key``
(hex), ``public_key_len``, ``user_data_len``.

This verifier takes no collateral. Format reasons: ``too_large``, ``cbor_invalid``,
``truncated``, ``trailing_data``, ``cose_invalid``, ``algorithm_unsupported``,
``field_missing``, ``field_type``, ``field_value``, ``field_unknown``, ``certificate_invalid``.
Verification reasons: ``signature_invalid`` and those of ``certs.evidence.x509chain``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import cbor2
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Collateral, Tee, evidence_digest
from certs.evidence.x509chain import (
    MAX_CERT_DER,
    MAX_CHAIN,
    ChainVerifier,
    EcdsaLinks,
    verify_raw_ecdsa,
)

MAX_DOCUMENT = 32 * 1024
MAX_OPTIONAL_FIELD = 1024  # NSM limit for user_data, nonce and public_key
MAX_PCRS = 32
PCR_LENGTHS = frozenset({32, 48, 64})
SIGNATURE_LEN = 96
COSE_TAG = 18
COSE_ALG_ES384 = -35
COSE_HEADER_ALG = 1
_DEBUG_PCRS = (0, 1, 2)
_REQUIRED = ("module_id", "digest", "timestamp", "pcrs", "certificate", "cabundle")
_OPTIONAL = ("public_key", "user_data", "nonce")


@dataclass(frozen=True, slots=True)
class NitroDocument:
    """A parsed (not yet verified) Nitro attestation document."""

    protected: bytes
    payload: bytes
    signature: bytes
    module_id: str
    digest: str
    timestamp_ms: int
    pcrs: Mapping[int, bytes]
    certificate: bytes
    cabundle: tuple[bytes, ...]
    public_key: bytes | None
    user_data: bytes | None
    nonce: bytes | None

    def signed_bytes(self) -> bytes:
        """The COSE ``Sig_structure`` the signature covers."""
        return sig_structure(self.protected, self.payload)

    def chain(self) -> tuple[bytes, ...]:
        """Leaf-first chain: the certificate, then the CA bundle from the instance up to root."""
        return (self.certificate, *reversed(self.cabundle))


def sig_structure(protected: bytes, payload: bytes) -> bytes:
    return bytes(cbor2.dumps(["Signature1", protected, b"", payload]))


def _decode(data: bytes, what: str, *, max_depth: int) -> Any:
    fp = io.BytesIO(data)
    try:
        value = cbor2.CBORDecoder(
            fp, max_depth=max_depth, allow_indefinite=False, allow_duplicate_keys=False
        ).decode()
    except cbor2.CBORDecodeEOF:
        raise EvidenceFormatError("truncated", f"{what} ends early") from None
    except Exception as exc:  # cbor2 may raise several foreign types; translate them all
        raise EvidenceFormatError("cbor_invalid", f"{what}: {type(exc).__name__}") from None
    if fp.tell() != len(data):
        raise EvidenceFormatError(
            "trailing_data", f"{what}: {len(data) - fp.tell()} bytes after the item"
        )
    return value


def _optional_bytes(payload: Mapping[Any, Any], key: str) -> bytes | None:
    value = payload.get(key)
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise EvidenceFormatError("field_type", f"{key} must be a byte string or null")
    if len(value) > MAX_OPTIONAL_FIELD:
        raise EvidenceFormatError("field_value", f"{key} has length {len(value)}")
    return value


def _parse_payload(payload: bytes) -> dict[str, Any]:
    doc = _decode(payload, "payload", max_depth=4)
    if not isinstance(doc, dict):
        raise EvidenceFormatError("field_type", "payload must be a map")
    for key in doc:
        if not isinstance(key, str) or key not in _REQUIRED + _OPTIONAL:
            raise EvidenceFormatError("field_unknown", f"payload key {str(key)[:40]!r}")
    for key in _REQUIRED:
        if key not in doc:
            raise EvidenceFormatError("field_missing", key)
    return doc


def parse_attestation_document(evidence: bytes) -> NitroDocument:
    """Parse a Nitro attestation document (binary CBOR). Raises only EvidenceFormatError."""
    if not isinstance(evidence, bytes | bytearray | memoryview):
        raise EvidenceFormatError("field_type", "evidence must be bytes")
    evidence = bytes(evidence)
    if len(evidence) > MAX_DOCUMENT:
        raise EvidenceFormatError("too_large", f"{len(evidence)} > {MAX_DOCUMENT} bytes")
    if not evidence:
        raise EvidenceFormatError("truncated", "empty evidence")
    outer = _decode(evidence, "COSE_Sign1", max_depth=3)
    if isinstance(outer, cbor2.CBORTag):
        if outer.tag != COSE_TAG:
            raise EvidenceFormatError("cose_invalid", f"unexpected CBOR tag {outer.tag}")
        outer = outer.value  # cbor2 hands tagged arrays over as tuples
    if not isinstance(outer, list | tuple) or len(outer) != 4:
        raise EvidenceFormatError("cose_invalid", "COSE_Sign1 must be an array of 4")
    protected, unprotected, payload, signature = outer
    if not isinstance(protected, bytes) or not isinstance(payload, bytes):
        raise EvidenceFormatError("cose_invalid", "protected header and payload must be bytes")
    if not isinstance(unprotected, Mapping) or not isinstance(signature, bytes):
        raise EvidenceFormatError("cose_invalid", "unprotected must be a map, signature bytes")
    header = _decode(protected, "protected header", max_depth=2) if protected else {}
    if not isinstance(header, dict):
        raise EvidenceFormatError("cose_invalid", "protected header must be a map")
    if header.get(COSE_HEADER_ALG) != COSE_ALG_ES384 or unprotected.get(COSE_HEADER_ALG) not in (
        None,
        COSE_ALG_ES384,
    ):
        raise EvidenceFormatError("algorithm_unsupported", "only ES384 (-35) is accepted")
    if len(signature) != SIGNATURE_LEN:
        raise EvidenceFormatError("field_value", f"signature has {len(signature)} bytes")

    doc = _parse_payload(payload)
    module_id = doc["module_id"]
    if not isinstance(module_id, str):
        raise EvidenceFormatError("field_type", "module_id must be text")
    if not 0 < len(module_id) <= 256:
        raise EvidenceFormatError("field_value", "module_id length")
    digest = doc["digest"]
    if not isinstance(digest, str):
        raise EvidenceFormatError("field_type", "digest must be text")
    if digest != "SHA384":
        raise EvidenceFormatError("field_value", f"digest {digest[:16]!r} is not SHA384")
    timestamp = doc["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, int):
        raise EvidenceFormatError("field_type", "timestamp must be an integer")
    if not 0 < timestamp < 2**64:
        raise EvidenceFormatError("field_value", "timestamp out of range")
    raw_pcrs = doc["pcrs"]
    if not isinstance(raw_pcrs, dict):
        raise EvidenceFormatError("field_type", "pcrs must be a map")
    if not 0 < len(raw_pcrs) <= MAX_PCRS:
        raise EvidenceFormatError("field_value", f"{len(raw_pcrs)} PCRs")
    pcrs: dict[int, bytes] = {}
    for index, value in raw_pcrs.items():
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(value, bytes):
            raise EvidenceFormatError("field_type", "pcrs must map integers to byte strings")
        if not 0 <= index < MAX_PCRS or len(value) not in PCR_LENGTHS:
            raise EvidenceFormatError("field_value", f"pcr{index} ({len(value)} bytes)")
        pcrs[index] = value
    certificate = doc["certificate"]
    if not isinstance(certificate, bytes):
        raise EvidenceFormatError("field_type", "certificate must be a byte string")
    if not 0 < len(certificate) <= MAX_CERT_DER:
        raise EvidenceFormatError("field_value", "certificate length")
    raw_bundle = doc["cabundle"]
    if not isinstance(raw_bundle, list):
        raise EvidenceFormatError("field_type", "cabundle must be an array")
    if not 0 < len(raw_bundle) < MAX_CHAIN:
        raise EvidenceFormatError("field_value", f"cabundle has {len(raw_bundle)} entries")
    bundle: list[bytes] = []
    for cert in raw_bundle:
        if not isinstance(cert, bytes):
            raise EvidenceFormatError("field_type", "cabundle entries must be byte strings")
        if not 0 < len(cert) <= MAX_CERT_DER:
            raise EvidenceFormatError("field_value", "cabundle entry length")
        bundle.append(cert)
    return NitroDocument(
        protected=protected,
        payload=payload,
        signature=signature,
        module_id=module_id,
        digest=digest,
        timestamp_ms=timestamp,
        pcrs=dict(sorted(pcrs.items())),
        certificate=certificate,
        cabundle=tuple(bundle),
        public_key=_optional_bytes(doc, "public_key"),
        user_data=_optional_bytes(doc, "user_data"),
        nonce=_optional_bytes(doc, "nonce"),
    )


def looks_like(evidence: bytes) -> bool:
    """Cheap sniff: a (tag-18 or untagged) CBOR array of 4 starting with a byte string."""
    head = evidence[:3]
    if head[:1] == b"\xd2":
        head = head[1:]
    return len(head) >= 2 and head[0] == 0x84 and 0x40 <= head[1] <= 0x5B


def verify_signature(doc: NitroDocument, key: ec.EllipticCurvePublicKey) -> None:
    if not verify_raw_ecdsa(key, doc.signature, doc.signed_bytes(), hashes.SHA384()):
        raise EvidenceVerificationError(
            "signature_invalid", "COSE_Sign1 ES384 signature does not verify"
        )


class NitroVerifier:
    """Verifies Nitro attestation documents to a pinned root (DER or PEM bytes)."""

    def __init__(self, root: bytes) -> None:
        self._chains = ChainVerifier(
            root, links=EcdsaLinks(ec.SECP384R1, hashes.SHA384), leaf_curve=ec.SECP384R1
        )

    @property
    def tee(self) -> Tee:
        return Tee.NITRO

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        doc = parse_attestation_document(evidence)
        chain = self._chains.verify(doc.chain(), now)
        verify_signature(doc, chain.leaf_key)
        return build_claims(doc, evidence_digest(bytes(evidence)))


def build_claims(doc: NitroDocument, digest: str) -> Claims:
    measurements = {f"pcr{i}": value.hex() for i, value in doc.pcrs.items()}
    debug = all(i in doc.pcrs and not any(doc.pcrs[i]) for i in _DEBUG_PCRS)
    return Claims(
        tee=Tee.NITRO,
        measurements=measurements,
        report_data=doc.user_data or b"",
        debug=debug,
        evidence_sha256=digest,
        platform_id=doc.module_id,
        details={
            "timestamp_ms": doc.timestamp_ms,
            "digest": doc.digest,
            "nonce": (doc.nonce or b"").hex(),
            "nonce_len": len(doc.nonce or b""),
            "public_key": (doc.public_key or b"").hex(),
            "public_key_len": len(doc.public_key or b""),
            "user_data_len": len(doc.user_data or b""),
        },
    )
