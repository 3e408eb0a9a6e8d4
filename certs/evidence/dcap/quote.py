"""Intel DCAP quotes (ECDSA-P256, v3/v4/v5): the wire model and a strict, bounded parser.

``parse_quote`` raises only ``EvidenceFormatError`` (``quote_truncated``, ``quote_unsupported``,
``quote_malformed``, ``quote_too_large``); ``quote_tee_type`` is the cheap sniff the registry and
the Gramine agent use.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from certs.errors import EvidenceFormatError

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
