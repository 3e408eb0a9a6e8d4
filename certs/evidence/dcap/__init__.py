"""Intel DCAP (ECDSA quote v3/v4/v5), shared by the TDX and SGX verifiers.

Modules: ``quote`` (the wire model and strict parser), ``pck`` (the PCK certificate's SGX
extension), ``collateral`` (the named collateral blobs, TCB info, QE identity, CRLs), ``tcb``
(TCB level matching, pure), ``verifier`` (``DcapVerifier``: pure, time injected, the trusted root
a constructor argument). Certificates, chains, DER and validity windows come from the shared
toolkit ``certs.evidence.x509chain``.

Public face (what others import, from this package only): the names in ``__all__``.
``certs.evidence.tdx`` and ``certs.evidence.sgx_dcap`` are the TEE verifiers on top.

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

from certs.evidence.dcap.collateral import (
    DcapCollateral,
    EnclaveIdentity,
    IsvLevel,
    ModuleIdentity,
    SignedDoc,
    TcbInfo,
    TcbLevel,
    parse_certificate_chain,
    parse_collateral,
    parse_enclave_identity,
    parse_tcb_info,
    split_signed_response,
)
from certs.evidence.dcap.pck import PckExtension, parse_pck_extension
from certs.evidence.dcap.quote import (
    MAX_QUOTE_BYTES,
    TEE_TYPE_SGX,
    TEE_TYPE_TDX,
    EnclaveReport,
    Quote,
    QuoteHeader,
    TdReport,
    parse_quote,
    quote_tee_type,
)
from certs.evidence.dcap.tcb import TcbResult, converge_status, match_platform_level
from certs.evidence.dcap.verifier import (
    DcapVerifier,
    VerifiedQuote,
    VerifiedTcbCollateral,
    common_details,
    common_tcb_claims,
)

__all__ = [
    "MAX_QUOTE_BYTES",
    "TEE_TYPE_SGX",
    "TEE_TYPE_TDX",
    "DcapCollateral",
    "DcapVerifier",
    "EnclaveIdentity",
    "EnclaveReport",
    "IsvLevel",
    "ModuleIdentity",
    "PckExtension",
    "Quote",
    "QuoteHeader",
    "SignedDoc",
    "TcbInfo",
    "TcbLevel",
    "TcbResult",
    "TdReport",
    "VerifiedQuote",
    "VerifiedTcbCollateral",
    "common_details",
    "common_tcb_claims",
    "converge_status",
    "match_platform_level",
    "parse_certificate_chain",
    "parse_collateral",
    "parse_enclave_identity",
    "parse_pck_extension",
    "parse_quote",
    "parse_tcb_info",
    "quote_tee_type",
    "split_signed_response",
]
