"""Continuous TCB re-evaluation: watch vendor collateral, re-appraise the claims on record.

``TcbMonitor`` keeps an index from collateral scope (Intel TCB info per TEE kind and FMSPC,
QE identity per TEE kind, PCK CRL per CA; AMD CRL per product: ``certs.tcb_reeval``) to the
attested workloads whose claims depend on it, maintained from the control plane's transitions
(O(changed) per transition). ``refresh`` fetches each scope in use through the collateral cache
(which refetches a document at its ``nextUpdate``, or sooner with ``max_age``), verifies it
against the trust roots on a worker thread, and re-appraises only the workloads of the scopes
whose collateral changed, also on a worker thread: the event loop only decides. Findings go to
``ControlPlane.apply_tcb_findings``: per policy ``onTcbChange`` an ``audit`` event + metric, or
a quarantine (after ``tcbChangeGracePeriod``, unless the workload re-attested in between).

Collateral that cannot be fetched (vendor down, nothing cached) or does not verify changes
nothing: it is counted and logged, and the previous collateral stays in force.

``TcbGraceBook`` is the pure bookkeeping of deferred quarantines (their deadlines are in the
workload rows, persisted), held by the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from certs.collateral.amd_kds import KdsCollateralSource
from certs.collateral.intel_pcs import PcsCollateralSource
from certs.collateral.roots import TrustRoots
from certs.errors import AttestmeshError
from certs.evidence.claims import Claims, Tee
from certs.evidence.dcap import DcapVerifier
from certs.evidence.sev_snp import AmdChain, parse_amd_chain
from certs.policy import AttestationPolicy, OnTcbChange, policies_for
from certs.tcb_reeval import (
    PlatformKey,
    Reevaluator,
    TcbCollateral,
    TcbFinding,
    digest,
    platform_keys,
    reappraise,
    reevaluate,
    verify_amd_crl,
)
from xds.state import Event, EventKind, MeshState, Status, TcbDeferral, Trigger

if TYPE_CHECKING:
    from attestmesh.controlplane import ControlPlane
    from attestmesh.metrics import Metrics

log = logging.getLogger(__name__)

MIN_REFRESH = timedelta(seconds=30)
MAX_REFRESH = timedelta(hours=1)

Quarantine = tuple[str, Trigger, str, str, bool]
"""(workload, trigger, detail, reason code, platform failed): ``ControlPlane``'s decision."""


# ---------------------------------------------------------------------------------------------
# deferred quarantines (pure)


@dataclass
class TcbGraceBook:
    """Deadlines of the deferred quarantines on record. The deferral itself lives in the
    workload's row (``WorkloadState.tcb_deferral``: persisted with it, so a restart or another
    replica keeps the original deadline); this is only a heap over those rows, fed with every
    row that changes (``track``). A workload that re-attests (its evidence changes), is
    quarantined or released meanwhile, or whose claims are admitted again by a later
    re-appraisal, loses its deferral and is not quarantined."""

    _heap: list[tuple[datetime, str]] = field(default_factory=list)

    def track(self, state: MeshState, names: Iterable[str]) -> None:
        for name in names:
            w = state.workloads.get(name)
            if w is not None and w.tcb_deferral is not None:
                heapq.heappush(self._heap, (w.tcb_deferral.due, name))

    def decide(
        self, findings: Sequence[TcbFinding], state: MeshState, now: datetime
    ) -> tuple[list[Quarantine], list[Event], dict[str, int], dict[str, TcbDeferral]]:
        """Quarantines to make now, events to record (audit, deferral), outcome counts and the
        deferrals to record (a known one keeps its deadline unless the new one is sooner)."""
        quarantines: list[Quarantine] = []
        events: list[Event] = []
        counts: dict[str, int] = {}
        deferrals: dict[str, TcbDeferral] = {}
        for f in findings:
            if not _still_current(state, f.workload, f.evidence_sha256):
                continue
            trigger = Trigger.TCB_REVOKED if f.revoked else Trigger.TCB_CHANGED
            code = f.decision.reason
            if f.action is OnTcbChange.AUDIT:
                outcome = "audit"
                events.append(
                    Event(
                        EventKind.AUDIT, f.workload, now, f"tcb_changed: {f.reason}", trigger, code
                    )
                )
            elif f.grace <= timedelta(0):
                outcome = "quarantine"
                quarantines.append((f.workload, trigger, f.reason, code, True))
            else:
                outcome = "deferred"
                known = deferrals.get(f.workload) or state.workloads[f.workload].tcb_deferral
                due = now + f.grace if known is None else min(known.due, now + f.grace)
                deferrals[f.workload] = TcbDeferral(
                    due,
                    f.evidence_sha256,
                    f.reason,
                    code,
                    f.revoked or bool(known and known.revoked),
                )
                if known is None:
                    events.append(
                        Event(
                            EventKind.AUDIT,
                            f.workload,
                            now,
                            f"tcb_changed: quarantine at {due.isoformat()} unless it re-attests: "
                            f"{f.reason}",
                            trigger,
                            code,
                        )
                    )
            counts[outcome] = counts.get(outcome, 0) + 1
        return quarantines, events, counts, deferrals

    def due(self, state: MeshState, now: datetime) -> list[Quarantine]:
        """Deferred quarantines whose grace has run out and still apply."""
        out: list[Quarantine] = []
        seen: set[str] = set()
        while self._heap and self._heap[0][0] <= now:
            due, name = heapq.heappop(self._heap)
            w = state.workloads.get(name)
            d = None if w is None else w.tcb_deferral
            if d is None or d.due != due or name in seen:
                continue  # superseded: re-attested, quarantined, dropped or rescheduled
            seen.add(name)
            if _still_current(state, name, d.evidence_sha256):
                trigger = Trigger.TCB_REVOKED if d.revoked else Trigger.TCB_CHANGED
                out.append((name, trigger, d.reason, d.code, True))
        return out


def deferrals_to_drop(state: MeshState, names: Iterable[str]) -> dict[str, None]:
    """Of ``names`` (workloads admitted again), those with a deferred quarantine to drop."""
    return {n: None for n in names if (w := state.workloads.get(n)) is not None and w.tcb_deferral}


def _still_current(state: MeshState, name: str, evidence_sha256: str) -> bool:
    w = state.workloads.get(name)
    return (
        w is not None
        and w.status is Status.ATTESTED
        and w.attestation is not None
        and w.attestation.evidence_sha256 == evidence_sha256
    )


def reappraise_all(
    items: Sequence[tuple[str, Claims, Sequence[AttestationPolicy]]],
    coll: TcbCollateral,
    now: datetime,
) -> tuple[list[TcbFinding], list[str]]:
    """Re-appraise each (workload, claims, governing policies): findings, and the workloads
    still admitted. Pure and CPU-bound: the monitor runs it on a worker thread."""
    findings: list[TcbFinding] = []
    admitted: list[str] = []
    evaluate = Reevaluator(coll)  # the workloads of one platform: one evaluation
    for name, claims, governing in items:
        f = reappraise(name, claims, governing, coll, now, evaluate)
        if f is None:
            admitted.append(name)
        else:
            findings.append(f)
    return findings, admitted


# ---------------------------------------------------------------------------------------------
# the monitor (adapter: fetch, verify, re-appraise off the loop)


class IntelFeed(Protocol):
    async def platform_collateral(
        self, tee: str, fmspc: str, ca: str, now: datetime
    ) -> dict[str, bytes]: ...


class AmdFeed(Protocol):
    async def crl(self, product: str, now: datetime) -> bytes: ...


class PlatformIndex:
    """Collateral scope -> attested workloads depending on it; updated per transition."""

    def __init__(self) -> None:
        self._keys: dict[str, frozenset[PlatformKey]] = {}
        self._by_key: dict[PlatformKey, set[str]] = {}

    def update(self, state: MeshState, changed: Collection[str]) -> None:
        for name in changed:
            w = state.workloads.get(name)
            keys: frozenset[PlatformKey] = frozenset()
            if w is not None and w.status is Status.ATTESTED and w.attestation is not None:
                claims = w.attestation.claims
                keys = platform_keys(claims) if claims is not None else frozenset()
            old = self._keys.get(name, frozenset())
            if old == keys:
                continue
            for k in old - keys:
                members = self._by_key[k]
                members.discard(name)
                if not members:
                    del self._by_key[k]
            for k in keys - old:
                self._by_key.setdefault(k, set()).add(name)
            if keys:
                self._keys[name] = keys
            else:
                self._keys.pop(name, None)

    def scopes(self) -> list[PlatformKey]:
        return sorted(self._by_key)

    def members(self, scopes: Iterable[PlatformKey]) -> set[str]:
        out: set[str] = set()
        for k in scopes:
            out |= self._by_key.get(k, set())
        return out


class TcbMonitor:
    """Watches the collateral of every platform in use and re-appraises on change.

    ``intel_verifier`` / ``amd_chains`` carry the trust roots (parameters, so tests use a test
    root). Without a feed for a vendor its scopes are not watched.
    """

    def __init__(
        self,
        cp: ControlPlane,
        metrics: Metrics,
        clock: Callable[[], datetime],
        *,
        intel: IntelFeed | None = None,
        intel_verifier: DcapVerifier | None = None,
        amd: AmdFeed | None = None,
        amd_chains: Sequence[AmdChain] = (),
        min_refresh: timedelta = MIN_REFRESH,
        max_refresh: timedelta = MAX_REFRESH,
    ) -> None:
        self._cp = cp
        self._metrics = metrics
        self._clock = clock
        self._intel = intel if intel_verifier is not None else None
        self._intel_verifier = intel_verifier
        self._amd = amd
        self._amd_chains = tuple(amd_chains)
        self._min = min_refresh
        self._max = max_refresh
        self._index = PlatformIndex()
        self._seen: dict[PlatformKey, str] = {}
        self._collateral = TcbCollateral()
        self._next_update: dict[PlatformKey, datetime] = {}
        self._lock = asyncio.Lock()
        state = cp.state
        self._index.update(state, list(state.workloads))
        cp.add_state_listener(self._index.update)
        cp.set_tcb_view(self._view)

    @property
    def collateral(self) -> TcbCollateral:
        return self._collateral

    def _view(self, claims: Claims) -> Claims:
        return reevaluate(claims, self._collateral)

    @property
    def index(self) -> PlatformIndex:
        return self._index

    def next_refresh(self, now: datetime) -> datetime:
        """The earliest nextUpdate of the collateral in force, within [min, max] from now."""
        soonest = min(self._next_update.values(), default=now + self._max)
        return min(max(soonest, now + self._min), now + self._max)

    async def refresh(self) -> list[str]:
        """Fetch, verify and diff the collateral of every scope in use; re-appraise the
        workloads of the changed scopes. Returns the workloads quarantined now."""
        async with self._lock:  # one refresh at a time
            changed = await self._fetch_all(self._clock())
            if not changed:
                return []
            return await self._reappraise(changed)

    async def reappraise_scopes(self, scopes: Iterable[PlatformKey]) -> list[str]:
        async with self._lock:
            return await self._reappraise(set(scopes))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.refresh()
            except AttestmeshError as exc:  # e.g. the store failed: the control plane says so
                log.error("TCB re-appraisal failed: %s", exc)
            wait = (self.next_refresh(self._clock()) - self._clock()).total_seconds()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(wait, 1.0))

    # -- fetching -------------------------------------------------------------------------------

    async def _fetch_all(self, now: datetime) -> set[PlatformKey]:
        changed: set[PlatformKey] = set()
        for scope in self._index.scopes():
            if scope[0] == "intel-platform" and self._intel is not None:
                changed |= await self._fetch_intel(scope, now)
            elif scope[0] == "amd-crl" and self._amd is not None:
                changed |= await self._fetch_amd(scope, now)
        return changed

    def _note(self, scope: PlatformKey, body: bytes | None) -> bool:
        d = digest(body)
        if self._seen.get(scope) == d:
            return False
        self._seen[scope] = d
        return True

    async def _fetch_intel(self, scope: PlatformKey, now: datetime) -> set[PlatformKey]:
        _, tee, fmspc, ca = scope
        assert self._intel is not None and self._intel_verifier is not None
        try:
            docs = await self._intel.platform_collateral(tee, fmspc, ca, now)
            verified = await asyncio.to_thread(
                self._intel_verifier.verify_tcb_collateral, docs, now=now
            )
        except AttestmeshError as exc:
            self._count("intel", exc)
            log.warning("Intel collateral for %s/%s/%s not usable: %s", tee, fmspc, ca, exc)
            return set()
        coll = self._collateral
        changed: set[PlatformKey] = set()
        tcb_scope = ("intel-tcb", tee, fmspc)
        if verified.tcb_info is not None and self._note(tcb_scope, docs.get("tcb_info")):
            changed.add(tcb_scope)
            coll = replace(coll, intel_tcb={**coll.intel_tcb, (tee, fmspc): verified.tcb_info})
            self._next_update[tcb_scope] = verified.tcb_info.next_update
        qe_scope = ("intel-qe", tee)
        if verified.qe_identity is not None and self._note(qe_scope, docs.get("qe_identity")):
            changed.add(qe_scope)
            coll = replace(coll, intel_qe={**coll.intel_qe, tee: verified.qe_identity})
            self._next_update[qe_scope] = verified.qe_identity.next_update
        crl_scope = ("intel-pckcrl", ca)
        if verified.pck_crl_revoked is not None and self._note(crl_scope, docs.get("pck_crl")):
            changed.add(crl_scope)
            revoked = {**coll.intel_pck_revoked, ca: verified.pck_crl_revoked}
            coll = replace(coll, intel_pck_revoked=revoked)
            if verified.pck_crl_next_update is not None:
                self._next_update[crl_scope] = verified.pck_crl_next_update
        self._collateral = coll
        self._metrics.tcb_collateral_refreshes.labels(
            "intel", "changed" if changed else "unchanged"
        ).inc()
        return changed

    async def _fetch_amd(self, scope: PlatformKey, now: datetime) -> set[PlatformKey]:
        product = scope[1]
        assert self._amd is not None
        try:
            body = await self._amd.crl(product, now)
            crl = await asyncio.to_thread(verify_amd_crl, body, self._amd_chains, now)
        except (AttestmeshError, ValueError) as exc:
            self._count("amd", exc)
            log.warning("AMD CRL for %s not usable: %s", product, exc)
            return set()
        if crl.product != product:
            self._metrics.tcb_collateral_refreshes.labels("amd", "invalid").inc()
            log.warning("AMD CRL for %s is signed by ARK-%s", product, crl.product)
            return set()
        self._next_update[scope] = crl.next_update
        if not self._note(scope, body):
            self._metrics.tcb_collateral_refreshes.labels("amd", "unchanged").inc()
            return set()
        revoked = {**self._collateral.amd_revoked, product: crl.revoked}
        self._collateral = replace(self._collateral, amd_revoked=revoked)
        self._metrics.tcb_collateral_refreshes.labels("amd", "changed").inc()
        return {scope}

    def _count(self, vendor: str, exc: Exception) -> None:
        reason = getattr(exc, "reason", "")
        outage = reason in ("collateral_unreachable", "collateral_http_status")
        self._metrics.tcb_collateral_refreshes.labels(
            vendor, "unavailable" if outage else "invalid"
        ).inc()

    # -- re-appraisal ---------------------------------------------------------------------------

    async def _reappraise(self, scopes: set[PlatformKey]) -> list[str]:
        names = self._index.members(scopes)
        if not names:
            return []
        state = self._cp.state
        policies = self._cp.policies
        items: list[tuple[str, Claims, Sequence[AttestationPolicy]]] = []
        for name in sorted(names):
            w = state.workloads.get(name)
            if w is None or w.status is not Status.ATTESTED or w.attestation is None:
                continue
            claims = w.attestation.claims
            if claims is None:
                continue
            reg = w.registration
            items.append(
                (
                    name,
                    claims,
                    policies_for(policies, reg.namespace, reg.service_account, reg.labels),
                )
            )
        now = self._clock()
        findings, admitted = await asyncio.to_thread(reappraise_all, items, self._collateral, now)
        log.info(
            "TCB re-appraisal of %d workloads (%s): %d findings",
            len(items),
            ", ".join("/".join(s) for s in sorted(scopes)),
            len(findings),
        )
        return self._cp.apply_tcb_findings(findings, admitted=admitted)


def build_tcb_monitor(
    cp: ControlPlane,
    metrics: Metrics,
    sources: Mapping[Tee, object],
    roots: TrustRoots,
    clock: Callable[[], datetime],
) -> TcbMonitor | None:
    """The monitor for the online collateral sources the control plane was given (Intel PCS
    for TDX/SGX, AMD KDS for SEV-SNP), anchored at the same roots as the verifiers; None when
    there is no online source (collateral then only comes with the evidence)."""
    intel = next(
        (s for t in (Tee.TDX, Tee.SGX) if isinstance(s := sources.get(t), PcsCollateralSource)),
        None,
    )
    amd = sources.get(Tee.SEV_SNP)
    amd = amd if isinstance(amd, KdsCollateralSource) else None
    if intel is None and amd is None:
        return None
    return TcbMonitor(
        cp,
        metrics,
        clock,
        intel=intel,
        intel_verifier=DcapVerifier(roots.intel_sgx_root) if intel is not None else None,
        amd=amd,
        amd_chains=[parse_amd_chain(c) for c in roots.amd_chains] if amd is not None else (),
    )
