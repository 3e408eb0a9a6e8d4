"""Intel TDX quote (v4 TDX 1.0, v5 TDX 1.0/1.5) verifier: a thin layer over ``certs.evidence.dcap``.

Collateral names: see ``certs.evidence.dcap`` (``collateral_json`` or ``tcb_info``,
``tcb_info_issuer_chain``, ``qe_identity``, ``qe_identity_issuer_chain``, ``pck_crl``,
``pck_crl_issuer_chain``, ``root_ca_crl``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from certs.errors import EvidenceVerificationError
from certs.evidence.claims import Claims, Detail, Tee, evidence_digest
from certs.evidence.dcap import (
    TEE_TYPE_TDX,
    DcapVerifier,
    TdReport,
    VerifiedQuote,
    common_details,
    common_tcb_claims,
    quote_tee_type,
)

__all__ = ["TdxVerifier", "claims_from", "looks_like"]


def looks_like(evidence: bytes) -> bool:
    """True for an ECDSA-P256 DCAP quote whose header says TDX (tee_type 0x81)."""
    return quote_tee_type(evidence) == TEE_TYPE_TDX


class TdxVerifier:
    """Verifies TDX quotes against the Intel SGX Root CA given at construction.

    ``require_qe_identity_and_crls=False`` is an explicit, visible relaxation (see
    ``DcapVerifier``); production keeps the strict default.
    """

    def __init__(self, root: bytes, *, require_qe_identity_and_crls: bool = True) -> None:
        self._core = DcapVerifier(root, require_qe_identity_and_crls=require_qe_identity_and_crls)

    @property
    def tee(self) -> Tee:
        return Tee.TDX

    def verify(self, evidence: bytes, *, now: datetime, collateral: Mapping[str, bytes]) -> Claims:
        verified = self._core.verify_quote(evidence, now=now, collateral=collateral)
        if not verified.quote.is_tdx:
            raise EvidenceVerificationError("wrong_tee", "an SGX quote given to the TDX verifier")
        return claims_from(verified, evidence)


def claims_from(v: VerifiedQuote, evidence: bytes) -> Claims:
    body = v.quote.body
    assert isinstance(body, TdReport)
    measurements = {
        "mrtd": body.mr_td.hex(),
        "rtmr0": body.rtmrs[0].hex(),
        "rtmr1": body.rtmrs[1].hex(),
        "rtmr2": body.rtmrs[2].hex(),
        "rtmr3": body.rtmrs[3].hex(),
        "mrseam": body.mr_seam.hex(),
        "mrsignerseam": body.mr_signer_seam.hex(),
        "mrconfigid": body.mr_config_id.hex(),
        "mrowner": body.mr_owner.hex(),
        "mrownerconfig": body.mr_owner_config.hex(),
    }
    if body.mr_servicetd is not None:
        measurements["mrservicetd"] = body.mr_servicetd.hex()
    tcb = common_tcb_claims(v)
    tcb["tdx_module_svn"] = body.tee_tcb_svn[0]
    tcb["tdx_module_version"] = body.tee_tcb_svn[1]
    for i, svn in enumerate(body.tee_tcb_svn, start=1):
        tcb[f"tdx_tcb_comp{i:02d}"] = svn
    details: dict[str, Detail] = common_details(v)
    details.update(
        {
            "body_type": v.quote.body_type,
            "tee_tcb_svn": body.tee_tcb_svn.hex(),
            "td_attributes": body.td_attributes.hex(),
            "seam_attributes": body.seam_attributes.hex(),
            "xfam": body.xfam.hex(),
            "tdx_module_tcb_status": v.tcb.module_status or "",
        }
    )
    if body.tee_tcb_svn2 is not None:
        details["tee_tcb_svn2"] = body.tee_tcb_svn2.hex()
    return Claims(
        tee=Tee.TDX,
        measurements=measurements,
        report_data=body.report_data,
        debug=body.debug,
        evidence_sha256=evidence_digest(evidence),
        signer=None,
        platform_id=v.pck.fmspc.hex(),
        tcb=tcb,
        tcb_status=v.tcb.status,
        advisories=v.tcb.advisories,
        details=details,
    )
