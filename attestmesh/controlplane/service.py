"""The control plane service: holds mesh state and applies transitions.

Every transition is persisted (``StateStore.save``) before it is announced (``Publisher``:
xDS snapshots; Kubernetes actions), metrics follow. Time and randomness are injected.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import hmac
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol, TypeVar

from attestmesh.controlplane.identity import RegistrationTokenCheck
from attestmesh.controlplane.issued import Issued
from attestmesh.controlplane.limiter import AttestationLimiter
from attestmesh.controlplane.ports import (
    Clock,
    CollateralSource,
    IdentityCheck,
    Publisher,
    Replication,
)
from attestmesh.controlplane.workers import (
    OffloadUnavailable,
    WorkerLost,
    WorkerProcesses,
    WorkerThreads,
)
from attestmesh.metrics import Metrics
from attestmesh.tcb_monitor import TcbGraceBook, deferrals_to_drop
from certs.ca import CertificateAuthority, Issuer, Leaf, SigningMaterial, rotation_step
from certs.errors import AttestmeshError, CollateralError, PolicyError
from certs.evidence.claims import Claims, TcbStatus, Tee, Verifier
from certs.issuance import AttestRequest, EvidenceRejected
from certs.nonces import NonceBook, NonceError
from certs.offload import Job, verify_and_sign
from certs.policy import (
    DEFAULT_REATTESTATION,
    Admitted,
    AttestationPolicy,
    Rejected,
    appraise_all,
    audit_findings,
    parse_policies,
    policies_for,
    tcb_change_only,
)
from certs.tcb_reeval import TcbFinding, tcb_action
from xds.build import TrustMaterial
from xds.meshpolicy import MeshPolicy
from xds.state import (
    AttestationRecord,
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    Registration,
    Revocation,
    Status,
    TcbDeferral,
    Trigger,
    WorkloadState,
    ensure_may_issue,
    prune_revocations,
    quarantine,
    record_attestation,
    register_all,
    release,
    set_tcb_deferrals,
    unregister,
    with_rows,
    withdraw,
)
from xds.store import Batch, StateStore, StoreConflict
from xds.store_pg import Changes

log = logging.getLogger(__name__)
CRL_VALIDITY = timedelta(hours=24)
# Revocations that need not go out with their transition (a renewal's superseded certificate:
# its workload is attested and holds the newer one) are gathered this long, then the CRL set is
# re-signed once for all of them, off the loop. Every CRL change is sent to every stream (the
# trust secret), so renewals at any rate cost at most one mesh-wide CRL push per interval; a
# quarantine (or any revocation of a workload no longer attested) still goes out at once, with
# every revocation gathered so far.
CRL_COALESCE = timedelta(seconds=5)
# asyncio's default pool size: a pool as small as the core count (tried: 2 on 2 cores, to
# leave the loop the GIL more often) measured fewer attestations per second at 8 and 64 clients
# and no better /healthz on the shared machine (``cryptography`` 50 releases the GIL while
# it verifies and signs, measured: two threads verify in the wall time of one; the Python
# around those calls holds it). One thread cut how late the loop ran in
# process (benchmarks/bench_attest.py, 64 at a time: p99 105 -> 39 ms), but in the real process
# (benchmarks/bench_issuance.py, 3 alternating runs) it did 123-145 attestations/s at 64 clients
# against 218-228 and /healthz p99 was 259-467 ms against 132-201.
CRYPTO_THREADS = min(32, (os.cpu_count() or 1) + 4)
# Attestations past their identity, nonce and collateral checks wait here for one of this many
# places; verification, signing and the decision (its write queued) run in one, the wait for the
# group commit does not. The crypto holds the GIL, so the rate needs only a few in flight; with
# 64 clients all admitted at once each loop iteration ran dozens of attestations' steps, and
# /healthz and ADS waited that long (p99 160-220 ms at 64 clients, bench_issuance).
ISSUING = 8
_T = TypeVar("_T")
# A vendor service that is down or answers with an error is not the workload's failure: the
# request fails (HTTP 503, the agent retries) but never quarantines; the re-attestation deadline
# stays the backstop.
COLLATERAL_OUTAGE = frozenset({"collateral_unreachable", "collateral_http_status"})
# A failed CA rotation step (disk full, unreadable root key) is retried this much later; the
# signing intermediate has months left when rotation starts.
CA_ROTATION_RETRY = timedelta(minutes=1)
PRUNE_EVERY = timedelta(minutes=1)
# a quarantine the store refused (another replica changed the row first) is decided again on
# the stored row up to this many times
QUARANTINE_RETRIES = 8
# A replica refuses a name it does not hold only after its change feed read once more (the
# agent of a workload registered through another replica may reach this one first): at most
# this long (the feed reads at least every 0.5 s while connected; after a lost connection it
# reads when it connects again, every 0.5 s)
FEED_WAIT_S = 2.0
# Appraisal reason codes (certs.policy's vocabulary) that, on authentic evidence, indict the
# platform (firmware / TCB per vendor collateral), not only the workload: its node is marked.
PLATFORM_APPRAISAL_REASONS = frozenset({"tcb_status_not_accepted", "tcb_below_minimum"})
TCB_REASONS = frozenset({"tcb_status_not_accepted"})


@dataclass(frozen=True, slots=True)
class _Announcement:
    state: MeshState
    trust: TrustMaterial
    changed: frozenset[str]
    events: tuple[Event, ...]
    gen: int = 0  # the transition (counted by _apply) whose state this is
    # decide again on the rows stored now, should the store refuse this one (StoreConflict)
    retry: Callable[[], object] | None = None


class CrlSource(Protocol):
    """The one CRL set of several replicas on one database (``attestmesh.replication``'s
    ``CrlSource``, implemented by its ``CrlSigner``: the leader signs it, every replica serves
    it). With one, the control plane serves ``current()`` and signs no CRL itself, except
    while it is None (a database no leader has stored a CRL set in yet); it learns of a new
    one through ``ControlPlane.crl_delivered``."""

    def current(self) -> bytes | None: ...


class StoreUnavailableError(AttestmeshError):
    """A write to the state store failed: the control plane stops deciding until restarted."""


class ControlPlane:
    def __init__(
        self,
        *,
        state: MeshState,
        store: StateStore,
        ca: CertificateAuthority,
        verifiers: Mapping[Tee, Verifier],
        policies: Sequence[AttestationPolicy],
        mesh_policies: Sequence[MeshPolicy],
        metrics: Metrics,
        publisher: Publisher,
        clock: Clock,
        serials: Callable[[], int],
        random_bytes: Callable[[int], bytes],
        identity: IdentityCheck | None = None,
        collateral_sources: Mapping[Tee, CollateralSource] | None = None,
        limiter: AttestationLimiter | None = None,
        replication: Replication | None = None,
        crl_source: CrlSource | None = None,
        processes: WorkerProcesses | None = None,
    ) -> None:
        self._state = state
        self._store = store
        self._replication = replication
        self._crl_source = crl_source
        self._ca = ca
        self._verifiers = dict(verifiers)
        self._policies = tuple(policies)
        self._mesh_policies = tuple(mesh_policies)
        self._metrics = metrics
        self._publisher = publisher
        self._clock = clock
        self._serials = serials
        self._random = random_bytes
        # (the composition root passes the check it wants; this default serves in-process use)
        self._identity = identity or RegistrationTokenCheck(allow_tokenless=True)
        self._collateral = dict(collateral_sources or {})
        self._nonces = NonceBook(key=random_bytes(32))  # stateless nonces: nothing to exhaust
        # the one nonce offered to each workload with its certificate (its next attestation's)
        self._offered: dict[str, bytes] = {}
        # CRLs re-signed off the loop, coalesced (``_crl_due``)
        self._crl_task: asyncio.Task[None] | None = None
        self._crl_dirty = False
        self._crl_builds = 0  # CRL sets built on the loop (a newer one wins over a thread's)
        # verification, signing and CRLs run on threads of their own (``CRYPTO_THREADS``)
        self._crypto = WorkerThreads(CRYPTO_THREADS, "attest-crypto")
        # attestations' verification and signing in worker processes, when given and ready
        self._procs = processes
        self._signing: tuple[CertificateAuthority | None, SigningMaterial | None] = (None, None)
        # at most ISSUING attestations between verification and their durable answer
        self._issuing = asyncio.Semaphore(ISSUING)
        self._crl_at: datetime | None = None
        self._ca_retry_at: datetime | None = None
        self._limiter = limiter or AttestationLimiter()
        self._store_failed: str | None = None
        self._last_write: asyncio.Future[None] | None = None
        self._pending: _Announcement | None = None
        self._gen = 0  # transitions applied
        # rows adopted from the store (another replica's), newer than the states of
        # announcements decided before: name -> (gen adopted at, row or None: gone)
        self._adopted: dict[str, tuple[int, WorkloadState | None]] = {}
        # gens of this replica's decisions not announced yet (their writes in flight, or
        # pending): an adopted row is kept in _adopted only while one of them predates it
        self._undelivered: set[int] = set()
        self._inflight: dict[str, int] = {}  # name -> this replica's batches not yet resolved
        self._skipped: set[str] = set()  # others' changes left alone while a write was in flight
        self._rereads: set[asyncio.Task[None]] = set()
        # rows being read again (``_reread``): how many reads each, and the feed delivery that
        # last carried it meanwhile (a row the feed delivered during the read is at least as
        # new as the one read, or older than one it delivers later: the read loses)
        self._rereading: dict[str, int] = {}
        self._fed_at: dict[str, int] = {}
        self._feed_tick = 0
        self._pruned_at: datetime | None = None
        self._tcb_grace = TcbGraceBook()  # TCB findings waiting out tcbChangeGracePeriod
        self._tcb_grace.track(state, state.workloads)  # their deadlines are in the rows
        # claims on record as the collateral in force evaluates them (the TCB monitor's)
        self._tcb_view: Callable[[Claims], Claims] = lambda claims: claims
        self._listeners: list[Callable[[MeshState, Collection[str]], None]] = []
        self._adoption_listeners: list[Callable[[MeshState, MeshState, Collection[str]], None]] = []
        self._quarantined = sum(w.status is Status.QUARANTINED for w in state.workloads.values())
        self._due: list[tuple[datetime, str]] = [
            (w.next_attestation_due, n)
            for n, w in state.workloads.items()
            if w.status is Status.ATTESTED and w.next_attestation_due is not None
        ]
        heapq.heapify(self._due)
        self._trust = self._build_trust(clock())
        self._update_gauges()
        self._announced = state
        self._publisher.publish(state, self._mesh_policies, self._trust)  # the loaded state

    # -- reads --------------------------------------------------------------------------------
    @property
    def state(self) -> MeshState:
        return self._state

    @property
    def trust(self) -> TrustMaterial:
        return self._trust

    @property
    def mesh_policies(self) -> tuple[MeshPolicy, ...]:
        return self._mesh_policies

    @property
    def leads(self) -> bool:
        """This replica does the leader's work (CA rotation, revocation pruning; on PostgreSQL
        also the CRL): always, alone on SQLite."""
        return self._replication is None or self._replication.is_leader()

    @property
    def policies(self) -> tuple[AttestationPolicy, ...]:
        return self._policies

    @property
    def processes(self) -> WorkerProcesses | None:
        """The worker processes attestations are verified and signed in (None: threads)."""
        return self._procs

    @property
    def verifiers(self) -> Mapping[Tee, Verifier]:
        """The configured evidence verifiers (the KBS endpoint verifies with the same)."""
        return self._verifiers

    @property
    def ca(self) -> CertificateAuthority:
        return self._ca

    def status_of(self, workload: str) -> Status:
        return self._state.get(workload).status

    def trust_json(self) -> dict[str, str]:
        return {
            "trust_bundle": self._trust.bundle_pem.decode(),
            "crl": self._trust.crl_pem.decode(),
        }

    # -- transitions --------------------------------------------------------------------------
    def _apply(
        self,
        new: MeshState,
        events: Sequence[Event],
        changed: Collection[str],
        retry: Callable[[], object] | None = None,
    ) -> asyncio.Future[None] | None:
        """Make ``new`` the state decisions see now; persist the rows of ``changed`` and the
        events (one batch); announce once they are durable. Returns what to await for
        durability (None: durable already). Announcements of batches made durable together
        are coalesced into one publish.

        The batch expects the rows of ``changed`` as this replica has them now: if another
        replica changed one first, the store refuses the batch (``StoreConflict``), the rows
        stored now are adopted and ``retry`` (if any) decides again on them."""
        if self._store_failed is not None:
            raise StoreUnavailableError(
                "store_unavailable", f"the state store failed: {self._store_failed}"
            )
        old = self._state
        upserts = {n: w for n in changed if (w := new.workloads.get(n)) is not None}
        deletes = frozenset(n for n in changed if n not in new.workloads)
        added = new.revocations[len(old.revocations) :]
        expect = {n: old.workloads.get(n) for n in changed}
        batch = Batch(upserts, deletes, added, events=tuple(events), expect=expect)
        for name in changed:
            before, after = old.workloads.get(name), new.workloads.get(name)
            self._quarantined += (after is not None and after.status is Status.QUARANTINED) - (
                before is not None and before.status is Status.QUARANTINED
            )
        self._state = new
        for name in changed:
            self._track_deadline(name)
        self._notify(self._listeners, new, changed)
        if added:
            if any(_revokes_now(new, r) for r in added):  # with this transition's announcement
                self._trust = self._build_trust(self._clock())
            else:  # superseded or withdrawn certificates: off the loop, coalesced
                self._crl_due()
        self._metrics.quarantined.set(self._quarantined)
        self._gen += 1
        announce = _Announcement(
            new, self._trust, frozenset(changed), tuple(events), self._gen, retry
        )
        self._undelivered.add(announce.gen)
        try:
            durable = self._store.write(batch)
        except StoreConflict as exc:  # a synchronous store
            self._conflicted(exc, announce)
            raise
        if durable is None:
            self._announce(announce)
            return None
        self._last_write = durable
        for name in announce.changed:
            self._inflight[name] = self._inflight.get(name, 0) + 1
        durable.add_done_callback(lambda f: self._committed(f, announce))
        return durable

    def _committed(self, durable: asyncio.Future[None], announce: _Announcement) -> None:
        for name in announce.changed:
            left = self._inflight.get(name, 0) - 1
            if left > 0:
                self._inflight[name] = left
            else:
                self._inflight.pop(name, None)
        settled = [n for n in announce.changed if n in self._skipped and n not in self._inflight]
        if settled:  # another replica's change to these arrived meanwhile: read them again
            self._skipped.difference_update(settled)
            task = asyncio.get_running_loop().create_task(self._reread(settled))
            self._rereads.add(task)
            task.add_done_callback(self._rereads.discard)
        if not durable.cancelled() and isinstance(durable.exception(), StoreConflict):
            self._conflicted(durable.exception(), announce)  # type: ignore[arg-type]
            return
        if durable.cancelled() or durable.exception() is not None:
            exc = durable.exception() if not durable.cancelled() else "cancelled"
            # Fail-stop: the decided state is ahead of the durable one. Serve nothing more that
            # depends on it; the health check fails and a restart loads what is durable.
            self._store_failed = str(exc)
            self._undelivered.discard(announce.gen)
            log.critical("state store write failed; refusing further transitions: %s", exc)
            return
        pending = self._pending
        if pending is None:
            self._pending = announce
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._undelivered.discard(pending.gen)  # announced as part of this one
            self._pending = _Announcement(
                announce.state,
                announce.trust,
                pending.changed | announce.changed,
                pending.events + announce.events,
                announce.gen,
            )

    def _conflicted(self, conflict: StoreConflict, announce: _Announcement) -> None:
        """The store refused a decision: another replica changed its rows first. Adopt the
        rows stored now (this replica's view of them was stale), announce them, and decide
        again if the decision says how."""
        log.warning("decision refused by the store, rows adopted: %s", conflict.detail)
        self._undelivered.discard(announce.gen)  # never announced
        self.adopt_rows(conflict.current)
        if announce.retry is not None:
            try:
                announce.retry()
            except AttestmeshError as exc:
                log.warning("deciding again after a conflict failed: %s", exc)

    def adopt_changes(self, changes: Changes, *, fed: bool = True) -> None:
        """What other replicas committed (``xds.store_pg.ChangeFeed``), on the loop: their
        rows and revocations become this replica's view and are announced (xDS, CRL). A row
        this replica has a write in flight for is left alone: that write either commits (it
        was decided on the stored row) or is refused and adopts the stored row then.
        ``fed``: from the change feed (not ``_reread``'s direct read)."""
        mine = self._state.workloads
        if fed and self._rereading:  # a read of these rows in flight now reads an older row
            self._feed_tick += 1
            carried = (
                mine.keys() | changes.workloads.keys() if changes.resync else changes.workloads
            )
            for name in self._rereading.keys() & carried:
                self._fed_at[name] = self._feed_tick
        rows = {
            n: w
            for n, w in changes.workloads.items()
            if n not in self._inflight and mine.get(n) != w
        }
        unrevoked = changes.unrevoked
        if changes.resync:  # everything stored was delivered: the rest is gone
            rows.update(
                (n, None) for n in mine if n not in changes.workloads and n not in self._inflight
            )
            unrevoked = frozenset(
                {r.serial for r in self._state.revocations} - {r.serial for r in changes.revoked}
            )
        self._skipped.update(n for n in changes.workloads if n in self._inflight)
        if changes.resync:
            self._skipped.update(n for n in mine if n in self._inflight)
        self.adopt_rows(rows, changes.revoked, unrevoked)
        if changes.ca:
            self.reload_ca()

    async def _reread(self, names: Sequence[str]) -> None:
        """Rows another replica changed while this one had a write in flight for them: that
        write has resolved; adopt the rows as stored now (unless a write is in flight again:
        then the same happens when it resolves)."""
        if self._replication is None:
            return
        began = self._feed_tick
        for name in names:
            self._rereading[name] = self._rereading.get(name, 0) + 1
        try:
            rows = await asyncio.to_thread(self._replication.load_rows, names)
        except AttestmeshError as exc:
            log.warning("cannot read %d changed rows again: %s", len(names), exc)
            self._skipped.update(names)
            return
        finally:
            # the feed delivered these while the read ran: it holds them as new, or newer
            # (the read has no feed position: adopting it could take a row back)
            superseded = {n for n in names if self._fed_at.get(n, began) > began}
            for name in names:
                left = self._rereading[name] - 1
                if left:
                    self._rereading[name] = left
                else:
                    del self._rereading[name]
                    self._fed_at.pop(name, None)
        rows = {n: w for n, w in rows.items() if n not in superseded}
        self.adopt_changes(Changes((0, 0), rows), fed=False)

    def adopt_rows(
        self,
        rows: Mapping[str, WorkloadState | None],
        revoked: Sequence[Revocation] = (),
        unrevoked: Collection[int] = (),
    ) -> None:
        """Make durable rows written elsewhere (another replica) this replica's view: the
        state decisions see, the deadlines, the CRL, and (coalesced) the next announcement."""
        have = self._state.revocations
        revoked = [r for r in revoked if not have.revokes(r.serial)]
        unrevoked = frozenset(s for s in unrevoked if have.revokes(s))
        if revoked or unrevoked:
            kept = have.without(unrevoked).added(revoked)
            self._state = replace(self._state, revocations=kept)
            self._trust = self._build_trust(self._clock())
        elif not rows:
            return
        old = self._state
        for name, w in rows.items():
            before = old.workloads.get(name)
            self._quarantined += (w is not None and w.status is Status.QUARANTINED) - (
                before is not None and before.status is Status.QUARANTINED
            )
        self._state = with_rows(old, rows)
        for name, w in rows.items():
            self._track_deadline(name)
            if w is None or w.status is not Status.ATTESTED:  # quarantined, released or gone
                self._offered.pop(name, None)  # on another replica: as if done here
        self._notify(self._listeners, self._state, tuple(rows))
        self._notify(self._adoption_listeners, old, self._state, tuple(rows))
        self._metrics.quarantined.set(self._quarantined)
        self._adopted.update((n, (self._gen, w)) for n, w in rows.items())
        announce = _Announcement(self._announced, self._trust, frozenset(rows), (), -1)
        pending = self._pending
        if pending is None:
            self._pending = announce
            with contextlib.suppress(RuntimeError):  # no loop: announce now
                asyncio.get_running_loop().call_soon(self._flush)
                return
            self._flush()
        else:
            self._pending = replace(
                pending, trust=self._trust, changed=pending.changed | announce.changed
            )

    def _flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._announce(pending)

    def _announce(self, a: _Announcement) -> None:
        state, changed = a.state, a.changed
        if self._adopted:  # rows adopted after this state was decided replace its own
            newer = {n: w for n, (gen, w) in self._adopted.items() if gen >= a.gen}
            if newer:
                state = with_rows(state, newer)
                changed = changed | frozenset(newer)
        self._undelivered.discard(a.gen)
        if self._adopted:
            # announced from now on: a row adopted before every decision not yet announced
            # is in each of their states (decided from it); only newer rows are kept (a
            # replica that mostly adopts kept every row the feed ever delivered, and overlaid
            # and re-announced all of them with each fed batch)
            oldest = min(self._undelivered, default=self._gen + 1)
            self._adopted = {n: v for n, v in self._adopted.items() if v[0] >= oldest}
        self._announced = state
        # the newest CRL set, always: a state decided before revocations were adopted or
        # signed still gets them (the CRL never goes back); revoking early is the safe side
        self._publisher.publish(state, self._mesh_policies, self._trust, changed)
        if a.events:
            self._publisher.on_events(state, a.events)

    async def flushed(self) -> None:
        """Wait until every transition decided so far is durable (and so announced); one the
        store refused (another replica's rows were adopted) counts as done."""
        while (last := self._last_write) is not None:
            with contextlib.suppress(StoreConflict):
                await asyncio.shield(last)
            if self._last_write is last:
                break
        await self.crl_settled()

    @property
    def healthy(self) -> bool:
        return self._store_failed is None

    @property
    def ready(self) -> bool:
        """Healthy and, with several replicas, in contact with the database (/readyz)."""
        return self.healthy and (self._replication is None or self._replication.in_contact())

    async def recover_store(self) -> bool:
        """After a failed write (the database restarted, say), with several replicas: once
        the database answers again, what is durable becomes this replica's view (decisions
        it made that never became durable are dropped, like at a restart) and it decides
        again. True if it recovered now."""
        if self._store_failed is None or self._replication is None:
            return False
        try:
            state = await asyncio.to_thread(self._replication.load_state)
        except AttestmeshError as exc:
            log.warning("the state store is still unavailable: %s", exc)
            return False
        mine = self._state
        rows: dict[str, WorkloadState | None] = {
            n: w for n, w in state.workloads.items() if mine.workloads.get(n) != w
        }
        rows.update((n, None) for n in mine.workloads if n not in state.workloads)
        stored = {r.serial for r in state.revocations}
        self._inflight.clear()
        self._undelivered.clear()  # (decisions that never became durable are never announced)
        self.adopt_rows(
            rows,
            state.revocations,
            frozenset(r.serial for r in mine.revocations if r.serial not in stored),
        )
        self._store_failed = None
        self._last_write = None
        log.warning("state store recovered: %d rows reloaded, deciding again", len(rows))
        return True

    def _republish(self) -> None:
        """The trust material or mesh policies changed (not the workloads): announce now;
        nothing to persist (both are rebuilt from durable inputs on start)."""
        self._publisher.publish(self._announced, self._mesh_policies, self._trust, ())

    def _shared_crl(self) -> bytes | None:
        """The replicas' one CRL set, if there is a source and it has one yet."""
        return None if self._crl_source is None else self._crl_source.current()

    def _build_trust(self, now: datetime) -> TrustMaterial:
        """A new CRL set, now, on the loop (a quarantine's revocations go out with it). With
        a CRL source that has one, the shared set instead: this replica signs nothing (the
        leader's signer covers this replica's revocations once they are committed, within
        its settle time and one step, and delivers the set through ``crl_delivered``)."""
        shared = self._shared_crl()
        if shared is not None:
            return TrustMaterial(self._ca.bundle_pem, shared)
        revoked = [(r.serial, r.revoked_at) for r in self._state.revocations]
        self._crl_at = now
        self._crl_builds += 1
        self._metrics.crl_signed.labels("local").inc()
        return TrustMaterial(self._ca.bundle_pem, self._ca.crl_pem(revoked, now, CRL_VALIDITY))

    def crl_delivered(self, pem: bytes) -> None:
        """The CRL source has a new CRL set (on the loop: the wiring hands it over from the
        signer's thread): serve it from now on and announce it (the trust fan-out)."""
        if pem == self._trust.crl_pem:
            return
        self._crl_builds += 1  # a local set still being signed off the loop is dropped
        self._crl_at = self._clock()
        self._trust = TrustMaterial(self._ca.bundle_pem, pem)
        self._republish()

    def _crl_due(self) -> None:
        """Revocations that need not go out with their transition (a renewal superseded the
        workload's older certificate): the CRL set is re-signed on a worker thread once per
        ``CRL_COALESCE`` for every revocation made meanwhile (renewals at any rate cost one
        signature per CRL and one mesh-wide push per interval, not one per renewal), then
        announced. Without a running loop (synchronous use) it is built at once."""
        if self._shared_crl() is not None:
            return  # the leader's signer covers superseded certificates too
        self._crl_dirty = True
        if self._crl_task is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._crl_dirty = False
            self._trust = self._build_trust(self._clock())
            return
        self._crl_task = loop.create_task(self._sign_crls())

    async def _sign_crls(self) -> None:
        try:
            while self._crl_dirty:
                await asyncio.sleep(CRL_COALESCE.total_seconds())
                self._crl_dirty = False
                ca, builds, now = self._ca, self._crl_builds, self._clock()
                revoked = [(r.serial, r.revoked_at) for r in self._state.revocations]
                try:
                    crl = await self._off_loop(ca.crl_pem, revoked, now, CRL_VALIDITY)
                except Exception:  # (an HSM, say): the next interval signs again, so a
                    # superseded certificate is not left accepted until the next revocation
                    log.exception("re-signing the CRL set failed; retrying in %s", CRL_COALESCE)
                    self._crl_dirty = True
                    continue
                if self._ca is not ca or self._crl_builds != builds:
                    # rotated, or a newer set was built on the loop (or delivered by the CRL
                    # source) meanwhile: that one (or the next round, if revocations followed
                    # it) stands
                    continue
                self._metrics.crl_signed.labels("local").inc()
                self._crl_at = now
                self._trust = TrustMaterial(ca.bundle_pem, crl)
                self._republish()
        except Exception:
            log.exception("announcing the re-signed CRL set failed; the next revocation retries")
            self._crl_dirty = False
        finally:
            self._crl_task = None

    async def _off_loop(self, fn: Callable[..., _T], *args: object) -> _T:
        return await self._crypto.run(fn, *args)

    async def crl_settled(self) -> None:
        """Wait until revocations made so far are in the announced CRL set."""
        while (task := self._crl_task) is not None:
            await asyncio.shield(task)

    def _update_gauges(self) -> None:
        self._metrics.quarantined.set(self._quarantined)
        expiry = self._ca.intermediate.cert.not_valid_after_utc
        self._metrics.ca_intermediate_expiry.set(expiry.timestamp())

    def register(
        self, regs: Sequence[Registration], attempt: int = 0
    ) -> asyncio.Future[None] | None:
        state, events, changed = register_all(self._state, regs, self._clock())
        if not changed:
            return None

        def again() -> object:  # another replica registered first: compare with its rows
            return self.register(regs, attempt + 1)

        return self._apply(state, events, changed, again if attempt < QUARANTINE_RETRIES else None)

    def challenge(self) -> tuple[bytes, datetime]:
        """A fresh authenticated nonce and its expiry; issuing keeps no state."""
        return self._nonces.issue(self._clock(), self._random)

    async def authenticate(self, workload: str, token: str | None) -> Status:
        """The workload's status, once the caller proved to be it. Raises UnknownWorkloadError
        or IdentityError (the API answers both alike); changes nothing."""
        w = await self._registered(workload)
        await self._identity.check(w.registration, token)
        return self._state.get(workload).status  # fresh: the check awaited

    async def attest(self, req: AttestRequest, token: str | None) -> Issued:
        """Verify, appraise and issue; answer once the decision is durable.

        Verification, appraisal and signing run on a worker thread, never on the event loop.
        Only authentic evidence (it verifies to the vendor root and binds this request's nonce
        and key) that policy rejects quarantines an attested workload; evidence that does not
        verify is a refused request (counted, logged, an event) and changes nothing. Request
        errors (identity, nonce, CSR) never quarantine."""
        started = time.perf_counter()
        now = self._clock()
        w = await self._registered(req.workload)
        await self._identity.check(w.registration, token)
        # its budget first: every nonce consumed stays in the mesh's one replay set until it
        # expires, so a workload looping on fresh challenges (a valid or stolen token) must
        # be stopped before that fills (nonce_capacity for every workload)
        self._limiter.take(req.workload, now)
        self._consume_nonce(req.workload, req.nonce, now)
        ensure_may_issue(self._state, req.workload)
        if self._replication is not None and not self._replication.in_contact():
            raise StoreUnavailableError(  # fail closed: another replica may have decided
                "store_unavailable", "this replica is cut off from the database; retry"
            )
        reg = w.registration
        governing = policies_for(self._policies, reg.namespace, reg.service_account, reg.labels)
        interval = min((p.reattestation_interval for p in governing), default=DEFAULT_REATTESTATION)
        spiffe = reg.spiffe_id(self._state.trust_domain)
        ca = self._ca
        try:
            collateral = await self._collateral_for(req, now)
        except EvidenceRejected as exc:
            self._refused(req.workload, exc, now)
            raise
        full = req if collateral is None else replace(req, collateral=collateral)
        # (after the collateral: a slow vendor service holds no place in the gate)
        await self._issuing.acquire()
        place = _Place(self._issuing)
        try:
            return await self._issue(full, now, governing, interval, spiffe, ca, started, place)
        finally:
            place.leave()

    async def _registered(self, name: str) -> WorkloadState:
        """The workload's row, or UnknownWorkloadError. On a replica, a name it does not hold
        is looked for once more after its change feed has read again (``FEED_WAIT_S`` at
        most; requests waiting then share one read): registered through another replica a
        moment ago, its agent may reach this one first. Nothing is read on a caller's word:
        the feed's next read is the one it makes anyway."""
        w = self._state.workloads.get(name)
        if w is None and self._replication is not None:
            fed = True
            try:
                async with asyncio.timeout(FEED_WAIT_S):
                    await self._replication.caught_up()
            except TimeoutError:  # the feed did not read (cut off): refused as unknown
                fed = False
            w = self._state.workloads.get(name)
            self._metrics.unknown_names.labels(
                "found" if w is not None else "unknown" if fed else "feed_unavailable"
            ).inc()
        return w if w is not None else self._state.get(name)  # (raises for an unknown one)

    async def _issue(
        self,
        req: AttestRequest,
        now: datetime,
        governing: Sequence[AttestationPolicy],
        interval: timedelta,
        spiffe: str,
        ca: CertificateAuthority,
        started: float,
        place: _Place,
    ) -> Issued:
        """``attest`` from verification to the durable answer; the ``place`` in the issuing
        gate is given back once the decision is made and its write queued (waiting for the
        group commit takes no CPU: the next attestation may be verified meanwhile)."""
        ensure_may_issue(self._state, req.workload)  # quarantined while it waited: refused now
        try:
            admitted, leaf = await self._verify_and_sign(req, governing, ca, spiffe, now)
        except EvidenceRejected as exc:
            self._refused(req.workload, exc, now)
            raise
        serial = leaf.serial
        not_after = leaf.not_after
        due = min(now + interval, not_after)
        record = AttestationRecord(
            tee=admitted.claims.tee.value,
            measurements=dict(admitted.claims.measurements),
            policy=admitted.policy,
            evidence_sha256=admitted.claims.evidence_sha256,
            at=now,
            claims=admitted.claims,
        )
        before = self._state.get(req.workload)  # fresh: the awaits above
        state, events = record_attestation(
            self._state, req.workload, record, IssuedCert(serial, not_after), due, now
        )
        for finding in audit_findings(admitted.claims, governing, now):
            self._metrics.audit_findings.labels(finding.reason).inc()
            events.append(Event(EventKind.AUDIT, req.workload, now, "; ".join(finding.reasons)))
        durable = self._apply(state, events, (req.workload,))
        issued = Issued(
            chain_pem=leaf.chain_pem,
            bundle_pem=ca.bundle_pem,
            serial=serial,
            not_after=not_after,
            renew_after=now + (not_after - now) / 2,
            reattest_by=due,
            spiffe_id=spiffe,
            claims=admitted.claims,
            workload=req.workload,
            before=before,
        )
        place.leave()
        if durable is not None:
            try:
                await asyncio.shield(durable)  # nothing is acknowledged before it is durable
            except asyncio.CancelledError:  # the client went away: nobody will hold this key
                self.withdraw(issued)
                raise
            except StoreConflict:
                # Another replica changed this workload while it was appraised here (its rows
                # are adopted now): nothing was recorded, the certificate is never handed out.
                ensure_may_issue(self._state, req.workload)  # quarantined meanwhile: refused
                raise StoreUnavailableError(
                    "store_unavailable",
                    f"{req.workload} changed on another replica during this attestation; retry",
                ) from None
            # Quarantined (or gone) while the answer waited for the store: the quarantine
            # revoked this certificate; neither it nor a nonce that would outlive the
            # quarantine is handed out. Nor a certificate revoked otherwise meanwhile (a
            # quarantine and a release, superseded by later attestations).
            current = ensure_may_issue(self._state, req.workload)
            if all(c.serial != serial for c in current.certificates):
                if not self._state.revocations.revokes(serial):
                    # not revoked: the state was restored from the store (an outage, a lost
                    # acknowledgement) without this write, whose outcome is unknown here
                    raise StoreUnavailableError(
                        "store_unavailable",
                        f"{req.workload}'s certificate is not in the stored state; retry",
                    )
                raise AttestmeshError(
                    "certificate_revoked",
                    f"{req.workload}'s new certificate was revoked while it was stored; attest"
                    " again",
                )
        self._metrics.attestations.labels(admitted.claims.tee.value, "admitted", "ok").inc()
        self._metrics.certificates_issued.inc()
        self._metrics.issuance_seconds.observe(time.perf_counter() - started)
        return self._offer_nonce(issued, now)

    async def _verify_and_sign(
        self,
        req: AttestRequest,
        governing: Sequence[AttestationPolicy],
        ca: CertificateAuthority,
        spiffe: str,
        now: datetime,
    ) -> tuple[Admitted, Leaf]:
        """``certs.offload.verify_and_sign`` in a worker process when one is ready and the CA's
        key can be used there (a file key; a token's key, through the worker's own session),
        else on a thread."""
        serial = self._serials()
        procs = self._procs
        if procs is not None and procs.ready:
            if self._signing[0] is not ca:  # (once per CA value: rotation makes a new one)
                self._signing = (ca, ca.signing_material())
            material = self._signing[1]
            if material is not None:
                job = Job(req, tuple(governing), material, spiffe, serial, now)
                try:
                    signed = await procs.run(job)
                except OffloadUnavailable:  # none ready: this process does it
                    pass
                except WorkerLost:  # died or hung with it: never retried here (the agent does)
                    self._metrics.attest_crypto.labels("lost").inc()
                    log.error("the worker process verifying %s's evidence failed", req.workload)
                    raise
                except BaseException:  # its verdict (a refusal), or the caller went away
                    self._metrics.attest_crypto.labels("process").inc()
                    raise
                else:
                    self._metrics.attest_crypto.labels("process").inc()
                    return signed
        self._metrics.attest_crypto.labels("thread").inc()
        return await self._off_loop(
            verify_and_sign, req, self._verifiers, governing, ca, spiffe, serial, now
        )

    def _offer_nonce(self, issued: Issued, now: datetime) -> Issued:
        """Hand out the nonce for this workload's next attestation with its certificate (one
        per workload, replacing any earlier one). It lives no longer than a challenge's nonce:
        evidence bound to it is as fresh as evidence bound to a challenge (a nonce valid until
        the re-attestation deadline would let evidence made now be presented much later). An
        agent that re-attests later asks for a challenge."""
        w = self._state.workloads.get(issued.workload)
        if issued.reattest_by <= now or w is None or w.status is not Status.ATTESTED:
            return issued
        expires = min(issued.reattest_by, now + self._nonces.ttl)
        nonce, expires = self._nonces.offer(now, self._random, expires)
        self._offered[issued.workload] = nonce
        return replace(issued, next_nonce=nonce, next_nonce_expires=expires)

    def _consume_nonce(self, workload: str, nonce: bytes, now: datetime) -> None:
        """A challenge's nonce (once, before it expires), or the nonce offered to this very
        workload with its last certificate (dropped as it is used, whatever the outcome)."""
        if not self._nonces.is_offered(nonce):
            self._nonces.consume(nonce, now)
            return
        if hmac.compare_digest(self._offered.get(workload, b""), nonce):
            del self._offered[workload]
            self._nonces.check(nonce, now)  # nonce_expired past the deadline
            return
        self._nonces.check(nonce, now)  # forged, another replica's or a restart's: nonce_unknown
        raise NonceError(  # authentic, but not what this workload holds now: a replay (or theft)
            "nonce_not_offered",
            "this offered nonce was used, replaced, dropped (quarantine, lost answer) or offered"
            " to another workload: request a challenge",
        )

    def _refused(self, name: str, exc: EvidenceRejected, now: datetime) -> None:
        """Count and record a rejection; quarantine only on authentic evidence policy rejects."""
        self._metrics.attestations.labels(exc.tee, "rejected", exc.reason).inc()
        current = self._state.workloads.get(name)  # fresh: the awaits above
        if exc.appraisal:
            if current is not None and current.status is Status.ATTESTED:
                platform = exc.reason in PLATFORM_APPRAISAL_REASONS
                trigger = (
                    Trigger.TCB_REVOKED if exc.reason in TCB_REASONS else (Trigger.APPRAISAL_FAILED)
                )
                self._quarantine_all(
                    [(name, trigger, "; ".join(exc.reasons), exc.reason, platform)]
                )
            return
        log.warning("refused unverifiable evidence for %s: %s", name, "; ".join(exc.reasons))
        if current is not None:
            event = Event(
                EventKind.REFUSED,
                name,
                now,
                "; ".join(exc.reasons),
                Trigger.VERIFICATION_FAILED,
                exc.reason,
            )
            self._apply(self._state, [event], ())

    def withdraw(self, issued: Issued) -> bool:
        """The response carrying ``issued`` never reached the agent: revoke the certificate and
        undo what its issuance recorded (a first attestation returns to pending)."""
        now = self._clock()
        if issued.next_nonce and self._offered.get(issued.workload) == issued.next_nonce:
            del self._offered[issued.workload]  # offered with the answer that was lost
        if issued.before is None:
            return False
        state, _ = withdraw(self._state, issued.workload, issued.serial, issued.before, now)
        if state is self._state:
            return False
        log.warning("withdrew certificate %x of %s: the response was lost", issued.serial,
                    issued.workload)  # fmt: skip
        self._metrics.certificates_withdrawn.inc()
        self._apply(state, [], (issued.workload,))
        return True

    async def _collateral_for(self, req: AttestRequest, now: datetime) -> dict[str, bytes] | None:
        try:
            source = self._collateral.get(Tee(req.tee))
        except ValueError:
            return None
        if source is None:
            return None
        try:
            return await source.collateral_for(req.evidence, req.collateral, now)
        except AttestmeshError as exc:
            if isinstance(exc, CollateralError) and exc.reason in COLLATERAL_OUTAGE:
                self._metrics.attestations.labels(Tee(req.tee).value, "error", exc.reason).inc()
                raise
            raise EvidenceRejected(exc.reason, exc.detail, req.tee) from exc

    def quarantine(
        self, name: str, trigger: Trigger, reason: str, *, code: str = "", platform: bool = False
    ) -> bool:
        """``platform``: authentic evidence showed the platform failing (its node is marked);
        an operator's quarantine never says so."""
        return bool(
            self._quarantine_all([(name, trigger, reason, code or trigger.value, platform)])
        )

    def _quarantine_all(
        self, decisions: Sequence[tuple[str, Trigger, str, str, bool]], attempt: int = 0
    ) -> list[str]:
        """Quarantine several workloads in one transition: persisted and announced once.
        Each decision: (name, trigger, detail, reason code, platform failed)."""
        now = self._clock()
        state, events = self._state, []
        for name, trigger, reason, code, platform in decisions:
            state, ev = quarantine(state, name, trigger, reason, now, code=code, platform=platform)
            events += ev
        if not events:
            return []

        def again() -> object:  # refused because another replica changed a row first:
            # decide again on the rows stored now (a quarantine is never lost to a race;
            # already quarantined is a no-op)
            return self._quarantine_all(decisions, attempt + 1)

        retry = again if attempt < QUARANTINE_RETRIES else None
        self._apply(state, events, [e.workload for e in events], retry)
        for e in events:
            self._offered.pop(e.workload, None)  # its next attestation starts with a challenge
            assert e.trigger is not None
            self._metrics.quarantine_events.labels(e.trigger.value).inc()
            log.warning("quarantined %s (%s): %s", e.workload, e.trigger, e.reason)
        return [e.workload for e in events]

    def unregister(self, name: str) -> bool:
        """The workload is gone (its pod was deleted): its endpoint leaves every cluster."""
        state, events = unregister(self._state, name, self._clock())
        if events:
            self._apply(state, events, (name,))
            self._limiter.forget(name)
            self._offered.pop(name, None)
        return bool(events)

    def release(self, name: str) -> bool:
        state, events = release(self._state, name, self._clock())
        if events:
            self._apply(state, events, (name,))
        return bool(events)

    @staticmethod
    def _notify(listeners: Iterable[Callable[..., None]], *args: object) -> None:
        """Call each listener; one that raises is logged and the transition goes on (it is
        decided already: persisted and announced whatever a listener does)."""
        for listener in listeners:
            try:
                listener(*args)
            except Exception:
                log.exception("a state listener (%r) failed; the transition stands", listener)

    def add_state_listener(self, listener: Callable[[MeshState, Collection[str]], None]) -> None:
        """Called with (new state, changed workloads) on every transition, on the loop."""
        self._listeners.append(listener)

    def add_adoption_listener(
        self, listener: Callable[[MeshState, MeshState, Collection[str]], None]
    ) -> None:
        """Called with (state before, state after, the workloads adopted) when rows another
        replica made durable become this replica's view (its change feed, a write the store
        refused, a recovered store), on the loop. These transitions have no events here: the
        deciding replica's publisher announced them."""
        self._adoption_listeners.append(listener)

    def apply_tcb_findings(
        self, findings: Sequence[TcbFinding], admitted: Iterable[str] = ()
    ) -> list[str]:
        """Act on re-appraisal after a TCB change, per policy ``onTcbChange``: audit events
        (one batch), quarantines now (one transition) or after the grace period
        (``check_deadlines``). ``admitted``: workloads admitted again, whose deferred
        quarantine is dropped. Findings about a workload that re-attested since are ignored.
        A deferral is written into the workload's row (its deadline survives a restart and
        holds on every replica)."""
        now = self._clock()
        dropped = deferrals_to_drop(self._state, admitted)
        if dropped:
            self._metrics.tcb_reappraisals.labels("admitted").inc(len(dropped))
        quarantines, events, counts, deferrals = self._tcb_grace.decide(findings, self._state, now)
        for outcome, n in counts.items():
            self._metrics.tcb_reappraisals.labels(outcome).inc(n)
        self._record_deferrals({**dropped, **deferrals}, events)
        return self._quarantine_all(quarantines)

    def _record_deferrals(
        self, changes: Mapping[str, TcbDeferral | None], events: Sequence[Event], attempt: int = 0
    ) -> None:
        """Write deferred TCB quarantines (None: drop one) and their events in one batch. If
        another replica changed one of those rows first, decide again on the stored rows (a
        deferral about evidence that is no longer current is not recorded)."""
        state, changed = set_tcb_deferrals(self._state, changes)
        if not changed and not events:
            return

        def again() -> object:
            keep = [e for e in events if e.workload not in changes or e.workload in changed]
            self._record_deferrals(changes, keep, attempt + 1)
            return None

        retry = again if attempt < QUARANTINE_RETRIES else None
        try:
            self._apply(state, events, changed, retry)
        except StoreConflict:  # a synchronous store: the stored rows are adopted, and
            if retry is None:  # (above, through ``again``) it was decided again on them
                log.warning("TCB deferrals not recorded after %d conflicts", attempt)

    def check_deadlines(self) -> list[str]:
        """Quarantine attested workloads that missed their re-attestation deadline, and those
        whose TCB grace period ran out; rotate the intermediate CA when its predicates say so;
        refresh the CRLs before they go stale."""
        now = self._clock()
        late = self._overdue(now)
        self._quarantine_all(
            [
                (name, Trigger.DEADLINE_MISSED, "re-attestation deadline missed",
                 Trigger.DEADLINE_MISSED.value, False)
                for name in late
            ]
            + self._tcb_grace.due(self._state, now)
        )  # fmt: skip
        leader = self.leads
        stale = leader and self._rotate_ca(now)  # once, by the leader
        stale |= leader and self._prune_revocations(now)
        if self._shared_crl() is None:  # else the leader's signer refreshes the one set
            stale |= self._crl_at is not None and now - self._crl_at > CRL_VALIDITY / 2
        if stale:  # one new CRL set, announced once
            self._trust = self._build_trust(now)
            self._update_gauges()
            self._republish()
        return late

    def _overdue(self, now: datetime) -> list[str]:
        """Attested workloads whose re-attestation deadline has passed, from a heap of
        deadlines (O(late x log N) per tick, not a scan of the mesh). Entries superseded by a
        later attestation, a quarantine or a release are dropped as they surface."""
        late: set[str] = set()
        heap = self._due
        while heap and heap[0][0] <= now:
            due, name = heapq.heappop(heap)
            w = self._state.workloads.get(name)
            if w is not None and w.status is Status.ATTESTED and w.next_attestation_due == due:
                late.add(name)
        return sorted(late)

    def _track_deadline(self, name: str) -> None:
        self._tcb_grace.track(self._state, (name,))
        w = self._state.workloads.get(name)
        if w is not None and w.status is Status.ATTESTED and w.next_attestation_due is not None:
            heapq.heappush(self._due, (w.next_attestation_due, name))

    def _prune_revocations(self, now: datetime) -> bool:
        """Drop CRL entries of certificates that expired anyway (at most once a minute); True
        if the CRL must be rebuilt."""
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY:
            return False
        self._pruned_at = now
        pruned = prune_revocations(self._state, now)
        if pruned is self._state:
            return False
        kept = {r.serial for r in pruned.revocations}
        dropped = frozenset(r.serial for r in self._state.revocations if r.serial not in kept)
        durable = self._store.write(Batch(unrevoked=dropped))
        if durable is not None:
            self._last_write = durable
        self._state = pruned
        return True

    def _rotate_ca(self, now: datetime) -> bool:
        """The dumb ticker over the CA's rotation predicates. Each step is persisted before it
        is kept; after any step the CRL set changes (a CRL per live intermediate), so the trust
        material is rebuilt and published. Leaves issued from here on chain to the new signer;
        the trust bundle (the root) never changes."""
        if self._ca_retry_at is not None and now < self._ca_retry_at:
            return False
        before = self._ca
        try:
            for _ in range(3):  # at most prepare, activate, retire
                rotated = rotation_step(self._ca, now)
                if rotated is None:
                    break
                log.info(
                    "CA rotation: signing %s, prepared %s, previous %s",
                    _serial_of(rotated.intermediate),
                    _serial_of(rotated.prepared),
                    _serial_of(rotated.previous),
                )
                self._ca = rotated
            self._ca_retry_at = None
        except (OSError, AttestmeshError) as exc:
            self._ca_retry_at = now + CA_ROTATION_RETRY
            log.error("CA rotation failed, retrying at %s: %s", self._ca_retry_at, exc)
        if self._ca is not before and self._replication is not None:
            try:
                self._replication.ca_rotated(self._ca)
            except (OSError, AttestmeshError) as exc:
                log.error("CA rotation not shared with the other replicas yet: %s", exc)
        return self._ca is not before

    def reload_ca(self) -> None:
        """The leader rotated the shared CA (a follower learns it from the change feed):
        sign with it from now on and announce its CRL set."""
        if self._replication is None:
            return
        try:
            self._ca = self._replication.load_ca()
        except (OSError, AttestmeshError) as exc:
            log.error("cannot load the CA the leader rotated: %s", exc)
            return
        self._trust = self._build_trust(self._clock())
        self._update_gauges()
        self._republish()

    def set_policies(self, docs: Sequence[object]) -> tuple[AttestationPolicy, ...]:
        """Replace the attestation policies; invalid documents leave the previous ones in force.
        Running workloads whose last claims the new policy no longer admits are quarantined."""
        try:
            policies = parse_policies(list(docs))
        except PolicyError:
            self._metrics.policy_reloads.labels("invalid").inc()
            raise
        self._policies = policies
        self._metrics.policy_reloads.labels("ok").inc()
        now = self._clock()
        no_longer_admitted: list[tuple[str, Trigger, str, str, bool]] = []
        tcb_findings: list[TcbFinding] = []
        admitted: list[str] = []  # a deferred TCB quarantine of these is dropped
        for name, w in sorted(self._state.workloads.items()):
            if w.status is not Status.ATTESTED or w.attestation is None:
                continue
            if w.attestation.claims is None:
                continue
            reg = w.registration
            governing = policies_for(policies, reg.namespace, reg.service_account, reg.labels)
            # as the collateral in force evaluates them: a deferral the monitor made on new
            # collateral is not dropped because the claims on record predate it
            claims = self._tcb_view(w.attestation.claims)
            decision = appraise_all(claims, governing, now)
            if not isinstance(decision, Rejected):
                if claims.tcb_status != TcbStatus.REVOKED.value:  # revoked: whatever is accepted
                    admitted.append(name)
                continue
            if isinstance(decision, Rejected) and tcb_change_only(decision):
                # a raised minimum TCB / narrower accepted statuses: per onTcbChange
                action, grace = tcb_action(decision, governing, now)
                evidence = w.attestation.evidence_sha256
                tcb_findings.append(TcbFinding(name, evidence, decision, action, grace))
            elif isinstance(decision, Rejected):
                no_longer_admitted.append(
                    (name, Trigger.POLICY_CHANGED, "; ".join(decision.reasons), decision.reason,
                     False)
                )  # fmt: skip
        self._quarantine_all(no_longer_admitted)
        self.apply_tcb_findings(tcb_findings, admitted=admitted)
        return policies

    def set_tcb_view(self, view: Callable[[Claims], Claims]) -> None:
        """How the collateral in force re-evaluates claims on record (the TCB monitor's), for
        the re-appraisal on a policy change."""
        self._tcb_view = view

    def set_mesh_policies(self, policies: Sequence[MeshPolicy]) -> None:
        self._mesh_policies = tuple(policies)
        self._republish()

    def events(self, workload: str | None = None) -> list[Event]:
        return self._store.events(workload)

    async def record_events(self, events: Sequence[Event]) -> None:
        """Persist (and announce) events that change no state, e.g. the audit of a secret
        release; returns once they are durable (raises if the store has failed)."""
        durable = self._apply(self._state, events, ())
        if durable is not None:
            await asyncio.shield(durable)


def _revokes_now(state: MeshState, r: Revocation) -> bool:
    """Whether a revocation must be in the CRL set announced with its transition: its workload
    is quarantined or gone (a renewal's superseded certificate and a withdrawn one can wait
    for the coalesced re-signing)."""
    w = state.workloads.get(r.workload)
    return w is None or w.status is not Status.ATTESTED


class _Place:
    """A place taken in the issuing gate (``ControlPlane._issuing``), given back once."""

    __slots__ = ("_gate",)

    def __init__(self, gate: asyncio.Semaphore) -> None:
        self._gate: asyncio.Semaphore | None = gate

    def leave(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.release()


def _serial_of(issuer: Issuer | None) -> str:
    return "-" if issuer is None else format(issuer.cert.serial_number, "x")
