"""Intel SGX DCAP quote (v3, and v4/v5 SGX bodies) verifier: thin, over ``certs.evidence.dcap``.

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
    TEE_TYPE_SGX,
    DcapVerifier,
    EnclaveReport,
    VerifiedQuote,
    common_details,
    common_tcb_claims,
    quote_tee_type,
)

__all__ = ["SgxVerifier", "claims_from", "looks_like"]


def looks_like(evidence: bytes) -> bool:
    """True for an ECDSA-P256 DCAP quote whose header says SGX (tee_type 0)."""
    return quote_tee_type(evidence) == TEE_TYPE_SGX


class SgxVerifier:
    """Verifies SGX ECDSA quotes against the Intel SGX Root CA given at construction."""

    def __init__(self, root: bytes, *, require_qe_identity_and_crls: bool = True) -> None:
        self._core = DcapVerifier(root, require_qe_identity_and_crls=require_qe_identity_and_crls)

    @property
    def tee(self) -> Tee:
        return Tee.SGX

    def verify(self, evidence: bytes, *, now: datetime, collateral: Mapping[str, bytes]) -> Claims:
        verified = self._core.verify_quote(evidence, now=now, collateral=collateral)
        if verified.quote.is_tdx:
            raise EvidenceVerificationError("wrong_tee", "a TDX quote given to the SGX verifier")
        return claims_from(verified, evidence)


def claims_from(v: VerifiedQuote, evidence: bytes) -> Claims:
    body = v.quote.body
    assert isinstance(body, EnclaveReport)
    details: dict[str, Detail] = common_details(v)
    details.update(
        {
            "attributes": body.attributes.hex(),
            "misc_select": body.misc_select,
            "config_svn": body.config_svn,
            "config_id": body.config_id.hex(),
            "isv_ext_prod_id": body.isv_ext_prod_id.hex(),
            "isv_family_id": body.isv_family_id.hex(),
            "cpu_svn_report": body.cpu_svn.hex(),
        }
    )
    return Claims(
        tee=Tee.SGX,
        measurements={"mrenclave": body.mr_enclave.hex(), "mrsigner": body.mr_signer.hex()},
        report_data=body.report_data,
        debug=body.debug,
        evidence_sha256=evidence_digest(evidence),
        signer=body.mr_signer.hex(),
        product_id=body.isv_prod_id,
        svn=body.isv_svn,
        platform_id=v.pck.fmspc.hex(),
        tcb=common_tcb_claims(v),
        tcb_status=v.tcb.status,
        advisories=v.tcb.advisories,
        details=details,
    )
