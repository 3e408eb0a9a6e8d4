"""Intel DCAP (ECDSA quote v3/v4/v5) parsing and verification shared by TDX and SGX.

Layering:

* ``parse_quote`` (strict, bounded; raises only ``EvidenceFormatError``) turns quote bytes into a
  ``Quote``: header, SGX report body or TD report body (TDX 1.0 / 1.5), and the ECDSA signature
  data (attestation key, QE report + signature, QE auth data, PCK certificate chain).
* ``parse_collateral`` turns the named collateral blobs into a ``DcapCollateral``.
* ``DcapVerifier.verify_quote`` is pure: time is injected, the trusted root is a constructor
  argument. It verifies the PCK chain and CRLs, the QE report signature, the attestation key
  binding, the quote signature, the TCB info and QE identity signatures and times, and then
  evaluates the TCB status (platform level, TDX module, QE identity).

Collateral names (``Collateral`` mapping keys), all ``bytes``:

``collateral_json``
    dcap-qvl ``QuoteCollateralV3`` JSON: ``tcb_info`` / ``qe_identity`` (inner JSON strings),
    ``tcb_info_signature`` / ``qe_identity_signature`` (hex r||s), ``*_issuer_chain`` (PEM),
    ``pck_crl`` / ``root_ca_crl`` (hex DER).
``tcb_info``
    raw Intel PCS body ``{"tcbInfo": {...}, "signature": "<hex>"}``; the signature covers the
    exact bytes of the ``tcbInfo`` value.
``tcb_info_issuer_chain``
    PEM chain (TCB Signing cert, root), from the ``TCB-Info-Issuer-Chain`` header.
``qe_identity`` / ``qe_identity_issuer_chain``
    raw PCS body ``{"enclaveIdentity": {...}, "signature": "<hex>"}`` and its PEM chain.
``pck_crl`` / ``pck_crl_issuer_chain``
    PCK CRL (DER or PEM) and its PEM issuer chain.
``root_ca_crl``
    Intel SGX Root CA CRL (DER or PEM).

Separate names override the same part of ``collateral_json``.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import TcbStatus
from certs.evidence.x509chain import (
    Lru,
    ParsedCertificate,
    decode_strictly,
    parse_certificates,
)

# --------------------------------------------------------------------------------------------
# Wire constants
# --------------------------------------------------------------------------------------------

MAX_QUOTE_BYTES = 128 * 1024
"""Upper bound on quote size (a real quote with a PEM PCK chain is ~5 KiB)."""
MAX_TRAILING_BYTES = 4096
"""Bytes after the signature data are not signed; tolerated up to this bound (go-tdx-guest
and some TDX quote generators append padding)."""

HEADER_LEN = 48
SGX_REPORT_LEN = 384
TD10_REPORT_LEN = 584
TD15_REPORT_LEN = 648
ECDSA_SIG_LEN = 64
ATT_KEY_LEN = 64

ATT_KEY_TYPE_ECDSA_P256 = 2
TEE_TYPE_SGX = 0x00000000
TEE_TYPE_TDX = 0x00000081

BODY_TYPE_SGX = 1
BODY_TYPE_TD10 = 2
BODY_TYPE_TD15 = 3

CERT_DATA_PCK_CHAIN = 5
CERT_DATA_QE_REPORT = 6

INTEL_QE_VENDOR_ID = bytes.fromhex("939a7233f79c4ca9940a0db3957f0607")

SGX_ATTR_DEBUG = 0x02
TD_ATTR_DEBUG = 0x01

_SGX_EXT_OID = x509.ObjectIdentifier("1.2.840.113741.1.13.1")
_SGX_EXT_PREFIX = bytes.fromhex("2a864886f84d010d01")  # DER body of 1.2.840.113741.1.13.1


# --------------------------------------------------------------------------------------------
# Quote model and parser
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuoteHeader:
    version: int
    att_key_type: int
    tee_type: int
    qe_svn: int
    pce_svn: int
    qe_vendor_id: bytes
    user_data: bytes


@dataclass(frozen=True, slots=True)
class EnclaveReport:
    """An SGX report body (384 bytes): the application enclave's or the QE's."""

    cpu_svn: bytes
    misc_select: int
    isv_ext_prod_id: bytes
    attributes: bytes
    mr_enclave: bytes
    mr_signer: bytes
    config_id: bytes
    isv_prod_id: int
    isv_svn: int
    config_svn: int
    isv_family_id: bytes
    report_data: bytes

    @property
    def debug(self) -> bool:
        return bool(self.attributes[0] & SGX_ATTR_DEBUG)


@dataclass(frozen=True, slots=True)
class TdReport:
    """A TD report body: TDX 1.0 (584 bytes) or TDX 1.5 (648, adds tee_tcb_svn2, mr_servicetd)."""

    tee_tcb_svn: bytes
    mr_seam: bytes
    mr_signer_seam: bytes
    seam_attributes: bytes
    td_attributes: bytes
    xfam: bytes
    mr_td: bytes
    mr_config_id: bytes
    mr_owner: bytes
    mr_owner_config: bytes
    rtmrs: tuple[bytes, bytes, bytes, bytes]
    report_data: bytes
    tee_tcb_svn2: bytes | None = None
    mr_servicetd: bytes | None = None

    @property
    def debug(self) -> bool:
        return bool(self.td_attributes[0] & TD_ATTR_DEBUG)


@dataclass(frozen=True, slots=True)
class QuoteSignature:
    signature: bytes
    attestation_key: bytes
    qe_report_raw: bytes
    qe_report: EnclaveReport
    qe_report_signature: bytes
    qe_auth_data: bytes
    pck_chain_pem: bytes


@dataclass(frozen=True, slots=True)
class Quote:
    header: QuoteHeader
    body_type: int
    body: EnclaveReport | TdReport
    signed: bytes
    """The bytes the attestation key signs: header (+ v5 body descriptor) + body."""
    signature: QuoteSignature
    trailing: int = 0

    @property
    def is_tdx(self) -> bool:
        return self.header.tee_type == TEE_TYPE_TDX


class _Reader:
    """Bounded little-endian cursor; every short read is an EvidenceFormatError."""

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self._data = data
        self._pos = pos

    @property
    def pos(self) -> int:
        return self._pos

    def remaining(self) -> int:
        return len(self._data) - self._pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self._pos + n > len(self._data):
            raise EvidenceFormatError(
                "quote_truncated", f"{what}: need {n} bytes at {self._pos}, have {self.remaining()}"
            )
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def u16(self, what: str) -> int:
        return int.from_bytes(self.take(2, what), "little")

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")


def parse_header(data: bytes) -> QuoteHeader:
    if len(data) < HEADER_LEN:
        raise EvidenceFormatError("quote_truncated", f"header needs {HEADER_LEN} bytes")
    version, att_key_type, tee_type, qe_svn, pce_svn = struct.unpack_from("<HHIHH", data, 0)
    if version not in (3, 4, 5):
        raise EvidenceFormatError("quote_unsupported", f"quote version {version}")
    if att_key_type != ATT_KEY_TYPE_ECDSA_P256:
        raise EvidenceFormatError("quote_unsupported", f"attestation key type {att_key_type}")
    if tee_type not in (TEE_TYPE_SGX, TEE_TYPE_TDX):
        raise EvidenceFormatError("quote_unsupported", f"tee type {tee_type:#x}")
    if (version == 3) != (tee_type == TEE_TYPE_SGX):
        # Quote v3 is SGX only; SGX quotes are v3 only (as in dcap-qvl; Gramine emits v3).
        raise EvidenceFormatError("quote_unsupported", f"quote v{version} for tee {tee_type:#x}")
    return QuoteHeader(
        version=version,
        att_key_type=att_key_type,
        tee_type=tee_type,
        qe_svn=qe_svn,
        pce_svn=pce_svn,
        qe_vendor_id=data[12:28],
        user_data=data[28:48],
    )


def parse_enclave_report(raw: bytes) -> EnclaveReport:
    if len(raw) != SGX_REPORT_LEN:
        raise EvidenceFormatError("quote_truncated", f"SGX report body must be {SGX_REPORT_LEN}")
    misc_select = int.from_bytes(raw[16:20], "little")
    isv_prod_id, isv_svn, config_svn = struct.unpack_from("<HHH", raw, 256)
    return EnclaveReport(
        cpu_svn=raw[0:16],
        misc_select=misc_select,
        isv_ext_prod_id=raw[32:48],
        attributes=raw[48:64],
        mr_enclave=raw[64:96],
        mr_signer=raw[128:160],
        config_id=raw[192:256],
        isv_prod_id=isv_prod_id,
        isv_svn=isv_svn,
        config_svn=config_svn,
        isv_family_id=raw[304:320],
        report_data=raw[320:384],
    )


def parse_td_report(raw: bytes) -> TdReport:
    if len(raw) not in (TD10_REPORT_LEN, TD15_REPORT_LEN):
        raise EvidenceFormatError("quote_truncated", f"TD report body of {len(raw)} bytes")
    td15 = len(raw) == TD15_REPORT_LEN
    return TdReport(
        tee_tcb_svn=raw[0:16],
        mr_seam=raw[16:64],
        mr_signer_seam=raw[64:112],
        seam_attributes=raw[112:120],
        td_attributes=raw[120:128],
        xfam=raw[128:136],
        mr_td=raw[136:184],
        mr_config_id=raw[184:232],
        mr_owner=raw[232:280],
        mr_owner_config=raw[280:328],
        rtmrs=(raw[328:376], raw[376:424], raw[424:472], raw[472:520]),
        report_data=raw[520:584],
        tee_tcb_svn2=raw[584:600] if td15 else None,
        mr_servicetd=raw[600:648] if td15 else None,
    )


def _parse_qe_certification(r: _Reader, end: int) -> tuple[bytes, bytes, bytes, bytes]:
    """QE report ‖ QE report sig ‖ QE auth data ‖ cert data type 5; must end exactly at ``end``."""
    qe_report_raw = r.take(SGX_REPORT_LEN, "qe_report")
    qe_report_sig = r.take(ECDSA_SIG_LEN, "qe_report_signature")
    auth_len = r.u16("qe_auth_data_size")
    qe_auth_data = r.take(auth_len, "qe_auth_data")
    cert_type = r.u16("certification_data_type")
    cert_len = r.u32("certification_data_size")
    if cert_type != CERT_DATA_PCK_CHAIN:
        raise EvidenceFormatError(
            "quote_unsupported", f"certification data type {cert_type}, want PCK chain (5)"
        )
    pck = r.take(cert_len, "pck_chain")
    if r.pos != end:
        raise EvidenceFormatError("quote_malformed", "QE certification data size mismatch")
    return qe_report_raw, qe_report_sig, qe_auth_data, pck


def parse_quote(data: bytes) -> Quote:
    """Parse an Intel ECDSA-P256 quote (v3 SGX, v4 SGX/TDX 1.0, v5 SGX/TDX 1.0/1.5)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EvidenceFormatError("quote_malformed", "evidence must be bytes")
    data = bytes(data)
    if len(data) > MAX_QUOTE_BYTES:
        raise EvidenceFormatError("quote_too_large", f"{len(data)} bytes")
    header = parse_header(data)
    r = _Reader(data, HEADER_LEN)
    if header.version == 5:
        body_type = r.u16("body_type")
        body_size = r.u32("body_size")
        expected = {
            BODY_TYPE_SGX: SGX_REPORT_LEN,
            BODY_TYPE_TD10: TD10_REPORT_LEN,
            BODY_TYPE_TD15: TD15_REPORT_LEN,
        }.get(body_type)
        if expected is None:
            raise EvidenceFormatError("quote_unsupported", f"v5 body type {body_type}")
        if body_size != expected:
            raise EvidenceFormatError("quote_malformed", f"body type {body_type} size {body_size}")
        if (body_type == BODY_TYPE_SGX) != (header.tee_type == TEE_TYPE_SGX):
            raise EvidenceFormatError("quote_malformed", "body type does not match tee type")
    elif header.tee_type == TEE_TYPE_SGX:
        body_type, body_size = BODY_TYPE_SGX, SGX_REPORT_LEN
    else:
        body_type, body_size = BODY_TYPE_TD10, TD10_REPORT_LEN
    body_raw = r.take(body_size, "report_body")
    signed = data[: r.pos]
    body: EnclaveReport | TdReport = (
        parse_enclave_report(body_raw) if body_type == BODY_TYPE_SGX else parse_td_report(body_raw)
    )
    sig_len = r.u32("signature_data_size")
    sig_start = r.pos
    sig_end = sig_start + sig_len
    if sig_len > r.remaining():
        raise EvidenceFormatError("quote_truncated", "signature data shorter than declared")
    signature = r.take(ECDSA_SIG_LEN, "quote_signature")
    att_key = r.take(ATT_KEY_LEN, "attestation_key")
    if header.version == 3:
        qe_report_raw, qe_sig, auth, pck = _parse_qe_certification(r, sig_end)
    else:
        cert_type = r.u16("certification_data_type")
        cert_len = r.u32("certification_data_size")
        if cert_type != CERT_DATA_QE_REPORT:
            raise EvidenceFormatError(
                "quote_unsupported", f"certification data type {cert_type}, want QE report (6)"
            )
        if r.pos + cert_len != sig_end:
            raise EvidenceFormatError("quote_malformed", "certification data size mismatch")
        qe_report_raw, qe_sig, auth, pck = _parse_qe_certification(r, sig_end)
    trailing = len(data) - sig_end
    if trailing > MAX_TRAILING_BYTES:
        raise EvidenceFormatError("quote_malformed", f"{trailing} bytes after signature data")
    return Quote(
        header=header,
        body_type=body_type,
        body=body,
        signed=signed,
        signature=QuoteSignature(
            signature=signature,
            attestation_key=att_key,
            qe_report_raw=qe_report_raw,
            qe_report=parse_enclave_report(qe_report_raw),
            qe_report_signature=qe_sig,
            qe_auth_data=auth,
            pck_chain_pem=pck,
        ),
        trailing=trailing,
    )


def quote_tee_type(evidence: bytes) -> int | None:
    """Cheap sniff: the header's TEE type if ``evidence`` starts like an ECDSA DCAP quote."""
    if len(evidence) < HEADER_LEN + SGX_REPORT_LEN:
        return None
    version, att_key_type, tee_type = struct.unpack_from("<HHI", evidence, 0)
    if version not in (3, 4, 5) or att_key_type != ATT_KEY_TYPE_ECDSA_P256:
        return None
    if tee_type not in (TEE_TYPE_SGX, TEE_TYPE_TDX):
        return None
    if (version == 3) != (tee_type == TEE_TYPE_SGX):
        return None
    return int(tee_type)


# --------------------------------------------------------------------------------------------
# Minimal DER reader for the PCK certificate's SGX extension
# --------------------------------------------------------------------------------------------


def _der_items(data: bytes) -> list[tuple[int, bytes]]:
    """Split DER content into (tag, value) items; raises ValueError when malformed."""
    items: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        if pos + 2 > len(data):
            raise ValueError("short TLV")
        tag = data[pos]
        length = data[pos + 1]
        pos += 2
        if length & 0x80:
            n = length & 0x7F
            if n == 0 or n > 3 or pos + n > len(data):
                raise ValueError("bad length")
            length = int.from_bytes(data[pos : pos + n], "big")
            pos += n
        if pos + length > len(data):
            raise ValueError("value overruns")
        items.append((tag, data[pos : pos + length]))
        pos += length
    return items


def _der_single(data: bytes, tag: int) -> bytes:
    items = _der_items(data)
    if len(items) != 1 or items[0][0] != tag:
        raise ValueError("unexpected DER structure")
    return items[0][1]


def _der_uint(value: bytes) -> int:
    if not value or value[0] & 0x80:
        raise ValueError("not a non-negative integer")
    return int.from_bytes(value, "big")


@dataclass(frozen=True, slots=True)
class PckExtension:
    ppid: bytes
    cpu_svn_components: tuple[int, ...]
    pce_svn: int
    cpu_svn: bytes
    pce_id: bytes
    fmspc: bytes
    sgx_type: int | None


def parse_pck_extension(cert: x509.Certificate) -> PckExtension:
    """Read PPID, TCB (16 SGX components, PCESVN, CPUSVN), PCEID, FMSPC from OID ...13.1."""
    try:
        ext = cert.extensions.get_extension_for_oid(_SGX_EXT_OID)
    except x509.ExtensionNotFound as exc:
        raise EvidenceVerificationError("pck_extension_invalid", "no SGX extension") from exc
    raw = ext.value
    if not isinstance(raw, x509.UnrecognizedExtension):
        raise EvidenceVerificationError("pck_extension_invalid", "unexpected extension type")
    try:
        entries = _sgx_entries(_der_single(raw.value, 0x30))
        tcb_entries = _sgx_entries(entries[2][1])
        components = tuple(_der_uint(tcb_entries[i][1]) for i in range(1, 17) if tcb_entries.get(i))
        pce_svn = _der_uint(tcb_entries[17][1])
        cpu_svn = tcb_entries[18][1]
        ppid, pce_id, fmspc = entries[1][1], entries[3][1], entries[4][1]
        sgx_type = _der_uint(entries[5][1]) if 5 in entries else None
    except (ValueError, KeyError, IndexError) as exc:
        raise EvidenceVerificationError("pck_extension_invalid", str(exc)) from exc
    if len(components) != 16 or len(cpu_svn) != 16 or len(fmspc) != 6 or len(pce_id) != 2:
        raise EvidenceVerificationError("pck_extension_invalid", "wrong field sizes")
    return PckExtension(ppid, components, pce_svn, cpu_svn, pce_id, fmspc, sgx_type)


def _sgx_entries(seq_content: bytes) -> dict[int, tuple[int, bytes]]:
    """SEQUENCE OF SEQUENCE {OID, value} -> {last OID arc: (value tag, value)} for our arcs."""
    out: dict[int, tuple[int, bytes]] = {}
    for tag, content in _der_items(seq_content):
        if tag != 0x30:
            raise ValueError("entry is not a SEQUENCE")
        parts = _der_items(content)
        if len(parts) != 2 or parts[0][0] != 0x06:
            raise ValueError("entry is not {OID, value}")
        oid = parts[0][1]
        if not oid.startswith(_SGX_EXT_PREFIX) or len(oid) <= len(_SGX_EXT_PREFIX):
            raise ValueError("foreign OID in SGX extension")
        out[oid[-1]] = parts[1]
        if parts[1][0] == 0x30:
            out[oid[-1]] = (0x30, parts[1][1])
    return out


# --------------------------------------------------------------------------------------------
# Collateral model and parsers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignedDoc:
    """A signed collateral document: the exact signed bytes, raw r||s signature, issuer chain."""

    body: bytes
    signature: bytes
    issuer_chain_pem: bytes


@dataclass(frozen=True, slots=True)
class DcapCollateral:
    tcb_info: SignedDoc | None
    qe_identity: SignedDoc | None
    pck_crl: bytes | None
    pck_crl_issuer_chain: bytes | None
    root_ca_crl: bytes | None


def _collateral_error(detail: str) -> EvidenceVerificationError:
    return EvidenceVerificationError("collateral_invalid", detail)


def split_signed_response(raw: bytes, key: str) -> tuple[bytes, bytes]:
    """Split a PCS body ``{"<key>": {...}, "signature": "<hex>"}`` into (exact inner bytes, sig)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _collateral_error(f"{key}: not UTF-8") from exc
    decoder = json.JSONDecoder()
    spans: dict[str, tuple[int, int, Any]] = {}
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "{":
        raise _collateral_error(f"{key}: not a JSON object")
    pos = _skip_ws(text, pos + 1)
    try:
        while pos < len(text) and text[pos] != "}":
            name, pos = decoder.raw_decode(text, pos)
            pos = _skip_ws(text, pos)
            if not isinstance(name, str) or text[pos : pos + 1] != ":":
                raise ValueError("bad member")
            start = _skip_ws(text, pos + 1)
            value, end = decoder.raw_decode(text, start)
            spans[name] = (start, end, value)
            pos = _skip_ws(text, end)
            if text[pos : pos + 1] == ",":
                pos = _skip_ws(text, pos + 1)
            elif text[pos : pos + 1] != "}":
                raise ValueError("expected , or }")
    except ValueError as exc:
        raise _collateral_error(f"{key}: {exc}") from exc
    if key not in spans or "signature" not in spans:
        raise _collateral_error(f"missing {key!r} or 'signature'")
    start, end, _ = spans[key]
    sig = spans["signature"][2]
    if not isinstance(sig, str):
        raise _collateral_error(f"{key}: signature is not a string")
    return raw[len(text[:start].encode()) : len(text[:end].encode())], _unhex(sig, f"{key} sig")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _unhex(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise _collateral_error(f"{what}: not a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise _collateral_error(f"{what}: bad hex") from exc


def parse_collateral(collateral: Mapping[str, bytes]) -> DcapCollateral:
    """Normalise the documented collateral names into a ``DcapCollateral``."""
    parts: dict[str, Any] = {}
    if "collateral_json" in collateral:
        try:
            doc = json.loads(collateral["collateral_json"])
        except (ValueError, UnicodeDecodeError) as exc:
            raise _collateral_error("collateral_json is not JSON") from exc
        if not isinstance(doc, dict):
            raise _collateral_error("collateral_json is not an object")

        def text(name: str) -> bytes:
            value = doc.get(name)
            if not isinstance(value, str):
                raise _collateral_error(f"collateral_json.{name} missing or not a string")
            return value.encode()

        parts["tcb_info"] = SignedDoc(
            text("tcb_info"),
            _unhex(doc.get("tcb_info_signature"), "tcb_info_signature"),
            text("tcb_info_issuer_chain"),
        )
        parts["qe_identity"] = SignedDoc(
            text("qe_identity"),
            _unhex(doc.get("qe_identity_signature"), "qe_identity_signature"),
            text("qe_identity_issuer_chain"),
        )
        parts["pck_crl"] = _unhex(doc.get("pck_crl"), "pck_crl")
        parts["root_ca_crl"] = _unhex(doc.get("root_ca_crl"), "root_ca_crl")
        parts["pck_crl_issuer_chain"] = text("pck_crl_issuer_chain")
    for name, key in (("tcb_info", "tcbInfo"), ("qe_identity", "enclaveIdentity")):
        if name in collateral:
            chain = collateral.get(f"{name}_issuer_chain")
            if chain is None:
                raise EvidenceVerificationError("collateral_missing", f"{name}_issuer_chain")
            body, sig = split_signed_response(collateral[name], key)
            parts[name] = SignedDoc(body, sig, chain)
    for name in ("pck_crl", "pck_crl_issuer_chain", "root_ca_crl"):
        if name in collateral:
            parts[name] = collateral[name]
    return DcapCollateral(
        tcb_info=parts.get("tcb_info"),
        qe_identity=parts.get("qe_identity"),
        pck_crl=parts.get("pck_crl"),
        pck_crl_issuer_chain=parts.get("pck_crl_issuer_chain"),
        root_ca_crl=parts.get("root_ca_crl"),
    )


@dataclass(frozen=True, slots=True)
class TcbLevel:
    sgx_components: tuple[int, ...]
    pce_svn: int
    tdx_components: tuple[int, ...] | None
    status: str
    date: str
    advisories: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class IsvLevel:
    isv_svn: int
    status: str
    date: str
    advisories: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ModuleIdentity:
    id: str
    mrsigner: bytes
    attributes: bytes
    attributes_mask: bytes
    levels: tuple[IsvLevel, ...]


@dataclass(frozen=True, slots=True)
class TcbInfo:
    id: str
    version: int
    issue_date: datetime
    next_update: datetime
    fmspc: bytes
    pce_id: bytes
    eval_data_number: int
    levels: tuple[TcbLevel, ...]
    tdx_module: ModuleIdentity | None
    tdx_module_identities: tuple[ModuleIdentity, ...]


@dataclass(frozen=True, slots=True)
class EnclaveIdentity:
    id: str
    version: int
    issue_date: datetime
    next_update: datetime
    miscselect: int
    miscselect_mask: int
    attributes: bytes
    attributes_mask: bytes
    mrsigner: bytes
    isv_prod_id: int
    eval_data_number: int
    levels: tuple[IsvLevel, ...]


_T = TypeVar("_T")


def _get(obj: Mapping[str, Any], key: str, kind: type[_T], what: str) -> _T:
    value = obj.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _collateral_error(f"{what}.{key}: missing or not {kind.__name__}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _collateral_error(f"{key} is not an integer")
    return value


def _time(value: str, what: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise _collateral_error(f"{what}: bad time {value!r}") from exc
    if parsed.tzinfo is None:
        raise _collateral_error(f"{what}: time without zone")
    return parsed.astimezone(UTC)


def _hexfield(obj: Mapping[str, Any], key: str, size: int, what: str) -> bytes:
    out = _unhex(obj.get(key), f"{what}.{key}")
    if len(out) != size:
        raise _collateral_error(f"{what}.{key}: {len(out)} bytes, want {size}")
    return out


def _advisories(level: Mapping[str, Any]) -> tuple[str, ...]:
    ids = level.get("advisoryIDs", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise _collateral_error("advisoryIDs is not a list of strings")
    return tuple(ids)


_ISV_STATUSES = frozenset({TcbStatus.UP_TO_DATE, TcbStatus.OUT_OF_DATE, TcbStatus.REVOKED})
"""Enclave identity and TDX module levels use only these statuses."""
_PLATFORM_STATUSES = frozenset(TcbStatus)


def _isv_levels(levels: object, what: str) -> tuple[IsvLevel, ...]:
    if not isinstance(levels, list):
        raise _collateral_error(f"{what}.tcbLevels is not a list")
    out = []
    for level in levels:
        if not isinstance(level, dict):
            raise _collateral_error(f"{what}: tcb level is not an object")
        tcb = _get(level, "tcb", dict, what)
        if level.get("tcbStatus") not in _ISV_STATUSES:
            raise _collateral_error(f"{what}: TCB status {level.get('tcbStatus')!r}")
        out.append(
            IsvLevel(
                isv_svn=_get(tcb, "isvsvn", int, what),
                status=_get(level, "tcbStatus", str, what),
                date=_get(level, "tcbDate", str, what),
                advisories=_advisories(level),
            )
        )
    return tuple(out)


def _components(tcb: Mapping[str, Any], key: str, what: str) -> tuple[int, ...]:
    comps = tcb.get(key)
    if not isinstance(comps, list) or len(comps) != 16:
        raise _collateral_error(f"{what}.{key}: want 16 components")
    out = []
    for comp in comps:
        if not isinstance(comp, dict):
            raise _collateral_error(f"{what}.{key}: component is not an object")
        out.append(_get(comp, "svn", int, what))
    return tuple(out)


def _module_identity(obj: object, what: str, *, with_levels: bool) -> ModuleIdentity:
    if not isinstance(obj, dict):
        raise _collateral_error(f"{what} is not an object")
    return ModuleIdentity(
        id=_get(obj, "id", str, what) if with_levels else "",
        mrsigner=_hexfield(obj, "mrsigner", 48, what),
        attributes=_hexfield(obj, "attributes", 8, what),
        attributes_mask=_hexfield(obj, "attributesMask", 8, what),
        levels=_isv_levels(obj.get("tcbLevels"), what) if with_levels else (),
    )


def parse_tcb_info(body: bytes) -> TcbInfo:
    """Parse the inner ``tcbInfo`` JSON (v2 SGX, v3 SGX/TDX)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _collateral_error("tcb_info is not JSON") from exc
    if not isinstance(doc, dict):
        raise _collateral_error("tcb_info is not an object")
    version = _get(doc, "version", int, "tcbInfo")
    if version not in (2, 3):
        raise _collateral_error(f"tcbInfo version {version}")
    tcb_id = doc.get("id", "SGX") if version == 3 else "SGX"
    if tcb_id not in ("SGX", "TDX"):
        raise _collateral_error(f"tcbInfo id {tcb_id!r}")
    levels_raw = doc.get("tcbLevels")
    if not isinstance(levels_raw, list) or not levels_raw:
        raise _collateral_error("tcbInfo.tcbLevels missing")
    levels = []
    for level in levels_raw:
        if not isinstance(level, dict):
            raise _collateral_error("tcb level is not an object")
        tcb = _get(level, "tcb", dict, "tcbLevel")
        if version == 3:
            sgx = _components(tcb, "sgxtcbcomponents", "tcbLevel")
            tdx = _components(tcb, "tdxtcbcomponents", "tcbLevel") if tcb_id == "TDX" else None
        else:
            sgx = tuple(_get(tcb, f"sgxtcbcomp{i:02d}svn", int, "tcbLevel") for i in range(1, 17))
            tdx = None
        if level.get("tcbStatus") not in _PLATFORM_STATUSES:
            raise _collateral_error(f"tcbLevel: TCB status {level.get('tcbStatus')!r}")
        levels.append(
            TcbLevel(
                sgx_components=sgx,
                pce_svn=_get(tcb, "pcesvn", int, "tcbLevel"),
                tdx_components=tdx,
                status=_get(level, "tcbStatus", str, "tcbLevel"),
                date=_get(level, "tcbDate", str, "tcbLevel"),
                advisories=_advisories(level),
            )
        )
    tdx_module = None
    identities: tuple[ModuleIdentity, ...] = ()
    if tcb_id == "TDX":
        if "tdxModule" in doc:
            tdx_module = _module_identity(doc["tdxModule"], "tdxModule", with_levels=False)
        ids_raw = doc.get("tdxModuleIdentities", [])
        if not isinstance(ids_raw, list):
            raise _collateral_error("tdxModuleIdentities is not a list")
        identities = tuple(
            _module_identity(i, "tdxModuleIdentities", with_levels=True) for i in ids_raw
        )
    return TcbInfo(
        id=tcb_id,
        version=version,
        issue_date=_time(_get(doc, "issueDate", str, "tcbInfo"), "issueDate"),
        next_update=_time(_get(doc, "nextUpdate", str, "tcbInfo"), "nextUpdate"),
        fmspc=_hexfield(doc, "fmspc", 6, "tcbInfo"),
        pce_id=_hexfield(doc, "pceId", 2, "tcbInfo"),
        eval_data_number=_opt_int(doc, "tcbEvaluationDataNumber"),
        levels=tuple(levels),
        tdx_module=tdx_module,
        tdx_module_identities=identities,
    )


def parse_enclave_identity(body: bytes) -> EnclaveIdentity:
    """Parse the inner ``enclaveIdentity`` JSON (v2: QE, TD_QE)."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _collateral_error("qe_identity is not JSON") from exc
    if not isinstance(doc, dict):
        raise _collateral_error("qe_identity is not an object")
    what = "enclaveIdentity"
    return EnclaveIdentity(
        id=_get(doc, "id", str, what),
        version=_get(doc, "version", int, what),
        issue_date=_time(_get(doc, "issueDate", str, what), "issueDate"),
        next_update=_time(_get(doc, "nextUpdate", str, what), "nextUpdate"),
        miscselect=int.from_bytes(_hexfield(doc, "miscselect", 4, what), "big"),
        miscselect_mask=int.from_bytes(_hexfield(doc, "miscselectMask", 4, what), "big"),
        attributes=_hexfield(doc, "attributes", 16, what),
        attributes_mask=_hexfield(doc, "attributesMask", 16, what),
        mrsigner=_hexfield(doc, "mrsigner", 32, what),
        isv_prod_id=_get(doc, "isvprodid", int, what),
        eval_data_number=_opt_int(doc, "tcbEvaluationDataNumber"),
        levels=_isv_levels(doc.get("tcbLevels"), what),
    )


# --------------------------------------------------------------------------------------------
# TCB evaluation (pure)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TcbResult:
    status: str
    advisories: tuple[str, ...]
    tcb_date: str
    platform_status: str
    qe_status: str | None
    module_status: str | None


def match_platform_level(info: TcbInfo, pck: PckExtension, tee_tcb_svn: bytes | None) -> TcbLevel:
    """The first TCB level the platform meets (SGX components, PCESVN, TDX components)."""
    for level in info.levels:
        if pck.pce_svn < level.pce_svn:
            continue
        if any(
            have < want
            for have, want in zip(pck.cpu_svn_components, level.sgx_components, strict=True)
        ):
            continue
        if tee_tcb_svn is not None:
            if level.tdx_components is None:
                continue
            start = 2 if tee_tcb_svn[1] > 0 else 0
            if any(tee_tcb_svn[i] < level.tdx_components[i] for i in range(start, 16)):
                continue
        return level
    raise EvidenceVerificationError(
        "tcb_level_not_found", f"no TCB level in {info.id} TCB info matches the platform"
    )


def match_tdx_module(info: TcbInfo, report: TdReport) -> IsvLevel | None:
    """Check the TDX module identity; the matching module TCB level for module versions > 0."""
    if info.tdx_module is not None:
        _check_module_identity(info.tdx_module, report)
    version = report.tee_tcb_svn[1]
    if version == 0 or not info.tdx_module_identities:
        return None
    wanted = f"TDX_{version:02X}"
    for identity in info.tdx_module_identities:
        if identity.id.upper() == wanted:
            _check_module_identity(identity, report)
            for level in identity.levels:
                if level.isv_svn <= report.tee_tcb_svn[0]:
                    return level
            raise EvidenceVerificationError(
                "tcb_level_not_found", f"no {wanted} TCB level for module SVN"
            )
    raise EvidenceVerificationError("tdx_module_mismatch", f"no TDX module identity {wanted}")


def _check_module_identity(identity: ModuleIdentity, report: TdReport) -> None:
    if not hmac.compare_digest(identity.mrsigner, report.mr_signer_seam):
        raise EvidenceVerificationError("tdx_module_mismatch", "MRSIGNERSEAM")
    masked = bytes(
        a & m for a, m in zip(report.seam_attributes, identity.attributes_mask, strict=True)
    )
    expected = bytes(
        a & m for a, m in zip(identity.attributes, identity.attributes_mask, strict=True)
    )
    if masked != expected:
        raise EvidenceVerificationError("tdx_module_mismatch", "SEAM attributes")


def match_qe_identity(identity: EnclaveIdentity, qe: EnclaveReport, tdx: bool) -> IsvLevel | None:
    """Check the QE report against the QE identity; the QE TCB level (None: no level matched)."""
    if identity.id != ("TD_QE" if tdx else "QE"):
        raise EvidenceVerificationError("collateral_mismatch", f"QE identity id {identity.id!r}")
    if not hmac.compare_digest(identity.mrsigner, qe.mr_signer):
        raise EvidenceVerificationError("qe_identity_mismatch", "MRSIGNER")
    if identity.isv_prod_id != qe.isv_prod_id:
        raise EvidenceVerificationError("qe_identity_mismatch", "ISVPRODID")
    if (qe.misc_select & identity.miscselect_mask) != (
        identity.miscselect & identity.miscselect_mask
    ):
        raise EvidenceVerificationError("qe_identity_mismatch", "MISCSELECT")
    mask = identity.attributes_mask
    if bytes(a & m for a, m in zip(qe.attributes, mask, strict=True)) != bytes(
        a & m for a, m in zip(identity.attributes, mask, strict=True)
    ):
        raise EvidenceVerificationError("qe_identity_mismatch", "ATTRIBUTES")
    for level in identity.levels:
        if level.isv_svn <= qe.isv_svn:
            return level
    return None


_OUT_OF_DATE_FROM = {
    TcbStatus.UP_TO_DATE: TcbStatus.OUT_OF_DATE,
    TcbStatus.SW_HARDENING_NEEDED: TcbStatus.OUT_OF_DATE,
    TcbStatus.CONFIGURATION_NEEDED: TcbStatus.OUT_OF_DATE_CONFIGURATION_NEEDED,
    TcbStatus.CONFIGURATION_AND_SW_HARDENING_NEEDED: TcbStatus.OUT_OF_DATE_CONFIGURATION_NEEDED,
}


def converge_status(platform: str, other: str | None) -> str:
    """Fold a QE or TDX module status into the platform status (Intel QVL convergence)."""
    if other == TcbStatus.REVOKED:
        return TcbStatus.REVOKED.value
    if other == TcbStatus.OUT_OF_DATE:
        for before, after in _OUT_OF_DATE_FROM.items():
            if platform == before:
                return after.value
    return platform


def _merge(*groups: Sequence[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for group in groups:
        for item in group:
            seen.setdefault(item, None)
    return tuple(seen)


# --------------------------------------------------------------------------------------------
# Crypto helpers
# --------------------------------------------------------------------------------------------


_ECDSA_SHA256 = ec.ECDSA(hashes.SHA256())


def _raw_to_der(sig: bytes) -> bytes:
    if len(sig) != 64:
        raise ValueError("raw ECDSA signature must be 64 bytes")
    return encode_dss_signature(int.from_bytes(sig[:32], "big"), int.from_bytes(sig[32:], "big"))


def verify_raw_ecdsa(key: ec.EllipticCurvePublicKey, sig: bytes, data: bytes) -> bool:
    try:
        key.verify(_raw_to_der(sig), data, _ECDSA_SHA256)
    except (InvalidSignature, ValueError):
        return False
    return True


def attestation_public_key(raw: bytes) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + raw)
    except ValueError as exc:
        raise EvidenceVerificationError(
            "signature_invalid", "attestation key not on P-256"
        ) from exc


_MAX_CERTS = 16


def parse_certificate_chain(pem_or_der: bytes, what: str) -> tuple[ParsedCertificate, ...]:
    """Certificates (PEM bundle or one DER), each parsed strictly; any undecodable part of any
    of them (``cryptography`` error or warning) is ``chain_invalid``."""
    try:
        if b"-----BEGIN" in pem_or_der:
            return parse_certificates(pem_or_der.rstrip(b"\x00"), max_count=_MAX_CERTS)
        return parse_certificates(pem_or_der)
    except EvidenceFormatError as exc:
        raise EvidenceVerificationError(
            "chain_invalid", f"{what}: unreadable certificate: {exc.detail}"
        ) from None


def load_certificates(pem_or_der: bytes, what: str) -> list[x509.Certificate]:
    return [c.cert for c in parse_certificate_chain(pem_or_der, what)]


def load_crl(data: bytes, what: str) -> x509.CertificateRevocationList:
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_crl(data)
        return x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise _collateral_error(f"{what}: unreadable CRL") from exc


@dataclass(frozen=True, slots=True)
class Window:
    """A validity window; ``check`` raises with the given reason prefix when ``now`` is outside."""

    not_before: datetime
    not_after: datetime

    def contains(self, now: datetime) -> bool:
        return self.not_before <= now <= self.not_after


def _check_time(window: Window, now: datetime, kind: str, what: str) -> None:
    if now < window.not_before:
        raise EvidenceVerificationError(
            f"{kind}_not_yet_valid", f"{what} valid from {window.not_before.isoformat()}"
        )
    if now > window.not_after:
        raise EvidenceVerificationError(
            f"{kind}_expired", f"{what} valid until {window.not_after.isoformat()}"
        )


@dataclass(frozen=True, slots=True)
class VerifiedChain:
    """A certificate chain whose signatures verified up to the configured root (time-free)."""

    leaf: x509.Certificate
    leaf_key: ec.EllipticCurvePublicKey
    issuer: x509.Certificate
    certs: tuple[x509.Certificate, ...]
    """Non-root certificates, leaf first."""
    windows: tuple[tuple[str, Window], ...]
    pck: PckExtension | None = None


@dataclass(frozen=True, slots=True)
class VerifiedCrl:
    issuer_name: x509.Name
    window: Window
    revoked: frozenset[int]


@dataclass(frozen=True, slots=True)
class _SignedCollateral:
    """A signed document whose signature verified; ``signers`` are valid-time candidates."""

    signers: tuple[VerifiedChain, ...]
    parsed: TcbInfo | EnclaveIdentity


# --------------------------------------------------------------------------------------------
# The verifier core
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerifiedQuote:
    quote: Quote
    pck: PckExtension
    pck_ca: str
    tcb: TcbResult
    tcb_info: TcbInfo
    qe_identity_checked: bool
    crls_checked: bool
    details: Mapping[str, str | int | bool] = field(default_factory=dict)
    pck_serial: int = 0


class DcapVerifier:
    """Verifies Intel DCAP quotes against a pinned Intel SGX Root CA (DER or PEM bytes).

    ``require_qe_identity_and_crls`` (default True, production): QE identity, PCK CRL and Root
    CA CRL must be supplied and valid at ``now``. False is a visible, explicit relaxation for
    evidence without time-consistent QE identity/CRLs (e.g. the go-tdx-guest v5 vector): those
    checks still run when the collateral is supplied, and the claims record whether they ran.
    """

    def __init__(
        self,
        root: bytes,
        *,
        require_qe_identity_and_crls: bool = True,
        cache_size: int = 256,
    ) -> None:
        roots = parse_certificate_chain(root, "root")
        if len(roots) != 1:
            raise ValueError("root must be exactly one certificate")
        self._root_parsed = roots[0]
        self._root = roots[0].cert
        self._root_der = roots[0].der
        self._root_key = roots[0].public_key
        self._require_all = require_qe_identity_and_crls
        self._chains: Lru[tuple[bytes, bool], VerifiedChain] = Lru(cache_size)
        self._docs: Lru[tuple[object, ...], _SignedCollateral] = Lru(cache_size)
        self._crls: Lru[tuple[bytes, bytes], VerifiedCrl] = Lru(cache_size)
        self._collateral: Lru[tuple[tuple[str, bytes], ...], DcapCollateral] = Lru(cache_size)

    @property
    def require_qe_identity_and_crls(self) -> bool:
        return self._require_all

    # -- chains -------------------------------------------------------------------------------

    def _verify_chain(self, pem: bytes, what: str, *, pck: bool) -> VerifiedChain:
        return self._chains.get_or((pem, pck), lambda: self._verify_chain_uncached(pem, what, pck))

    def _verify_chain_uncached(self, pem: bytes, what: str, pck: bool) -> VerifiedChain:
        certs = parse_certificate_chain(pem, what)
        chain = [c for c in certs if c.der != self._root_der]
        if not chain:
            raise EvidenceVerificationError("chain_invalid", f"{what}: no leaf certificate")
        for cert in chain:
            if cert.issuer == cert.subject and _self_signed(cert.cert):
                raise EvidenceVerificationError("untrusted_root", f"{what}: foreign root")
        for child, parent in itertools.pairwise(chain):
            _check_issued(child, parent, what)
        top = chain[-1]
        try:
            top.cert.verify_directly_issued_by(self._root)
        except _VERIFY_ERRORS as exc:
            raise EvidenceVerificationError(
                "untrusted_root", f"{what}: does not chain to the configured root"
            ) from exc
        key = chain[0].public_key
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
            key.curve, ec.SECP256R1
        ):
            raise EvidenceVerificationError("chain_invalid", f"{what}: leaf key is not P-256")
        windows = tuple(
            (c.subject_text, Window(c.not_before, c.not_after)) for c in [*chain, self._root_parsed]
        )
        issuer = chain[1].cert if len(chain) > 1 else self._root
        return VerifiedChain(
            leaf=chain[0].cert,
            leaf_key=key,
            issuer=issuer,
            certs=tuple(c.cert for c in chain),
            windows=windows,
            pck=parse_pck_extension(chain[0].cert) if pck else None,
        )

    def _check_chain_time(self, chain: VerifiedChain, now: datetime) -> None:
        for name, window in chain.windows:
            _check_time(window, now, "certificate", name)

    # -- CRLs ----------------------------------------------------------------------------------

    def _verify_crl(self, data: bytes, issuer: x509.Certificate, what: str) -> VerifiedCrl:
        issuer_der = issuer.public_bytes(_DER)
        return self._crls.get_or((data, issuer_der), lambda: _verify_crl(data, issuer, what))

    # -- signed collateral ----------------------------------------------------------------------

    def _verify_doc(self, doc: SignedDoc, what: str, tdx_or_qe: str) -> _SignedCollateral:
        key = (doc.body, doc.signature, doc.issuer_chain_pem, tdx_or_qe)
        return self._docs.get_or(key, lambda: self._verify_doc_uncached(doc, what, tdx_or_qe))

    def _verify_doc_uncached(self, doc: SignedDoc, what: str, kind: str) -> _SignedCollateral:
        certs = parse_certificate_chain(doc.issuer_chain_pem, what)
        # Renewed TCB Signing certificates share serial and key but differ in validity: every
        # candidate that chains to the root and verifies the signature is kept; the time check
        # picks one valid at ``now``.
        signers = []
        for cert in certs:
            if cert.der == self._root_der:
                continue
            chain = self._verify_chain(cert.cert.public_bytes(_PEM), what, pck=False)
            if verify_raw_ecdsa(chain.leaf_key, doc.signature, doc.body):
                signers.append(chain)
        if not signers:
            raise EvidenceVerificationError("collateral_signature_invalid", what)
        parsed: TcbInfo | EnclaveIdentity = (
            parse_tcb_info(doc.body) if kind == "tcb" else parse_enclave_identity(doc.body)
        )
        return _SignedCollateral(signers=tuple(signers), parsed=parsed)

    def _signer_at(
        self, doc: _SignedCollateral, now: datetime, root_crl: VerifiedCrl | None, what: str
    ) -> None:
        valid = [s for s in doc.signers if all(w.contains(now) for _, w in s.windows)]
        if not valid:
            self._check_chain_time(doc.signers[0], now)
        if root_crl is not None:
            for signer in valid:
                if signer.leaf.serial_number in root_crl.revoked:
                    raise EvidenceVerificationError("revoked", f"{what} signing certificate")

    # -- the whole quote ---------------------------------------------------------------------------

    def verify_quote(
        self, evidence: bytes, *, now: datetime, collateral: Mapping[str, bytes]
    ) -> VerifiedQuote:
        if now.tzinfo is None:
            raise ValueError("now must be an aware datetime")
        quote = parse_quote(evidence)
        coll = self._collateral.get_or(
            tuple(sorted(collateral.items())), lambda: parse_collateral(collateral)
        )
        sig = quote.signature

        # 1. PCK chain to the root, valid at now.
        chain = self._verify_chain(sig.pck_chain_pem, "PCK chain", pck=True)
        self._check_chain_time(chain, now)
        pck = chain.pck
        assert pck is not None
        issuer_cn = _cn(chain.issuer)
        pck_ca = "processor" if "Processor" in issuer_cn else "platform"

        # 2. CRLs (signatures by their issuers, windows, serials).
        crls_checked = False
        root_crl: VerifiedCrl | None = None
        if coll.root_ca_crl is not None or coll.pck_crl is not None or self._require_all:
            if coll.root_ca_crl is None or coll.pck_crl is None:
                raise EvidenceVerificationError("collateral_missing", "pck_crl and root_ca_crl")
            root_crl = self._verify_crl(coll.root_ca_crl, self._root, "Root CA CRL")
            _check_time(root_crl.window, now, "collateral", "Root CA CRL")
            pck_crl = self._verify_crl(coll.pck_crl, chain.issuer, "PCK CRL")
            _check_time(pck_crl.window, now, "collateral", "PCK CRL")
            if coll.pck_crl_issuer_chain is not None:
                crl_chain = self._verify_chain(
                    coll.pck_crl_issuer_chain, "PCK CRL chain", pck=False
                )
                self._check_chain_time(crl_chain, now)
            for cert in chain.certs[1:]:
                if cert.serial_number in root_crl.revoked:
                    raise EvidenceVerificationError("revoked", f"{_cn(cert)} revoked by root CRL")
            if chain.leaf.serial_number in pck_crl.revoked:
                raise EvidenceVerificationError("revoked", "PCK certificate revoked")
            crls_checked = True

        # 3. QE report signed by the PCK key; 4. attestation key bound; 5. quote signature.
        if not verify_raw_ecdsa(chain.leaf_key, sig.qe_report_signature, sig.qe_report_raw):
            raise EvidenceVerificationError("qe_report_signature_invalid", "QE report")
        digest = hashlib.sha256(sig.attestation_key + sig.qe_auth_data).digest()
        if not hmac.compare_digest(digest, sig.qe_report.report_data[:32]):
            raise EvidenceVerificationError(
                "attestation_key_binding_invalid", "QE report_data != SHA-256(key || auth data)"
            )
        att_key = attestation_public_key(sig.attestation_key)
        if not verify_raw_ecdsa(att_key, sig.signature, quote.signed):
            raise EvidenceVerificationError("signature_invalid", "quote signature")
        if quote.header.qe_vendor_id != INTEL_QE_VENDOR_ID:
            raise EvidenceVerificationError("qe_vendor_unknown", quote.header.qe_vendor_id.hex())

        # 6. TCB info: signature, signer time, document time, FMSPC/PCEID, TEE kind.
        if coll.tcb_info is None:
            raise EvidenceVerificationError("collateral_missing", "tcb_info")
        tcb_doc = self._verify_doc(coll.tcb_info, "TCB info", "tcb")
        self._signer_at(tcb_doc, now, root_crl, "TCB info")
        info = tcb_doc.parsed
        assert isinstance(info, TcbInfo)
        _check_time(Window(info.issue_date, info.next_update), now, "collateral", "TCB info")
        if info.fmspc != pck.fmspc or info.pce_id != pck.pce_id:
            raise EvidenceVerificationError(
                "fmspc_mismatch", f"TCB info {info.fmspc.hex()} vs PCK {pck.fmspc.hex()}"
            )
        if (info.id == "TDX") != quote.is_tdx or (quote.is_tdx and info.version < 3):
            raise EvidenceVerificationError("collateral_mismatch", f"TCB info id {info.id}")

        # 7. QE identity.
        qe_level: IsvLevel | None = None
        qe_checked = False
        if coll.qe_identity is not None or self._require_all:
            if coll.qe_identity is None:
                raise EvidenceVerificationError("collateral_missing", "qe_identity")
            qe_doc = self._verify_doc(coll.qe_identity, "QE identity", "qe")
            self._signer_at(qe_doc, now, root_crl, "QE identity")
            ident = qe_doc.parsed
            assert isinstance(ident, EnclaveIdentity)
            _check_time(
                Window(ident.issue_date, ident.next_update), now, "collateral", "QE identity"
            )
            qe_level = match_qe_identity(ident, sig.qe_report, quote.is_tdx)
            qe_checked = True

        # 8. TCB levels.
        body = quote.body
        tee_tcb_svn = body.tee_tcb_svn if isinstance(body, TdReport) else None
        level = match_platform_level(info, pck, tee_tcb_svn)
        status = level.status
        advisories: tuple[str, ...] = level.advisories
        module_status: str | None = None
        if isinstance(body, TdReport):
            module = match_tdx_module(info, body)
            if module is not None:
                module_status = module.status
                status = converge_status(status, module.status)
                advisories = _merge(advisories, module.advisories)
        qe_status: str | None = None
        if qe_checked:
            if qe_level is None:
                raise EvidenceVerificationError(
                    "qe_tcb_level_not_found", "QE ISVSVN is below every QE identity TCB level"
                )
            qe_status = qe_level.status
            advisories = _merge(advisories, qe_level.advisories)
            status = converge_status(status, qe_status)
        if status == TcbStatus.REVOKED:
            # Intel QVL and dcap-qvl treat a revoked TCB as a verification failure.
            raise EvidenceVerificationError("revoked", "TCB level revoked")
        return VerifiedQuote(
            quote=quote,
            pck=pck,
            pck_ca=pck_ca,
            tcb=TcbResult(
                status=status,
                advisories=advisories,
                tcb_date=level.date,
                platform_status=level.status,
                qe_status=qe_status,
                module_status=module_status,
            ),
            tcb_info=info,
            qe_identity_checked=qe_checked,
            crls_checked=crls_checked,
            pck_serial=chain.leaf.serial_number,
        )

    def verify_tcb_collateral(
        self, collateral: Mapping[str, bytes], *, now: datetime
    ) -> VerifiedTcbCollateral:
        """Verify collateral on its own (no quote), for re-appraising claims on record: each
        document present (``tcb_info``, ``qe_identity``, ``pck_crl`` with its issuer chain) must
        verify to the configured root and be valid at ``now``; absent ones are None."""
        coll = parse_collateral(collateral)
        root_crl: VerifiedCrl | None = None
        if coll.root_ca_crl is not None:
            root_crl = self._verify_crl(coll.root_ca_crl, self._root, "Root CA CRL")
            _check_time(root_crl.window, now, "collateral", "Root CA CRL")
        info: TcbInfo | None = None
        if coll.tcb_info is not None:
            doc = self._verify_doc(coll.tcb_info, "TCB info", "tcb")
            self._signer_at(doc, now, root_crl, "TCB info")
            assert isinstance(doc.parsed, TcbInfo)
            info = doc.parsed
            _check_time(Window(info.issue_date, info.next_update), now, "collateral", "TCB info")
        ident: EnclaveIdentity | None = None
        if coll.qe_identity is not None:
            doc = self._verify_doc(coll.qe_identity, "QE identity", "qe")
            self._signer_at(doc, now, root_crl, "QE identity")
            assert isinstance(doc.parsed, EnclaveIdentity)
            ident = doc.parsed
            window = Window(ident.issue_date, ident.next_update)
            _check_time(window, now, "collateral", "QE identity")
        revoked: frozenset[int] | None = None
        crl_next: datetime | None = None
        if coll.pck_crl is not None:
            if coll.pck_crl_issuer_chain is None:
                raise EvidenceVerificationError("collateral_missing", "pck_crl_issuer_chain")
            crl_chain = self._verify_chain(coll.pck_crl_issuer_chain, "PCK CRL chain", pck=False)
            self._check_chain_time(crl_chain, now)
            if root_crl is not None and crl_chain.leaf.serial_number in root_crl.revoked:
                raise EvidenceVerificationError("revoked", "PCK CRL issuer revoked by root CRL")
            pck_crl = self._verify_crl(coll.pck_crl, crl_chain.leaf, "PCK CRL")
            _check_time(pck_crl.window, now, "collateral", "PCK CRL")
            revoked = pck_crl.revoked
            crl_next = pck_crl.window.not_after
        return VerifiedTcbCollateral(info, ident, revoked, crl_next)


@dataclass(frozen=True, slots=True)
class VerifiedTcbCollateral:
    """Collateral verified without a quote (``DcapVerifier.verify_tcb_collateral``)."""

    tcb_info: TcbInfo | None
    qe_identity: EnclaveIdentity | None
    pck_crl_revoked: frozenset[int] | None
    pck_crl_next_update: datetime | None = None


# --------------------------------------------------------------------------------------------
# Claims helpers shared by tdx.py and sgx_dcap.py
# --------------------------------------------------------------------------------------------


def common_tcb_claims(v: VerifiedQuote) -> dict[str, int]:
    tcb = {"pce_svn": v.pck.pce_svn, "qe_svn": v.quote.signature.qe_report.isv_svn}
    for i, svn in enumerate(v.pck.cpu_svn_components, start=1):
        tcb[f"sgx_tcb_comp{i:02d}"] = svn
    return tcb


def common_details(v: VerifiedQuote) -> dict[str, str | int | bool]:
    h = v.quote.header
    return {
        "quote_version": h.version,
        "qe_svn": v.quote.signature.qe_report.isv_svn,
        "header_qe_svn": h.qe_svn,
        "header_pce_svn": h.pce_svn,
        "fmspc": v.pck.fmspc.hex(),
        "pce_id": v.pck.pce_id.hex(),
        "pck_ca": v.pck_ca,
        "cpu_svn": v.pck.cpu_svn.hex(),
        "tcb_date": v.tcb.tcb_date,
        "tcb_eval_data_number": v.tcb_info.eval_data_number,
        "platform_tcb_status": v.tcb.platform_status,
        "qe_tcb_status": v.tcb.qe_status or "",
        "qe_identity_checked": v.qe_identity_checked,
        "crls_checked": v.crls_checked,
        "pck_serial": format(v.pck_serial, "x"),
    }


# --------------------------------------------------------------------------------------------
# private helpers
# --------------------------------------------------------------------------------------------

_DER = Encoding.DER
_PEM = Encoding.PEM


def _cn(cert: x509.Certificate) -> str:
    attrs = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else cert.subject.rfc4514_string()


_VERIFY_ERRORS = (ValueError, TypeError, UnsupportedAlgorithm, InvalidSignature)
"""What ``verify_directly_issued_by`` raises for a link that does not verify."""


def _self_signed(cert: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(cert)
    except _VERIFY_ERRORS:
        return False
    return True


def _check_issued(child: ParsedCertificate, parent: ParsedCertificate, what: str) -> None:
    try:
        child.cert.verify_directly_issued_by(parent.cert)
    except _VERIFY_ERRORS as exc:
        raise EvidenceVerificationError("chain_invalid", f"{what}: {_cn(child.cert)}") from exc
    bc = parent.basic_constraints()
    if bc is None or not bc.ca:
        raise EvidenceVerificationError("chain_invalid", f"{what}: {_cn(parent.cert)} is not a CA")


@dataclass(frozen=True, slots=True)
class _CrlFacts:
    issuer: x509.Name
    issuer_text: str
    signature_valid: bool
    last_update: datetime
    next_update: datetime | None
    revoked: frozenset[int]


def _read_crl(data: bytes, issuer: x509.Certificate, what: str) -> _CrlFacts:
    """Decode every part of the CRL we use; any ``cryptography`` error or warning on the way
    (undecodable names, entries, algorithms) is ``collateral_invalid``."""

    def read() -> _CrlFacts:
        crl = load_crl(data, what)
        key = issuer.public_key()
        name = crl.issuer
        return _CrlFacts(
            issuer=name,
            issuer_text=name.rfc4514_string(),
            signature_valid=isinstance(key, ec.EllipticCurvePublicKey)
            and crl.is_signature_valid(key),
            last_update=crl.last_update_utc,
            next_update=crl.next_update_utc,
            revoked=frozenset(r.serial_number for r in crl),
        )

    return decode_strictly(
        read, lambda detail: _collateral_error(f"{what}: unreadable CRL: {detail}")
    )


def _verify_crl(data: bytes, issuer: x509.Certificate, what: str) -> VerifiedCrl:
    crl = _read_crl(data, issuer, what)
    if crl.issuer != issuer.subject:
        raise EvidenceVerificationError(
            "crl_issuer_mismatch", f"{what} issued by {crl.issuer_text}"
        )
    if not crl.signature_valid:
        raise EvidenceVerificationError("collateral_signature_invalid", what)
    if crl.next_update is None:
        raise _collateral_error(f"{what} has no nextUpdate")
    return VerifiedCrl(
        issuer_name=crl.issuer,
        window=Window(crl.last_update, crl.next_update),
        revoked=crl.revoked,
    )
