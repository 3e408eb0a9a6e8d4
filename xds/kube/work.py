"""Kubernetes work: what the mesh's events ask of the cluster, done in order by one worker.

``build_work``, ``adopted_work`` and ``should_evict`` are pure (events, or the rows another
replica decided, and policies -> work items).
``KubePublisher`` queues the work of every announced state; ``ActionQueue`` runs one worker
and the periodic re-apply; ``WorkPerformer`` does one item (quarantine, release, audit, a
namespace's trust bundle, or the full re-apply of everything persisted). Every action is
idempotent: a failed one sets the retry flag and the next re-apply repairs it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from certs.errors import AttestmeshError
from certs.policy import AttestationPolicy, Mode, OnFailure, policies_for
from xds.build import TrustMaterial
from xds.kube.actions import KubeActions
from xds.kube.client import KubeError
from xds.kube.trustbundle import TrustBundles
from xds.kube.webhook import WebhookConfiguration
from xds.kube.workloads import WorkloadRef
from xds.meshpolicy import MeshPolicy
from xds.state import Event, EventKind, MeshState, Registration, Status, Trigger

log = logging.getLogger(__name__)


class WorkKind(enum.StrEnum):
    QUARANTINE = "quarantine"
    RELEASE = "release"
    AUDIT = "audit"
    REAPPLY = "reapply"
    TRUST_BUNDLE = "trust_bundle"


@dataclass(frozen=True, slots=True)
class Work:
    kind: WorkKind
    workload: str = ""
    reason: str = ""
    trigger: Trigger = Trigger.OPERATOR
    evict: bool = False
    platform_failed: bool = False
    namespace: str = ""  # TRUST_BUNDLE: where


def should_evict(policies: Sequence[AttestationPolicy], reg: Registration) -> bool:
    """Evict when an enforcing policy governing the workload says quarantineAndEvict."""
    return any(
        p.mode is Mode.ENFORCE and p.on_failure is OnFailure.QUARANTINE_AND_EVICT
        for p in policies_for(policies, reg.namespace, reg.service_account, reg.labels)
    )


def build_work(
    state: MeshState, events: Sequence[Event], policies: Sequence[AttestationPolicy]
) -> list[Work]:
    """What Kubernetes should do about these events. Pure. Workloads that are not pods
    (names that are not ``<namespace>/<pod>``) are left alone."""
    out: list[Work] = []
    for e in events:
        try:
            WorkloadRef.parse(e.workload)
        except ValueError:
            continue
        if e.kind is EventKind.QUARANTINED:
            trigger = e.trigger or Trigger.OPERATOR
            w = state.workloads.get(e.workload)
            evict = w is not None and should_evict(policies, w.registration)
            out.append(
                Work(
                    WorkKind.QUARANTINE,
                    e.workload,
                    e.reason,
                    trigger,
                    evict=evict,
                    platform_failed=e.platform,
                )
            )
        elif e.kind is EventKind.RELEASED:
            out.append(Work(WorkKind.RELEASE, e.workload))
        elif e.kind is EventKind.AUDIT:
            out.append(Work(WorkKind.AUDIT, e.workload, e.reason, Trigger.APPRAISAL_FAILED))
        elif e.kind is EventKind.REFUSED:
            out.append(Work(WorkKind.AUDIT, e.workload, e.reason, Trigger.VERIFICATION_FAILED))
    return out


def adopted_work(
    before: MeshState,
    after: MeshState,
    names: Iterable[str],
    policies: Sequence[AttestationPolicy],
) -> list[Work]:
    """What Kubernetes should do about rows another replica decided (adopted from the store,
    with no events on this replica): a workload that became quarantined is quarantined (its
    record's reason, trigger and platform flag; eviction by ``policies``), one that stopped
    being quarantined (and still exists) is released. The same work ``build_work`` makes of
    the deciding replica's events, so the Event aggregates with it. Pure; non-pods are left
    alone."""
    out: list[Work] = []
    for name in sorted(set(names)):
        try:
            WorkloadRef.parse(name)
        except ValueError:
            continue
        old, new = before.workloads.get(name), after.workloads.get(name)
        was = old is not None and old.status is Status.QUARANTINED
        if new is None:
            continue  # gone: its pod is (being) deleted
        if new.status is Status.QUARANTINED and not was and new.quarantine is not None:
            q = new.quarantine
            out.append(
                Work(
                    WorkKind.QUARANTINE,
                    name,
                    q.reason,
                    q.trigger,
                    evict=should_evict(policies, new.registration),
                    platform_failed=q.platform,
                )
            )
        elif was and new.status is not Status.QUARANTINED:
            out.append(Work(WorkKind.RELEASE, name))
    return out


def stale_releases(state: MeshState, labelled: Iterable[str]) -> list[str]:
    """The pods carrying the quarantine label (``labelled``, as watched) whose workload is
    known and no longer quarantined: a release nobody wrote (decided while no replica led, or
    its call failed). Pure; non-pods are left alone."""
    out: list[str] = []
    for name in sorted(set(labelled)):
        try:
            WorkloadRef.parse(name)
        except ValueError:
            continue
        w = state.workloads.get(name)
        if w is not None and w.status is not Status.QUARANTINED:
            out.append(name)
    return out


def resync_wait(retrying: bool, resync: timedelta, backoff: float) -> tuple[float, float]:
    """(seconds until the next re-apply, the backoff after it): ``resync`` normally; after a
    failed action the backoff (doubling, from 1s), never longer than ``resync``. Pure."""
    period = resync.total_seconds()
    if not retrying:
        return period, 1.0
    return min(backoff, period), min(backoff * 2, period)


class _Publisher(Protocol):
    def publish(
        self,
        state: MeshState,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None: ...

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None: ...


class KubePublisher:
    """A publisher: ``inner`` (xDS) as before, then the events' Kubernetes work submitted
    (eviction decided by the ``policies()`` in force)."""

    def __init__(
        self,
        inner: _Publisher,
        submit: Callable[[Work], None],
        policies: Callable[[], Sequence[AttestationPolicy]],
    ) -> None:
        self._inner, self._submit, self._policies = inner, submit, policies

    def publish(
        self,
        state: MeshState,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None:
        self._inner.publish(state, mesh_policies, trust, changed)

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None:
        self._inner.on_events(state, events)
        for work in build_work(state, events, self._policies()):
            self._submit(work)


class ActionQueue:
    """Work performed in order by one worker (``perform``); a failed item sets the retry flag.
    The re-apply is submitted every ``resync`` while ``is_leader()``; when the flag is set as a
    wait begins (an item failed since the last re-apply), after the backoff instead (from 1 s,
    doubling while failures go on, never longer than ``resync``). ``completed`` holds what the
    worker did lately, in order (bounded)."""

    def __init__(
        self,
        perform: Callable[[Work], Awaitable[None]],
        *,
        is_leader: Callable[[], bool],
        resync: timedelta,
    ) -> None:
        self.perform, self.is_leader, self.resync = perform, is_leader, resync
        self.completed: collections.deque[Work] = collections.deque(maxlen=1000)
        self._queue: asyncio.Queue[Work] = asyncio.Queue()
        self._retry = asyncio.Event()

    def submit(self, work: Work) -> None:
        self._queue.put_nowait(work)

    def retry(self) -> None:
        """Something was not done: re-apply soon."""
        self._retry.set()

    @property
    def retrying(self) -> bool:
        """An item failed since the last re-apply was submitted."""
        return self._retry.is_set()

    async def join(self) -> None:
        """Every item queued so far was attempted."""
        await self._queue.join()

    async def worker(self) -> None:
        while True:
            work = await self._queue.get()
            try:
                await self.perform(work)
            except (KubeError, AttestmeshError) as exc:
                # idempotent actions: the next re-apply repairs what this one missed
                what = work.workload or work.namespace
                log.warning("kubernetes %s of %s failed: %s", work.kind, what, exc)
                self._retry.set()
            finally:
                self.completed.append(work)
                self._queue.task_done()

    async def resync_loop(self, stop: asyncio.Event) -> None:
        backoff = 1.0
        while not stop.is_set():
            wait, backoff = resync_wait(self._retry.is_set(), self.resync, backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():
                return
            self._retry.clear()
            if self.is_leader():
                self.submit(Work(WorkKind.REAPPLY))


class WorkPerformer:
    """Does one work item. The re-apply (leader only, once the cluster is listed) re-derives
    every quarantine from ``state()``, releases the pods still labelled quarantined whose
    workload no longer is (``labelled()``: as watched), writes the webhook's CA bundle and
    re-checks every namespace's trust bundle; a namespace that fails calls ``retry``."""

    def __init__(
        self,
        actions: KubeActions,
        trust: TrustBundles,
        *,
        is_leader: Callable[[], bool],
        synced: asyncio.Event,
        state: Callable[[], MeshState],
        policies: Callable[[], Sequence[AttestationPolicy]],
        retry: Callable[[], None],
        webhook: WebhookConfiguration | None = None,
        labelled: Callable[[], Iterable[str]] = lambda: (),
    ) -> None:
        self.actions, self.trust, self.webhook = actions, trust, webhook
        self.labelled = labelled  # the pods watched carrying the quarantine label
        self.is_leader, self.synced, self.state = is_leader, synced, state
        self.policies, self.retry = policies, retry

    async def __call__(self, work: Work) -> None:
        if work.kind is WorkKind.QUARANTINE:
            await self.actions.quarantine(
                work.workload,
                work.reason,
                work.trigger,
                evict=work.evict,
                platform_failed=work.platform_failed,
            )
        elif work.kind is WorkKind.RELEASE:
            await self.actions.release(work.workload)
        elif work.kind is WorkKind.AUDIT:
            await self.actions.record_audit(work.workload, work.reason, work.trigger)
        elif work.kind is WorkKind.TRUST_BUNDLE:
            await self.trust.write_queued(work.namespace, can_write=self.is_leader())
        else:
            await self.reapply()

    async def reapply(self) -> None:
        if not self.is_leader():
            return
        await self.synced.wait()  # the policies (eviction) and pods are known
        state = self.state()
        await self.actions.reapply(
            state, lambda name: should_evict(self.policies(), state.get(name).registration)
        )
        for name in stale_releases(state, self.labelled()):
            await self.actions.release(name)
        if self.webhook is not None:
            await self.webhook.write_ca_bundle()
        if await self.trust.ensure_all():
            self.retry()


__all__ = [
    "ActionQueue",
    "KubePublisher",
    "Work",
    "WorkKind",
    "WorkPerformer",
    "adopted_work",
    "build_work",
    "resync_wait",
    "should_evict",
    "stale_releases",
]
