"""Quarantine in Kubernetes: pod label and condition, Events, eviction, node taint.

Every action is idempotent and leader-only: re-deriving the quarantines from persisted state
after a restart or on election (``KubeActions.reapply``) changes nothing already in place.
``node_quarantine_patch`` is the pure decision of what a node still lacks.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from xds.kube.client import Clock, KubeClient, KubeError
from xds.kube.conditions import (
    build_condition,
    condition_reason,
    find_condition,
    same_condition,
)
from xds.kube.events import EventRecorder
from xds.kube.metrics import KubeMetrics
from xds.kube.names import (
    CONDITION_ATTESTED,
    LABEL_PLATFORM_UNTRUSTED,
    LABEL_QUARANTINED,
    TAINT_PLATFORM_UNTRUSTED,
)
from xds.kube.workloads import NodeInfo, WorkloadRef
from xds.state import MeshState, Status, Trigger


def node_quarantine_patch(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that puts the platform-untrusted label and NoSchedule taint on a Node
    (as read), or None when both are in place. Pure."""
    taints = (node.get("spec") or {}).get("taints") or []
    labels = (node.get("metadata") or {}).get("labels") or {}
    has_taint = any(
        isinstance(t, Mapping)
        and t.get("key") == TAINT_PLATFORM_UNTRUSTED
        and t.get("effect") == "NoSchedule"
        for t in taints
    )
    if has_taint and labels.get(LABEL_PLATFORM_UNTRUSTED) == "true":
        return None
    patch: dict[str, Any] = {"metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}}}
    if not has_taint:
        patch["spec"] = {
            "taints": [{"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}]
        }
    return patch


class ActionResult(enum.StrEnum):
    DONE = "done"
    NOT_LEADER = "not_leader"
    POD_GONE = "pod_gone"
    EVICTION_BLOCKED = "eviction_blocked"


@dataclass(frozen=True, slots=True)
class QuarantineOutcome:
    result: ActionResult
    evicted: bool = False
    node_tainted: str | None = None


class KubeActions:
    """What quarantine does in Kubernetes. Every method is idempotent and leader-only."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Clock = lambda: datetime.now(UTC),
        metrics: KubeMetrics | None = None,
        instance: str = "",
        nodes: Callable[[str], NodeInfo | None] = lambda _: None,
    ) -> None:
        self.kube, self.is_leader, self.clock, self.metrics = kube, is_leader, clock, metrics
        self.events = EventRecorder(kube, clock, instance)
        self.nodes = nodes  # the watched nodes (KubeSource.nodes), when there is a watch

    def _count(self, action: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.actions.labels(action=action, result=result).inc()

    async def quarantine(
        self,
        workload: WorkloadRef | str,
        reason: str,
        trigger: Trigger,
        *,
        evict: bool,
        platform_failed: bool,
        node: str | None = None,
    ) -> QuarantineOutcome:
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if not self.is_leader():
            return QuarantineOutcome(ActionResult.NOT_LEADER)
        ns, name = ref.namespace, ref.pod
        try:
            pod = await self.kube.call(self.kube.core.read_namespaced_pod, name, ns)
        except KubeError as exc:
            if exc.status == 404:
                self._count("quarantine", "pod_gone")
                return QuarantineOutcome(ActionResult.POD_GONE)
            raise
        applied = False  # the label or the condition written now: an Event says so
        if (pod["metadata"].get("labels") or {}).get(LABEL_QUARANTINED) != "true":
            applied = True
            await self.kube.call(
                self.kube.core.patch_namespaced_pod,
                name,
                ns,
                {"metadata": {"labels": {LABEL_QUARANTINED: "true"}}},
            )
            self._count("pod_label", "done")
        message = f"quarantined ({trigger.value}): {reason}"
        wanted = build_condition(
            CONDITION_ATTESTED, False, condition_reason(trigger), message, self.clock(), None
        )
        current = find_condition(pod, CONDITION_ATTESTED)
        if not same_condition(current, wanted):
            applied = True
            if current is not None and current.get("status") == "False":
                wanted["lastTransitionTime"] = current.get("lastTransitionTime")
            await self.kube.call(
                self.kube.core.patch_namespaced_pod_status,
                name,
                ns,
                {"status": {"conditions": [wanted]}},
            )
            self._count("pod_condition", "done")
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": name,
            "namespace": ns,
            "uid": pod["metadata"].get("uid", ""),
        }
        if applied:  # a re-apply that finds the quarantine in place records nothing
            await self.events.record(involved, "Quarantined", message)
        tainted = None
        node = node or (pod.get("spec") or {}).get("nodeName")
        if platform_failed and node:
            await self._taint(node, message)
            tainted = node
        evicted = False
        if evict:
            try:
                await self._evict(name, ns)
                evicted = True
                self._count("evict", "done")
            except KubeError as exc:
                if exc.status == 429:
                    self._count("evict", "blocked")
                    await self.events.record(involved, "EvictionBlocked", exc.detail)
                    return QuarantineOutcome(ActionResult.EVICTION_BLOCKED, False, tainted)
                if exc.status != 404:
                    raise
        self._count("quarantine", "done")
        return QuarantineOutcome(ActionResult.DONE, evicted, tainted)

    async def _evict(self, name: str, ns: str) -> None:
        """policy/v1 Eviction; a server older than Kubernetes 1.22 answers 400 for that
        version (measured on 1.20), and is asked again with policy/v1beta1."""
        for version in ("policy/v1", "policy/v1beta1"):
            body = {
                "apiVersion": version,
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": ns},
            }
            try:
                await self.kube.call(self.kube.core.create_namespaced_pod_eviction, name, ns, body)
                return
            except KubeError as exc:
                if exc.status != 400 or f'version "{version}"' not in exc.detail:
                    raise

    async def _taint(self, node: str, message: str) -> None:
        known = self.nodes(node)
        if known is not None and known.quarantine_applied:
            return  # the watch saw taint and label in place: nothing to read or write
        current = await self.kube.call(self.kube.core.read_node, node)
        patch = node_quarantine_patch(current)
        if patch is None:
            return
        await self.kube.call(self.kube.core.patch_node, node, patch)
        self._count("node_taint", "done")
        await self.events.record(
            {"apiVersion": "v1", "kind": "Node", "name": node, "namespace": "default"},
            "PlatformUntrusted",
            message,
        )

    async def record_audit(
        self, workload: WorkloadRef | str, reason: str, trigger: Trigger
    ) -> None:
        """Audit mode: an Event and a metric, nothing else."""
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if self.metrics is not None:
            self.metrics.audits.labels(trigger=trigger.value).inc()
        if not self.is_leader():
            return
        await self.events.record(
            {"apiVersion": "v1", "kind": "Pod", "name": ref.pod, "namespace": ref.namespace},
            "AttestationAudit",
            f"would quarantine ({trigger.value}): {reason}",
        )

    async def release(self, workload: WorkloadRef | str) -> ActionResult:
        """After a fresh successful attestation: label removed, condition True."""
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if not self.is_leader():
            return ActionResult.NOT_LEADER
        try:
            pod = await self.kube.call(self.kube.core.read_namespaced_pod, ref.pod, ref.namespace)
        except KubeError as exc:
            if exc.status == 404:
                return ActionResult.POD_GONE
            raise
        if LABEL_QUARANTINED in (pod["metadata"].get("labels") or {}):
            await self.kube.call(
                self.kube.core.patch_namespaced_pod,
                ref.pod,
                ref.namespace,
                {"metadata": {"labels": {LABEL_QUARANTINED: None}}},
            )
        wanted = build_condition(
            CONDITION_ATTESTED, True, "Attested", "attested", self.clock(), None
        )
        if not same_condition(find_condition(pod, CONDITION_ATTESTED), wanted):
            await self.kube.call(
                self.kube.core.patch_namespaced_pod_status,
                ref.pod,
                ref.namespace,
                {"status": {"conditions": [wanted]}},
            )
        return ActionResult.DONE

    async def reapply(
        self, state: MeshState, evict_for: Callable[[str], bool] = lambda _: False
    ) -> dict[str, QuarantineOutcome]:
        """Re-derive every quarantine from persisted state (after a restart or on election).
        Idempotent: what is already in place is left as it is."""
        out: dict[str, QuarantineOutcome] = {}
        for name, w in sorted(state.workloads.items()):
            if w.status is not Status.QUARANTINED or w.quarantine is None:
                continue
            try:
                ref = WorkloadRef.parse(name)
            except ValueError:
                continue  # not a Kubernetes workload (local registration)
            q = w.quarantine
            out[name] = await self.quarantine(
                ref,
                q.reason,
                q.trigger,
                evict=evict_for(name),
                platform_failed=q.platform,
            )
        return out


__all__ = ["ActionResult", "KubeActions", "QuarantineOutcome", "node_quarantine_patch"]
