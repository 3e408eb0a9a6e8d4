"""Continuous TCB re-evaluation: claims on record against changed vendor collateral. Pure.

A verifier evaluates a platform's TCB once, at attestation, against the collateral of that
moment. Vendor collateral moves on (Intel TCB info / QE identity / PCK CRL, AMD CRL); this
module re-evaluates the TCB facts an attestation left in its claims, without the workload
re-attesting:

* Intel (TDX, SGX): ``details`` ``fmspc``, ``pce_id``, ``pck_ca``, ``pck_serial``,
  ``tee_tcb_svn`` (TDX), ``tcb_eval_data_number``; ``tcb`` ``sgx_tcb_comp01..16``,
  ``pce_svn``, ``qe_svn``. The TCB level, the TDX module level and the QE level are matched as
  the verifier does (``certs.evidence.dcap``); a PCK certificate on the PCK CRL is
  ``Revoked``. Collateral older than the one the claims were evaluated with (a lower
  ``tcbEvaluationDataNumber``) is ignored: a replayed older document cannot undo a downgrade.
* AMD SEV-SNP: ``details`` ``product``, ``endorsement_serial`` (VCEK/VLEK),
  ``intermediate_serial`` (ASK/ASVK). A serial on the product's CRL (signed by its ARK) makes
  the claims ``Revoked``. AMD publishes no signed TCB baseline: a newer AMD TCB reaches running
  workloads through a policy's raised ``minimumTcb`` (see ``certs.policy.tcb_change_only``).

``platform_keys`` names the collateral scopes a claim depends on, so a change re-appraises only
the workloads on the affected FMSPC / PCK CA / AMD product. Verification of fetched collateral
takes the trust roots as parameters (``DcapVerifier`` for Intel, pinned ``AmdChain`` ARKs for
AMD).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from cryptography.hazmat.primitives.asymmetric import rsa

from certs.errors import EvidenceVerificationError
from certs.evidence.claims import Claims, Detail, TcbStatus, Tee
from certs.evidence.dcap import (
    EnclaveIdentity,
    PckExtension,
    TcbInfo,
    converge_status,
    match_platform_level,
)
from certs.evidence.sev_snp import AMD_SIGNATURES, AmdChain, Product
from certs.evidence.x509chain import MAX_CRL_BYTES, Window, check_window, parse_crl
from certs.policy import (
    AttestationPolicy,
    Mode,
    OnTcbChange,
    Rejected,
    appraise,
    tcb_change_only,
)

NO_TCB_LEVEL = "NoMatchingTcbLevel"
"""Status of claims no TCB level of the new collateral matches (never an accepted status)."""

PlatformKey = tuple[str, ...]
"""A collateral scope: ("intel-tcb", tee, fmspc), ("intel-qe", tee), ("intel-pckcrl", ca),
("amd-crl", product); ("intel-platform", tee, fmspc, ca) names what to fetch for a platform."""

_INTEL = (Tee.TDX, Tee.SGX)


def platform_keys(claims: Claims) -> frozenset[PlatformKey]:
    """The collateral scopes these claims' TCB depends on (empty: nothing to re-evaluate)."""
    d = claims.details
    if claims.tee in _INTEL:
        fmspc, ca = d.get("fmspc"), d.get("pck_ca")
        if not isinstance(fmspc, str) or not isinstance(ca, str):
            return frozenset()
        tee = claims.tee.value
        fmspc = fmspc.lower()
        return frozenset(
            {
                ("intel-platform", tee, fmspc, ca),  # what to fetch
                ("intel-tcb", tee, fmspc),
                ("intel-qe", tee),
                ("intel-pckcrl", ca),
            }
        )
    if claims.tee is Tee.SEV_SNP:
        product = d.get("product")
        if isinstance(product, str) and "endorsement_serial" in d:
            return frozenset({("amd-crl", product)})
    return frozenset()


@dataclass(frozen=True, slots=True)
class TcbCollateral:
    """The latest verified collateral per scope (absent scope: keep what the claims say)."""

    intel_tcb: Mapping[tuple[str, str], TcbInfo] = field(default_factory=dict)
    """(tee, fmspc lowercase hex) -> TCB info."""
    intel_qe: Mapping[str, EnclaveIdentity] = field(default_factory=dict)
    """tee -> QE identity."""
    intel_pck_revoked: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """PCK CA ("processor" / "platform") -> revoked PCK certificate serials."""
    amd_revoked: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """AMD product -> serials on its ARK-signed CRL."""


def _int_detail(d: Mapping[str, Detail], key: str) -> int | None:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _hex_int(d: Mapping[str, Detail], key: str) -> int | None:
    v = d.get(key)
    if not isinstance(v, str):
        return None
    try:
        return int(v, 16)
    except ValueError:
        return None


def reevaluate(claims: Claims, coll: TcbCollateral) -> Claims:
    """The claims as the current collateral would have evaluated them (same claims object when
    nothing applies). Only ``tcb_status``, ``advisories`` and TCB ``details`` change."""
    if claims.tee in _INTEL:
        return _reevaluate_intel(claims, coll)
    if claims.tee is Tee.SEV_SNP:
        return _reevaluate_amd(claims, coll)
    return claims


def _merge(*groups: Iterable[str]) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for g in groups:
        for item in g:
            seen.setdefault(item, None)
    return tuple(seen)


def _reevaluate_intel(claims: Claims, coll: TcbCollateral) -> Claims:
    d, tcb, tee = claims.details, claims.tcb, claims.tee.value
    fmspc, ca = d.get("fmspc"), d.get("pck_ca")
    if not isinstance(fmspc, str) or not isinstance(ca, str):
        return claims
    details: dict[str, Detail] = dict(d)
    evaluated = _int_detail(d, "tcb_eval_data_number") or 0
    info = coll.intel_tcb.get((tee, fmspc.lower()))
    if info is not None and info.eval_data_number < evaluated:
        info = None  # older than what the claims saw: never roll back
    ident = coll.intel_qe.get(tee)
    if ident is not None and ident.eval_data_number < evaluated:
        ident = None
    platform = str(d.get("platform_tcb_status", claims.tcb_status or ""))
    module = str(d.get("tdx_module_tcb_status", "")) or None
    qe = str(d.get("qe_tcb_status", "")) or None
    advisories: tuple[str, ...] = claims.advisories
    if info is not None:
        components = tuple(tcb.get(f"sgx_tcb_comp{i:02d}", 0) for i in range(1, 17))
        pck = PckExtension(
            ppid=b"",
            cpu_svn_components=components,
            pce_svn=tcb.get("pce_svn", 0),
            cpu_svn=bytes(components),
            pce_id=bytes.fromhex(str(d.get("pce_id", "0000"))),
            fmspc=bytes.fromhex(fmspc),
            sgx_type=None,
        )
        tee_tcb_svn: bytes | None = None
        if claims.tee is Tee.TDX:
            raw = d.get("tee_tcb_svn")
            if not isinstance(raw, str) or len(raw) != 32:
                return claims
            tee_tcb_svn = bytes.fromhex(raw)
        advisories = ()
        details["tcb_eval_data_number"] = info.eval_data_number
        try:
            level = match_platform_level(info, pck, tee_tcb_svn)
        except EvidenceVerificationError:
            platform, module, advisories = NO_TCB_LEVEL, None, ()
            details["tcb_date"] = ""
        else:
            platform, advisories = level.status, level.advisories
            details["tcb_date"] = level.date
            if tee_tcb_svn is not None:
                module, module_adv = _module_status(info, tee_tcb_svn)
                advisories = _merge(advisories, module_adv)
    if ident is not None:
        qe_svn = tcb.get("qe_svn", 0)
        qe_level = next((lv for lv in ident.levels if lv.isv_svn <= qe_svn), None)
        qe = qe_level.status if qe_level is not None else NO_TCB_LEVEL
        if qe_level is not None:
            advisories = _merge(advisories, qe_level.advisories)
    status = platform
    if status != NO_TCB_LEVEL:
        if module is not None:
            status = NO_TCB_LEVEL if module == NO_TCB_LEVEL else converge_status(status, module)
        if qe is not None and status != NO_TCB_LEVEL:
            status = NO_TCB_LEVEL if qe == NO_TCB_LEVEL else converge_status(status, qe)
    serial = _hex_int(d, "pck_serial")
    revoked = coll.intel_pck_revoked.get(ca)
    if serial is not None and revoked is not None and serial in revoked:
        status = TcbStatus.REVOKED.value
        details["pck_revoked"] = True
    details["platform_tcb_status"] = platform
    details["qe_tcb_status"] = qe or ""
    if claims.tee is Tee.TDX:
        details["tdx_module_tcb_status"] = module or ""
    if status == claims.tcb_status and advisories == claims.advisories and details == dict(d):
        return claims
    return replace(claims, tcb_status=status, advisories=advisories, details=details)


def _module_status(info: TcbInfo, tee_tcb_svn: bytes) -> tuple[str | None, tuple[str, ...]]:
    """The TDX module TCB level (the verifier's ``match_tdx_module`` minus the identity checks,
    which the attestation made and the module's report fields do not change)."""
    version = tee_tcb_svn[1]
    if version == 0 or not info.tdx_module_identities:
        return None, ()
    wanted = f"TDX_{version:02X}"
    for identity in info.tdx_module_identities:
        if identity.id.upper() == wanted:
            for level in identity.levels:
                if level.isv_svn <= tee_tcb_svn[0]:
                    return level.status, level.advisories
            return NO_TCB_LEVEL, ()
    return NO_TCB_LEVEL, ()


def _reevaluate_amd(claims: Claims, coll: TcbCollateral) -> Claims:
    d = claims.details
    product = d.get("product")
    revoked = coll.amd_revoked.get(product) if isinstance(product, str) else None
    if revoked is None:
        return claims
    hit = [
        key
        for key in ("endorsement_serial", "intermediate_serial")
        if (serial := _hex_int(d, key)) is not None and serial in revoked
    ]
    if not hit:
        return claims
    details: dict[str, Detail] = {**d, "revoked_by_crl": ",".join(hit)}
    return replace(claims, tcb_status=TcbStatus.REVOKED.value, details=details)


# Every claim fact ``reevaluate`` reads or rewrites: claims equal in these are re-evaluated
# alike, so the workloads of one platform cost one evaluation (``Reevaluator``).
_TCB_DETAILS = (
    "fmspc", "pck_ca", "pce_id", "pck_serial", "tee_tcb_svn", "tcb_eval_data_number", "tcb_date",
    "platform_tcb_status", "qe_tcb_status", "tdx_module_tcb_status", "pck_revoked", "product",
    "endorsement_serial", "intermediate_serial", "revoked_by_crl",
)  # fmt: skip


def tcb_facts(claims: Claims) -> tuple[object, ...]:
    d = claims.details
    return (
        claims.tee,
        tuple(sorted(claims.tcb.items())),
        tuple(d.get(k) for k in _TCB_DETAILS),
        tuple(k in d for k in _TCB_DETAILS),
        claims.tcb_status,
        claims.advisories,
    )


class Reevaluator:
    """``reevaluate`` against one collateral set, memoised per distinct TCB facts."""

    def __init__(self, coll: TcbCollateral) -> None:
        self._coll = coll
        self._memo: dict[tuple[object, ...], tuple[str | None, tuple[str, ...], dict[str, Detail]]
                         | None] = {}  # fmt: skip

    def __call__(self, claims: Claims) -> Claims:
        key = tcb_facts(claims)
        if key not in self._memo:
            fresh = reevaluate(claims, self._coll)
            self._memo[key] = (
                None
                if fresh is claims
                else (
                    fresh.tcb_status,
                    fresh.advisories,
                    {k: v for k, v in fresh.details.items() if claims.details.get(k, v) != v
                     or k not in claims.details},
                )
            )  # fmt: skip
        hit = self._memo[key]
        if hit is None:
            return claims
        status, advisories, changes = hit
        return replace(
            claims, tcb_status=status, advisories=advisories, details={**claims.details, **changes}
        )


# ---------------------------------------------------------------------------------------------
# AMD CRL (KDS ``/vcek/v1/{product}/crl``): signed by the product's ARK with RSA-PSS SHA-384.


@dataclass(frozen=True, slots=True)
class AmdCrl:
    product: str
    revoked: frozenset[int]
    next_update: datetime


MAX_CRL = MAX_CRL_BYTES


def verify_amd_crl(data: bytes, chains: Sequence[AmdChain], now: datetime) -> AmdCrl:
    """Verify an AMD CRL (DER or PEM, read strictly) against the pinned ARKs (RSASSA-PSS SHA-384,
    salt 48, as the chains); raise EvidenceVerificationError (``collateral_invalid``,
    ``untrusted_root``, ``collateral_signature_invalid``, ``collateral_expired``,
    ``collateral_not_yet_valid``)."""
    crl = parse_crl(
        data,
        lambda detail: EvidenceVerificationError("collateral_invalid", f"AMD CRL: {detail}"),
        max_size=MAX_CRL,
    )
    ark = next((c for c in chains if c.ark_parsed.subject == crl.issuer), None)
    if ark is None:
        raise EvidenceVerificationError(
            "untrusted_root", f"AMD CRL issuer {crl.issuer_text} is not a pinned ARK"
        )
    key = ark.ark_parsed.public_key
    if not isinstance(key, rsa.RSAPublicKey):
        raise EvidenceVerificationError("collateral_invalid", "ARK key is not RSA")
    if not AMD_SIGNATURES.signed(key, crl.signature, crl.tbs):
        raise EvidenceVerificationError("collateral_signature_invalid", "AMD CRL")
    if crl.next_update is None:
        raise EvidenceVerificationError("collateral_invalid", "AMD CRL has no nextUpdate")
    check_window(
        Window(crl.last_update, crl.next_update, "AMD CRL", "AMD CRL"), now, kind="collateral"
    )
    return AmdCrl(product=str(ark.product), revoked=crl.revoked, next_update=crl.next_update)


def amd_products(chains: Sequence[AmdChain]) -> tuple[Product, ...]:
    return tuple(dict.fromkeys(c.product for c in chains))


def digest(*parts: bytes | None) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p or b"").to_bytes(8, "big") + (p or b""))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Re-appraisal and the action a policy asks for


@dataclass(frozen=True, slots=True)
class TcbFinding:
    """Claims on record that a TCB change (collateral or a raised minimum TCB) no longer lets
    the governing policies admit. ``action``/``grace``: what ``onTcbChange`` asks for."""

    workload: str
    evidence_sha256: str
    decision: Rejected
    action: OnTcbChange
    grace: timedelta
    revoked: bool = False

    @property
    def reason(self) -> str:
        return "; ".join(self.decision.reasons)


def tcb_action(
    decision: Rejected, governing: Sequence[AttestationPolicy], now: datetime
) -> tuple[OnTcbChange, timedelta]:
    """The strictest ``onTcbChange`` among the enforcing policies that reject: quarantine wins,
    with the shortest grace period among the quarantining ones."""
    rejecting = set(decision.policy.split(","))
    quarantining = [
        p.tcb_change_grace_period
        for p in governing
        if p.mode is Mode.ENFORCE
        and p.name in rejecting
        and p.on_tcb_change is OnTcbChange.QUARANTINE
    ]
    if quarantining:
        return OnTcbChange.QUARANTINE, min(quarantining)
    return OnTcbChange.AUDIT, timedelta(0)


def reappraise(
    workload: str,
    claims: Claims,
    governing: Sequence[AttestationPolicy],
    coll: TcbCollateral,
    now: datetime,
    evaluate: Callable[[Claims], Claims] | None = None,
) -> TcbFinding | None:
    """Re-evaluate ``claims`` against ``coll`` (or with ``evaluate``, a ``Reevaluator`` of it)
    and appraise them with every enforcing governing policy. A finding when a policy now rejects
    them for TCB reasons (a revoked platform is a finding whatever the policy accepts); None
    when they are still admitted, or when the rejection is not a TCB one (not this module's
    business: ``set_policies`` handles those)."""
    fresh = evaluate(claims) if evaluate is not None else reevaluate(claims, coll)
    enforced = [p for p in governing if p.mode is Mode.ENFORCE]
    rejected = [d for p in enforced if isinstance(d := appraise(fresh, p, now), Rejected)]
    revoked = fresh.tcb_status == TcbStatus.REVOKED
    if not rejected and not revoked:
        return None
    if rejected:
        decision = Rejected(
            tuple(r for d in rejected for r in d.reasons), ",".join(d.policy for d in rejected), now
        )
        if not tcb_change_only(decision) and not revoked:
            return None
    else:
        names = ",".join(p.name for p in enforced)
        decision = Rejected(("tcb_status_not_accepted: Revoked",), names, now)
    action, grace = tcb_action(decision, enforced, now)
    return TcbFinding(workload, claims.evidence_sha256, decision, action, grace, revoked)
