"""The DCAP verifier (pure: time injected, the trusted root a constructor argument).

``DcapVerifier.verify_quote`` verifies the PCK chain and CRLs, the QE report signature, the
attestation key binding, the quote signature, the TCB info and QE identity signatures and times,
and then evaluates the TCB status (platform level, TDX module, QE identity).
``verify_tcb_collateral`` verifies collateral alone, for re-appraising claims on record.
Chains go through the shared ``certs.evidence.x509chain.ChainVerifier`` (ECDSA P-256/SHA-256
links); every time check is its ``check_window``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import EvidenceVerificationError
from certs.evidence.claims import TcbStatus
from certs.evidence.dcap.collateral import (
    MAX_CHAIN_CERTS,
    DcapCollateral,
    EnclaveIdentity,
    IsvLevel,
    SignedDoc,
    TcbInfo,
    VerifiedCrl,
    parse_certificate_chain,
    parse_collateral,
    parse_enclave_identity,
    parse_tcb_info,
    verify_crl,
)
from certs.evidence.dcap.pck import PckExtension, parse_pck_extension
from certs.evidence.dcap.quote import INTEL_QE_VENDOR_ID, Quote, TdReport, parse_quote
from certs.evidence.dcap.tcb import (
    TcbResult,
    converge_status,
    match_platform_level,
    match_qe_identity,
    match_tdx_module,
    merge,
)
from certs.evidence.x509chain import (
    ChainVerifier,
    EcdsaLinks,
    Lru,
    ParsedCertificate,
    VerifiedChain,
    Window,
    check_window,
    common_name,
    verify_raw_ecdsa,
)

_SHA256 = hashes.SHA256()


def _collateral_window(issue_date: datetime, next_update: datetime, what: str) -> Window:
    return Window(issue_date, next_update, what, what)


def _verify_p256(chain: VerifiedChain, rs: bytes, data: bytes) -> bool:
    return verify_raw_ecdsa(chain.leaf_key, rs, data, _SHA256)


@dataclass(frozen=True, slots=True)
class _SignedCollateral:
    """A signed document whose signature verified; ``signers`` are valid-time candidates."""

    signers: tuple[VerifiedChain, ...]
    parsed: TcbInfo | EnclaveIdentity


@dataclass(frozen=True, slots=True)
class _PckChain:
    chain: VerifiedChain
    pck: PckExtension


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
        self._root = roots[0]
        self._x509 = ChainVerifier(
            self._root,
            links=EcdsaLinks(ec.SECP256R1, hashes.SHA256),
            leaf_curve=ec.SECP256R1,
            max_chain=MAX_CHAIN_CERTS,
            cache_size=cache_size,
        )
        self._require_all = require_qe_identity_and_crls
        self._chains: Lru[bytes, VerifiedChain] = Lru(cache_size)
        self._pck_chains: Lru[bytes, _PckChain] = Lru(cache_size)
        self._docs: Lru[tuple[object, ...], _SignedCollateral] = Lru(cache_size)
        self._crls: Lru[tuple[bytes, bytes], VerifiedCrl] = Lru(cache_size)
        self._collateral: Lru[tuple[tuple[str, bytes], ...], DcapCollateral] = Lru(cache_size)

    @property
    def require_qe_identity_and_crls(self) -> bool:
        return self._require_all

    # -- chains -------------------------------------------------------------------------------

    def _verify_chain(self, pem: bytes, what: str) -> VerifiedChain:
        """A PEM bundle (leaf first; copies of the root anywhere are dropped) verified to the root
        by the shared chain verifier (time-free; cached by the bundle's bytes)."""
        return self._chains.get_or(pem, lambda: self._verify_chain_uncached(pem, what))

    def _verify_chain_uncached(self, pem: bytes, what: str) -> VerifiedChain:
        certs = [c for c in parse_certificate_chain(pem, what) if c.der != self._root.der]
        if not certs:
            raise EvidenceVerificationError("chain_invalid", f"{what}: no leaf certificate")
        try:
            return self._x509.verify_links(certs)
        except EvidenceVerificationError as exc:
            raise EvidenceVerificationError(exc.reason, f"{what}: {exc.detail}") from None

    def _verify_pck_chain(self, pem: bytes) -> _PckChain:
        def make() -> _PckChain:
            chain = self._verify_chain(pem, "PCK chain")
            return _PckChain(chain, parse_pck_extension(chain.leaf))

        return self._pck_chains.get_or(pem, make)

    # -- CRLs ----------------------------------------------------------------------------------

    def _verify_crl(self, data: bytes, issuer: ParsedCertificate, what: str) -> VerifiedCrl:
        return self._crls.get_or((data, issuer.der), lambda: verify_crl(data, issuer, what))

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
            if cert.der == self._root.der:
                continue
            chain = self._chain_of(cert, what)
            if _verify_p256(chain, doc.signature, doc.body):
                signers.append(chain)
        if not signers:
            raise EvidenceVerificationError("collateral_signature_invalid", what)
        parsed: TcbInfo | EnclaveIdentity = (
            parse_tcb_info(doc.body) if kind == "tcb" else parse_enclave_identity(doc.body)
        )
        return _SignedCollateral(signers=tuple(signers), parsed=parsed)

    def _chain_of(self, cert: ParsedCertificate, what: str) -> VerifiedChain:
        """One signing certificate verified to the root on its own (the chain verifier caches)."""
        try:
            return self._x509.verify_links([cert])
        except EvidenceVerificationError as exc:
            raise EvidenceVerificationError(exc.reason, f"{what}: {exc.detail}") from None

    def _signer_at(
        self, doc: _SignedCollateral, now: datetime, root_crl: VerifiedCrl | None, what: str
    ) -> None:
        valid = [s for s in doc.signers if s.window.contains(now)]
        if not valid:
            doc.signers[0].check_time(now)
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
        pck_chain = self._verify_pck_chain(sig.pck_chain_pem)
        chain, pck = pck_chain.chain, pck_chain.pck
        chain.check_time(now)
        issuer_cn = common_name(chain.issuer.subject)
        pck_ca = "processor" if "Processor" in issuer_cn else "platform"

        # 2. CRLs (signatures by their issuers, windows, serials).
        crls_checked = False
        root_crl: VerifiedCrl | None = None
        if coll.root_ca_crl is not None or coll.pck_crl is not None or self._require_all:
            if coll.root_ca_crl is None or coll.pck_crl is None:
                raise EvidenceVerificationError("collateral_missing", "pck_crl and root_ca_crl")
            root_crl = self._verify_crl(coll.root_ca_crl, self._root, "Root CA CRL")
            check_window(root_crl.window, now, kind="collateral")
            pck_crl = self._verify_crl(coll.pck_crl, chain.issuer, "PCK CRL")
            check_window(pck_crl.window, now, kind="collateral")
            if coll.pck_crl_issuer_chain is not None:
                crl_chain = self._verify_chain(coll.pck_crl_issuer_chain, "PCK CRL chain")
                crl_chain.check_time(now)
            for cert in chain.certs[1:]:
                if cert.serial_number in root_crl.revoked:
                    raise EvidenceVerificationError(
                        "revoked", f"{common_name(cert.subject)} revoked by root CRL"
                    )
            if chain.leaf.serial_number in pck_crl.revoked:
                raise EvidenceVerificationError("revoked", "PCK certificate revoked")
            crls_checked = True

        # 3. QE report signed by the PCK key; 4. attestation key bound; 5. quote signature.
        if not _verify_p256(chain, sig.qe_report_signature, sig.qe_report_raw):
            raise EvidenceVerificationError("qe_report_signature_invalid", "QE report")
        digest = hashlib.sha256(sig.attestation_key + sig.qe_auth_data).digest()
        if not hmac.compare_digest(digest, sig.qe_report.report_data[:32]):
            raise EvidenceVerificationError(
                "attestation_key_binding_invalid", "QE report_data != SHA-256(key || auth data)"
            )
        att_key = attestation_public_key(sig.attestation_key)
        if not verify_raw_ecdsa(att_key, sig.signature, quote.signed, _SHA256):
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
        check_window(
            _collateral_window(info.issue_date, info.next_update, "TCB info"),
            now,
            kind="collateral",
        )
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
            check_window(
                _collateral_window(ident.issue_date, ident.next_update, "QE identity"),
                now,
                kind="collateral",
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
                advisories = merge(advisories, module.advisories)
        qe_status: str | None = None
        if qe_checked:
            if qe_level is None:
                raise EvidenceVerificationError(
                    "qe_tcb_level_not_found", "QE ISVSVN is below every QE identity TCB level"
                )
            qe_status = qe_level.status
            advisories = merge(advisories, qe_level.advisories)
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
            check_window(root_crl.window, now, kind="collateral")
        info: TcbInfo | None = None
        if coll.tcb_info is not None:
            doc = self._verify_doc(coll.tcb_info, "TCB info", "tcb")
            self._signer_at(doc, now, root_crl, "TCB info")
            assert isinstance(doc.parsed, TcbInfo)
            info = doc.parsed
            check_window(
                _collateral_window(info.issue_date, info.next_update, "TCB info"),
                now,
                kind="collateral",
            )
        ident: EnclaveIdentity | None = None
        if coll.qe_identity is not None:
            doc = self._verify_doc(coll.qe_identity, "QE identity", "qe")
            self._signer_at(doc, now, root_crl, "QE identity")
            assert isinstance(doc.parsed, EnclaveIdentity)
            ident = doc.parsed
            window = _collateral_window(ident.issue_date, ident.next_update, "QE identity")
            check_window(window, now, kind="collateral")
        revoked: frozenset[int] | None = None
        crl_next: datetime | None = None
        if coll.pck_crl is not None:
            if coll.pck_crl_issuer_chain is None:
                raise EvidenceVerificationError("collateral_missing", "pck_crl_issuer_chain")
            crl_chain = self._verify_chain(coll.pck_crl_issuer_chain, "PCK CRL chain")
            crl_chain.check_time(now)
            if root_crl is not None and crl_chain.leaf.serial_number in root_crl.revoked:
                raise EvidenceVerificationError("revoked", "PCK CRL issuer revoked by root CRL")
            pck_crl = self._verify_crl(coll.pck_crl, crl_chain.leaf, "PCK CRL")
            check_window(pck_crl.window, now, kind="collateral")
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


def attestation_public_key(raw: bytes) -> ec.EllipticCurvePublicKey:
    try:
        return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + raw)
    except ValueError as exc:
        raise EvidenceVerificationError(
            "signature_invalid", "attestation key not on P-256"
        ) from exc
