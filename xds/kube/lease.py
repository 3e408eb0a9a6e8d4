"""coordination.k8s.io/v1 Lease leader election: only the holder writes to Kubernetes.

``decide_lease`` and ``lease_spec`` are pure (what to do with the Lease read, and the spec to
write); ``LeaderElector`` reads and writes the Lease.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from xds.kube.client import Clock, KubeClient, KubeError, Sleep
from xds.kube.conditions import micro_time, parse_time

log = logging.getLogger(__name__)


class LeaseAction(enum.StrEnum):
    CREATE = "create"
    RENEW = "renew"
    TAKEOVER = "takeover"
    WAIT = "wait"


def decide_lease(
    lease: Mapping[str, Any] | None, identity: str, now: datetime
) -> tuple[LeaseAction, str | None]:
    """What to do with the Lease (and who holds it). Pure."""
    if lease is None:
        return LeaseAction.CREATE, None
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or None
    if holder == identity:
        return LeaseAction.RENEW, holder
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if holder is None or renewed is None or not isinstance(duration, int):
        return LeaseAction.TAKEOVER, holder
    if now >= renewed + timedelta(seconds=duration):
        return LeaseAction.TAKEOVER, holder
    return LeaseAction.WAIT, holder


def lease_spec(
    identity: str,
    lease_duration: timedelta,
    now: datetime,
    lease: Mapping[str, Any] | None,
    takeover: bool,
) -> dict[str, Any]:
    """The spec ``identity`` writes to create, renew (``lease`` its current holder's) or take
    over the Lease at ``now``. Pure."""
    old = (lease or {}).get("spec") or {}
    transitions = int(old.get("leaseTransitions") or 0) + (1 if takeover else 0)
    acquire = old.get("acquireTime") if lease and not takeover else micro_time(now)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": int(lease_duration.total_seconds()),
        "acquireTime": acquire,
        "renewTime": micro_time(now),
        "leaseTransitions": transitions,
    }


class LeaderElector:
    """coordination.k8s.io/v1 Lease election. ``step()`` is one attempt (tests drive it with an
    injected clock); ``run()`` repeats it every ``retry_period``."""

    def __init__(
        self,
        kube: KubeClient,
        identity: str,
        *,
        namespace: str = "attestmesh-system",
        name: str = "attestmesh-controlplane-leader",
        lease_duration: timedelta = timedelta(seconds=15),
        retry_period: timedelta = timedelta(seconds=2),
        clock: Clock = lambda: datetime.now(UTC),
        sleep: Sleep = asyncio.sleep,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.kube, self.identity, self.namespace, self.name = kube, identity, namespace, name
        self.lease_duration, self.retry_period = lease_duration, retry_period
        self.clock, self.sleep, self.on_change = clock, sleep, on_change
        self._leader = False
        self._renewed: datetime | None = None
        self.holder: str | None = None

    @property
    def is_leader(self) -> bool:
        renewed = self._renewed
        if self._leader and renewed is not None and self.clock() >= renewed + self.lease_duration:
            self._set(False)  # could not renew in time: stop acting
        return self._leader

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            log.info("leader election: %s is %s", self.identity, "leader" if leader else "follower")
            if self.on_change is not None:
                self.on_change(leader)

    async def step(self) -> bool:
        now = self.clock()
        try:
            lease = await self.kube.call(
                self.kube.coordination.read_namespaced_lease, self.name, self.namespace
            )
        except KubeError as exc:
            if exc.status != 404:
                log.warning("leader election: cannot read lease: %s", exc)
                return self.is_leader
            lease = None
        action, holder = decide_lease(lease, self.identity, now)
        self.holder = holder
        try:
            if action is LeaseAction.CREATE:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": lease_spec(self.identity, self.lease_duration, now, None, False),
                }
                await self.kube.call(
                    self.kube.coordination.create_namespaced_lease, self.namespace, body
                )
            elif action in (LeaseAction.RENEW, LeaseAction.TAKEOVER):
                assert lease is not None
                body = {
                    **lease,
                    "spec": lease_spec(
                        self.identity,
                        self.lease_duration,
                        now,
                        lease,
                        action is LeaseAction.TAKEOVER,
                    ),
                }
                await self.kube.call(
                    self.kube.coordination.replace_namespaced_lease,
                    self.name,
                    self.namespace,
                    body,
                )
            else:
                self._set(False)
                return False
        except KubeError as exc:
            # conflict (someone else wrote first) or an error: not the leader unless our last
            # renewal is still valid
            log.info("leader election: %s on %s", exc.reason, action)
            if exc.status == 409:
                self._set(False)
            return self.is_leader
        self.holder = self.identity
        self._renewed = now
        self._set(True)
        return True

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await self.sleep(self.retry_period.total_seconds())
        finally:
            self._set(False)

    async def release(self) -> None:
        """Hand the Lease over at shutdown (holder cleared), so that the next replica need not
        wait for it to expire. Only a Lease this replica holds; a failure is logged (the Lease
        expires on its own)."""
        kube = self.kube
        try:
            lease = await kube.call(
                kube.coordination.read_namespaced_lease, self.name, self.namespace
            )
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            lease["spec"] = {**spec, "holderIdentity": None}
            await kube.call(
                kube.coordination.replace_namespaced_lease, self.name, self.namespace, lease
            )
        except KubeError as exc:
            log.warning("could not release the lease %s: %s", self.name, exc)


__all__ = ["LeaderElector", "LeaseAction", "decide_lease", "lease_spec"]
