"""NVIDIA confidential GPU (Hopper H100) SPDM 1.1 measurement reports: parser and verifier.

Evidence is the SPDM GET_MEASUREMENTS request followed by the MEASUREMENTS response, as raw bytes
or as hex text (what the NVIDIA tools emit). Layout (all integers little-endian)::

    request:  11 e0 <param1: bit0 = signature requested> <param2: operation>
              <nonce: 32> <slot: 1>                                            (37 bytes)
    response: 11 60 <param1> <param2> <nblocks: 1> <record_len: 3>
              <DMTF measurement blocks: record_len> <responder nonce: 32>
              <opaque_len: 2> <opaque TLVs: u16 type, u16 len, value> <signature: 96>

A measurement block is ``index:1, spec:1, size:2`` then, for the DMTF specification,
``value_type:1, value_size:2, value``. The signature is ECDSA P-384/SHA-384, raw ``r||s``, over
request ‖ response up to the signature; it is located from the parsed lengths (some drivers
append bytes after it; at most ``MAX_TRAILING`` are tolerated and reported in ``details``).

The signing key is the leaf of the device certificate chain, collateral ``cert_chain`` (PEM,
leaf first) or a chain given to the constructor; the chain must lead to the pinned NVIDIA Device
Identity root. The leaf's TCG DICE TcbInfo extension (2.23.133.5.4.1) must carry the FWID that
the report's opaque data states (type 20): the extension is parsed as DER and one of its FWIDs
(``SEQUENCE { hashAlg OID, digest OCTET STRING }``, either in the TCG ``fwids [6]`` list or, as
NVIDIA's GH100 FMC leaves carry it, directly in the TcbInfo sequence) must be a SHA-384 digest
equal to the report's.

Claims: ``measurements`` ``measurement_<index>`` (hex of the DMTF value); ``report_data`` is the
32-byte request nonce; ``debug`` is always false (the report has no debug indicator);
``details``: ``driver_version``, ``vbios_version`` (hex), ``fwid``, ``chip_sku``, ``project``,
``project_sku``, ``opaque_data_version``, ``measurement_blocks``, ``responder_nonce``, ``slot``,
``trailing_bytes``.

Format reasons: ``too_large``, ``hex_invalid``, ``truncated``, ``spdm_invalid``,
``field_value``, ``certificate_invalid``. Verification reasons: ``collateral_missing``,
``signature_invalid``, ``fwid_mismatch`` and those of ``certs.evidence.x509chain``.
"""

from __future__ import annotations

import binascii
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Collateral, Detail, Tee, evidence_digest
from certs.evidence.x509chain import (
    ChainVerifier,
    EcdsaLinks,
    Lru,
    ParsedCertificate,
    der_items,
    der_single,
    load_pem_chain,
    verify_raw_ecdsa,
)

MAX_REPORT = 16 * 1024
MAX_TRAILING = 16
SPDM_VERSION_1_1 = 0x11
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
NONCE_LEN = 32
SIGNATURE_LEN = 96
DMTF_SPEC = 0x01
FWID_OID = x509.ObjectIdentifier("2.23.133.5.4.1")
SHA384_OID = bytes.fromhex("608648016503040202")  # 2.16.840.1.101.3.4.2.2, DER content
TAG_SEQUENCE, TAG_OID, TAG_OCTETS, TAG_FWIDS = 0x30, 0x06, 0x04, 0xA6
COLLATERAL_CERT_CHAIN = "cert_chain"

# Opaque-data TLV types stated in the vectors' documentation (others are kept, unnamed).
OPAQUE_DRIVER_VERSION = 3
OPAQUE_VBIOS_VERSION = 6
OPAQUE_CHIP_SKU = 15
OPAQUE_PROJECT = 17
OPAQUE_PROJECT_SKU = 18
OPAQUE_FWID = 20
OPAQUE_DATA_VERSION = 34


@dataclass(frozen=True, slots=True)
class MeasurementBlock:
    index: int
    value_type: int
    value: bytes


@dataclass(frozen=True, slots=True)
class SpdmReport:
    """A parsed (not yet verified) SPDM 1.1 GET_MEASUREMENTS exchange."""

    nonce: bytes
    slot: int
    measurements: tuple[MeasurementBlock, ...]
    responder_nonce: bytes
    opaque: Mapping[int, bytes]
    signed: bytes
    signature: bytes
    trailing: int

    def opaque_text(self, kind: int) -> str:
        value = self.opaque.get(kind, b"")
        return value.split(b"\x00", 1)[0].decode("ascii", "replace")


def _to_binary(evidence: bytes) -> bytes:
    if evidence[:2] == bytes((SPDM_VERSION_1_1, GET_MEASUREMENTS)):
        return evidence
    if len(evidence) > 2 * MAX_REPORT + 64:
        raise EvidenceFormatError("too_large", f"{len(evidence)} bytes of hex")
    try:
        return binascii.unhexlify(b"".join(evidence.split()))
    except (binascii.Error, ValueError) as exc:
        raise EvidenceFormatError("hex_invalid", str(exc)) from None


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise EvidenceFormatError("truncated", f"{what} at offset {self.pos} needs {n} bytes")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u16(self, what: str) -> int:
        value: int = struct.unpack("<H", self.take(2, what))[0]
        return value

    def u24(self, what: str) -> int:
        return int.from_bytes(self.take(3, what), "little")


_BLOCK_HEADER = struct.Struct("<BBHBH")  # index, spec, size, DMTF value type, DMTF value size


def _parse_blocks(record: bytes, count: int) -> tuple[MeasurementBlock, ...]:
    blocks: list[MeasurementBlock] = []
    seen: set[int] = set()
    pos, end = 0, len(record)
    for _ in range(count):
        if pos + 4 > end:
            raise EvidenceFormatError("truncated", f"measurement block header at {pos}")
        if pos + _BLOCK_HEADER.size > end:
            raise EvidenceFormatError("truncated", f"DMTF header at {pos}")
        index, spec, size, value_type, value_size = _BLOCK_HEADER.unpack_from(record, pos)
        if spec != DMTF_SPEC:
            raise EvidenceFormatError("spdm_invalid", f"block {index}: specification {spec}")
        if pos + 4 + size > end:
            raise EvidenceFormatError("truncated", f"block {index} needs {size} bytes")
        if value_size + 3 != size:
            raise EvidenceFormatError("spdm_invalid", f"block {index}: size mismatch")
        if index in seen:
            raise EvidenceFormatError("spdm_invalid", f"block {index} repeated")
        seen.add(index)
        start = pos + _BLOCK_HEADER.size
        blocks.append(MeasurementBlock(index, value_type, record[start : start + value_size]))
        pos += 4 + size
    if pos != end:
        raise EvidenceFormatError("spdm_invalid", "measurement record length mismatch")
    return tuple(blocks)


def _parse_opaque(data: bytes) -> dict[int, bytes]:
    r = _Reader(data)
    out: dict[int, bytes] = {}
    while r.pos < len(data):
        kind = r.u16("opaque type")
        value = r.take(r.u16("opaque length"), f"opaque type {kind}")
        if kind in out:
            raise EvidenceFormatError("spdm_invalid", f"opaque type {kind} repeated")
        out[kind] = value
    return out


def parse_measurement_report(evidence: bytes) -> SpdmReport:
    """Parse SPDM 1.1 GET_MEASUREMENTS request + response. Raises only EvidenceFormatError."""
    if not isinstance(evidence, bytes | bytearray | memoryview):
        raise EvidenceFormatError("field_value", "evidence must be bytes")
    data = _to_binary(bytes(evidence))
    if len(data) > MAX_REPORT:
        raise EvidenceFormatError("too_large", f"{len(data)} > {MAX_REPORT} bytes")
    r = _Reader(data)
    version, code, attributes, _operation = r.take(4, "request header")
    if version != SPDM_VERSION_1_1 or code != GET_MEASUREMENTS:
        raise EvidenceFormatError("spdm_invalid", "not an SPDM 1.1 GET_MEASUREMENTS request")
    if not attributes & 0x01:
        raise EvidenceFormatError("spdm_invalid", "request did not ask for a signature")
    nonce = r.take(NONCE_LEN, "request nonce")
    slot = r.u8("request slot")
    version, code, _param1, _param2 = r.take(4, "response header")
    if version != SPDM_VERSION_1_1 or code != MEASUREMENTS:
        raise EvidenceFormatError("spdm_invalid", "not an SPDM 1.1 MEASUREMENTS response")
    count = r.u8("number of blocks")
    record = r.take(r.u24("record length"), "measurement record")
    blocks = _parse_blocks(record, count)
    responder_nonce = r.take(NONCE_LEN, "responder nonce")
    opaque = _parse_opaque(r.take(r.u16("opaque length"), "opaque data"))
    signed_end = r.pos
    signature = r.take(SIGNATURE_LEN, "signature")
    trailing = len(data) - r.pos
    if trailing > MAX_TRAILING:
        raise EvidenceFormatError("spdm_invalid", f"{trailing} bytes after the signature")
    return SpdmReport(
        nonce=nonce,
        slot=slot,
        measurements=blocks,
        responder_nonce=responder_nonce,
        opaque=opaque,
        signed=data[:signed_end],
        signature=signature,
        trailing=trailing,
    )


def looks_like(evidence: bytes) -> bool:
    """Raw SPDM 1.1 GET_MEASUREMENTS, or its hex text."""
    return evidence[:2] == b"\x11\xe0" or evidence[:4].lower() == b"11e0"


def verify_signature(report: SpdmReport, key: ec.EllipticCurvePublicKey) -> None:
    if not verify_raw_ecdsa(key, report.signature, report.signed, hashes.SHA384()):
        raise EvidenceVerificationError(
            "signature_invalid", "SPDM measurement signature does not verify"
        )


def leaf_fwids(tcb_info: bytes) -> list[tuple[bytes, bytes]]:
    """The (hashAlg OID content, digest) FWIDs of a DER TcbInfo: those of its ``fwids [6]``
    list and those placed directly in the sequence. ValueError if it is not DER."""

    def fwid(content: bytes) -> tuple[bytes, bytes] | None:
        items = der_items(content)
        if [tag for tag, _ in items] == [TAG_OID, TAG_OCTETS]:
            return items[0][1], items[1][1]
        return None

    found: list[tuple[bytes, bytes]] = []
    for tag, content in der_items(der_single(tcb_info, TAG_SEQUENCE)):
        if tag == TAG_SEQUENCE:
            candidates = [content]
        elif tag == TAG_FWIDS:
            candidates = [c for t, c in der_items(content) if t == TAG_SEQUENCE]
        else:
            continue
        found += [f for f in map(fwid, candidates) if f is not None]
    return found


def verify_fwid(report: SpdmReport, leaf: ParsedCertificate) -> None:
    fwid = report.opaque.get(OPAQUE_FWID)
    if not fwid:
        raise EvidenceVerificationError("fwid_mismatch", "report carries no FWID")
    raw = leaf.raw_extension(FWID_OID)
    if raw is None:
        raise EvidenceVerificationError("fwid_mismatch", "leaf has no TCG DICE FWID")
    try:
        fwids = leaf_fwids(raw)
    except ValueError as exc:
        raise EvidenceVerificationError(
            "fwid_mismatch", f"leaf TCG DICE TcbInfo is not DER: {exc}"
        ) from None
    sha384 = [digest for alg, digest in fwids if alg == SHA384_OID]
    if not sha384:
        raise EvidenceVerificationError("fwid_mismatch", "leaf TcbInfo has no SHA-384 FWID")
    if fwid not in sha384:
        raise EvidenceVerificationError("fwid_mismatch", "leaf FWID differs from the report's")


class NvidiaGpuVerifier:
    """Verifies H100 SPDM reports to the pinned NVIDIA Device Identity root (DER or PEM)."""

    def __init__(self, root: bytes, *, cert_chain: bytes | None = None) -> None:
        self._chains = ChainVerifier(
            root, links=EcdsaLinks(ec.SECP384R1, hashes.SHA384), leaf_curve=ec.SECP384R1
        )
        self._default_chain = load_pem_chain(cert_chain) if cert_chain is not None else None
        self._pem_cache: Lru[bytes, tuple[bytes, ...]] = Lru(64)

    @property
    def tee(self) -> Tee:
        return Tee.NVIDIA_GPU

    def _chain(self, collateral: Collateral) -> tuple[bytes, ...]:
        pem = collateral.get(COLLATERAL_CERT_CHAIN)
        if pem is None:
            if self._default_chain is None:
                raise EvidenceVerificationError(
                    "collateral_missing", f"need collateral {COLLATERAL_CERT_CHAIN!r} (PEM)"
                )
            return self._default_chain
        return self._pem_cache.get_or(pem, lambda: load_pem_chain(pem))

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        report = parse_measurement_report(evidence)
        chain = self._chains.verify(self._chain(collateral), now)
        verify_signature(report, chain.leaf_key)
        verify_fwid(report, chain.leaf)
        return build_claims(report, evidence_digest(bytes(evidence)))


def build_claims(report: SpdmReport, digest: str) -> Claims:
    version = report.opaque.get(OPAQUE_DATA_VERSION)
    details: dict[str, Detail] = {
        "driver_version": report.opaque_text(OPAQUE_DRIVER_VERSION),
        "vbios_version": report.opaque.get(OPAQUE_VBIOS_VERSION, b"").hex(),
        "fwid": report.opaque.get(OPAQUE_FWID, b"").hex(),
        "chip_sku": report.opaque_text(OPAQUE_CHIP_SKU),
        "project": report.opaque_text(OPAQUE_PROJECT),
        "project_sku": report.opaque_text(OPAQUE_PROJECT_SKU),
        "opaque_data_version": int.from_bytes(version, "little") if version else 0,
        "measurement_blocks": len(report.measurements),
        "responder_nonce": report.responder_nonce.hex(),
        "slot": report.slot,
        "trailing_bytes": report.trailing,
    }
    return Claims(
        tee=Tee.NVIDIA_GPU,
        measurements={f"measurement_{b.index}": b.value.hex() for b in report.measurements},
        report_data=report.nonce,
        debug=False,
        evidence_sha256=digest,
        details=details,
    )
