"""TCB level matching (pure): the platform's TCB level in a TCB info, the TDX module's, the
QE's in a QE identity, and Intel QVL's status convergence."""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass

from certs.errors import EvidenceVerificationError
from certs.evidence.claims import TcbStatus
from certs.evidence.dcap.collateral import (
    EnclaveIdentity,
    IsvLevel,
    ModuleIdentity,
    TcbInfo,
    TcbLevel,
)
from certs.evidence.dcap.pck import PckExtension
from certs.evidence.dcap.quote import EnclaveReport, TdReport


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


def merge(*groups: Sequence[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for group in groups:
        for item in group:
            seen.setdefault(item, None)
    return tuple(seen)
