"""DCAP collateral: the named blobs (see ``certs.evidence.dcap``) normalised into a
``DcapCollateral``, the signed PCS documents (TCB info, QE identity) parsed strictly, and the
CRLs read strictly. Everything here raises ``EvidenceVerificationError``: ``collateral_invalid``,
``collateral_missing``, ``chain_invalid`` (an unreadable issuer chain)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import TcbStatus
from certs.evidence.x509chain import (
    ParsedCertificate,
    Window,
    parse_certificates,
    parse_crl,
)


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


def collateral_error(detail: str) -> EvidenceVerificationError:
    return EvidenceVerificationError("collateral_invalid", detail)


def split_signed_response(raw: bytes, key: str) -> tuple[bytes, bytes]:
    """Split a PCS body ``{"<key>": {...}, "signature": "<hex>"}`` into (exact inner bytes, sig)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise collateral_error(f"{key}: not UTF-8") from exc
    decoder = json.JSONDecoder()
    spans: dict[str, tuple[int, int, Any]] = {}
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "{":
        raise collateral_error(f"{key}: not a JSON object")
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
        raise collateral_error(f"{key}: {exc}") from exc
    if key not in spans or "signature" not in spans:
        raise collateral_error(f"missing {key!r} or 'signature'")
    start, end, _ = spans[key]
    sig = spans["signature"][2]
    if not isinstance(sig, str):
        raise collateral_error(f"{key}: signature is not a string")
    return raw[len(text[:start].encode()) : len(text[:end].encode())], _unhex(sig, f"{key} sig")


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _unhex(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise collateral_error(f"{what}: not a hex string")
    try:
        return bytes.fromhex(value)
    except ValueError as exc:
        raise collateral_error(f"{what}: bad hex") from exc


def parse_collateral(collateral: Mapping[str, bytes]) -> DcapCollateral:
    """Normalise the documented collateral names into a ``DcapCollateral``."""
    parts: dict[str, Any] = {}
    if "collateral_json" in collateral:
        try:
            doc = json.loads(collateral["collateral_json"])
        except (ValueError, UnicodeDecodeError) as exc:
            raise collateral_error("collateral_json is not JSON") from exc
        if not isinstance(doc, dict):
            raise collateral_error("collateral_json is not an object")

        def text(name: str) -> bytes:
            value = doc.get(name)
            if not isinstance(value, str):
                raise collateral_error(f"collateral_json.{name} missing or not a string")
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
        raise collateral_error(f"{what}.{key}: missing or not {kind.__name__}")
    return value


def _opt_int(obj: Mapping[str, Any], key: str) -> int:
    value = obj.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool):
        raise collateral_error(f"{key} is not an integer")
    return value


def _time(value: str, what: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise collateral_error(f"{what}: bad time {value!r}") from exc
    if parsed.tzinfo is None:
        raise collateral_error(f"{what}: time without zone")
    return parsed.astimezone(UTC)


def _hexfield(obj: Mapping[str, Any], key: str, size: int, what: str) -> bytes:
    out = _unhex(obj.get(key), f"{what}.{key}")
    if len(out) != size:
        raise collateral_error(f"{what}.{key}: {len(out)} bytes, want {size}")
    return out


def _advisories(level: Mapping[str, Any]) -> tuple[str, ...]:
    ids = level.get("advisoryIDs", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise collateral_error("advisoryIDs is not a list of strings")
    return tuple(ids)


_ISV_STATUSES = frozenset({TcbStatus.UP_TO_DATE, TcbStatus.OUT_OF_DATE, TcbStatus.REVOKED})
"""Enclave identity and TDX module levels use only these statuses."""
_PLATFORM_STATUSES = frozenset(TcbStatus)


def _isv_levels(levels: object, what: str) -> tuple[IsvLevel, ...]:
    if not isinstance(levels, list):
        raise collateral_error(f"{what}.tcbLevels is not a list")
    out = []
    for level in levels:
        if not isinstance(level, dict):
            raise collateral_error(f"{what}: tcb level is not an object")
        tcb = _get(level, "tcb", dict, what)
        if level.get("tcbStatus") not in _ISV_STATUSES:
            raise collateral_error(f"{what}: TCB status {level.get('tcbStatus')!r}")
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
        raise collateral_error(f"{what}.{key}: want 16 components")
    out = []
    for comp in comps:
        if not isinstance(comp, dict):
            raise collateral_error(f"{what}.{key}: component is not an object")
        out.append(_get(comp, "svn", int, what))
    return tuple(out)


def _module_identity(obj: object, what: str, *, with_levels: bool) -> ModuleIdentity:
    if not isinstance(obj, dict):
        raise collateral_error(f"{what} is not an object")
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
        raise collateral_error("tcb_info is not JSON") from exc
    if not isinstance(doc, dict):
        raise collateral_error("tcb_info is not an object")
    version = _get(doc, "version", int, "tcbInfo")
    if version not in (2, 3):
        raise collateral_error(f"tcbInfo version {version}")
    tcb_id = doc.get("id", "SGX") if version == 3 else "SGX"
    if tcb_id not in ("SGX", "TDX"):
        raise collateral_error(f"tcbInfo id {tcb_id!r}")
    levels_raw = doc.get("tcbLevels")
    if not isinstance(levels_raw, list) or not levels_raw:
        raise collateral_error("tcbInfo.tcbLevels missing")
    levels = []
    for level in levels_raw:
        if not isinstance(level, dict):
            raise collateral_error("tcb level is not an object")
        tcb = _get(level, "tcb", dict, "tcbLevel")
        if version == 3:
            sgx = _components(tcb, "sgxtcbcomponents", "tcbLevel")
            tdx = _components(tcb, "tdxtcbcomponents", "tcbLevel") if tcb_id == "TDX" else None
        else:
            sgx = tuple(_get(tcb, f"sgxtcbcomp{i:02d}svn", int, "tcbLevel") for i in range(1, 17))
            tdx = None
        if level.get("tcbStatus") not in _PLATFORM_STATUSES:
            raise collateral_error(f"tcbLevel: TCB status {level.get('tcbStatus')!r}")
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
            raise collateral_error("tdxModuleIdentities is not a list")
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
        raise collateral_error("qe_identity is not JSON") from exc
    if not isinstance(doc, dict):
        raise collateral_error("qe_identity is not an object")
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


MAX_CHAIN_CERTS = 16
"""Certificates in one DCAP issuer chain (a PCK chain has 3)."""


def parse_certificate_chain(pem_or_der: bytes, what: str) -> tuple[ParsedCertificate, ...]:
    """Certificates (PEM bundle or one DER), each parsed strictly; any undecodable part of any
    of them (``cryptography`` error or warning) is ``chain_invalid``."""
    try:
        if b"-----BEGIN" in pem_or_der:
            return parse_certificates(pem_or_der.rstrip(b"\x00"), max_count=MAX_CHAIN_CERTS)
        return parse_certificates(pem_or_der)
    except EvidenceFormatError as exc:
        raise EvidenceVerificationError(
            "chain_invalid", f"{what}: unreadable certificate: {exc.detail}"
        ) from None


@dataclass(frozen=True, slots=True)
class VerifiedCrl:
    issuer_name: x509.Name
    window: Window
    revoked: frozenset[int]


def verify_crl(data: bytes, issuer: ParsedCertificate, what: str) -> VerifiedCrl:
    """A CRL (DER or PEM) ``issuer`` signed, read strictly (time-free: its ``window`` is checked
    by the caller): ``collateral_invalid``, ``crl_issuer_mismatch``,
    ``collateral_signature_invalid``."""
    key = issuer.public_key
    crl = parse_crl(
        data,
        lambda detail: collateral_error(f"{what}: unreadable CRL: {detail}"),
        signature_valid=lambda crl: (
            isinstance(key, ec.EllipticCurvePublicKey) and crl.is_signature_valid(key)
        ),
    )
    if crl.issuer != issuer.subject:
        raise EvidenceVerificationError(
            "crl_issuer_mismatch", f"{what} issued by {crl.issuer_text}"
        )
    if not crl.signature_valid:
        raise EvidenceVerificationError("collateral_signature_invalid", what)
    if crl.next_update is None:
        raise collateral_error(f"{what} has no nextUpdate")
    return VerifiedCrl(
        issuer_name=crl.issuer,
        window=Window(crl.last_update, crl.next_update, what, what),
        revoked=crl.revoked,
    )
