"""The cluster -> the control plane: CR, Pod, Service, EndpointSlice and Node watchers feeding
callbacks (``SourceCallbacks``). ``KubeSource.run()`` supervises every watcher.

Invalid custom resources are refused one by one: each problem is listed in a status condition
``Accepted=False`` (reason ``Invalid``) and an Event, and the resource's previous valid version
stays in force (``policies.reconcile``). Pods become registrations (``workloads``); a Service or
slice change re-derives the registrations of the pods it affects. Only the Lease holder writes
the status conditions and Events; every replica reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from certs.policy import parse_policies
from xds.kube.client import Clock, KubeClient, KubeError
from xds.kube.conditions import build_condition, find_condition, same_condition
from xds.kube.events import EventRecorder
from xds.kube.metrics import KubeMetrics
from xds.kube.names import (
    ANNOTATION_INJECTED,
    CONDITION_ACCEPTED,
    GROUP,
    TAINT_PLATFORM_UNTRUSTED,
    VERSION,
)
from xds.kube.policies import Refused, clean, parse_secret_policy, reconcile
from xds.kube.watch import Watcher, WatchSpec
from xds.kube.workloads import (
    NodeInfo,
    ServiceSelector,
    WorkloadRef,
    not_ready_endpoints,
    object_key,
    parse_node,
    parse_service,
    registration_from_pod,
    workload_name,
)
from xds.meshpolicy import MeshPolicy, parse_mesh_policies
from xds.secretpolicy import SecretPolicy
from xds.state import Registration

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SourceCallbacks:
    # The AttestationPolicy documents in force (each the accepted version of its CR, server-set
    # metadata dropped): the consumer parses them itself (``ControlPlane.set_policies``).
    on_policy_documents: Callable[[list[dict[str, Any]]], Awaitable[None]]
    on_mesh_policies: Callable[[list[MeshPolicy]], Awaitable[None]]
    on_registration: Callable[[Registration], Awaitable[None]]
    on_removed: Callable[[str], Awaitable[None]]
    # Nodes (``watch_nodes``): a node seen or changed, a node gone. ``KubeSource.nodes`` holds
    # the current map either way.
    on_node: Callable[[NodeInfo], Awaitable[None]] | None = None
    on_node_removed: Callable[[str], Awaitable[None]] | None = None
    # A pod carrying the injected annotation was listed or changed (its namespace), whether or
    # not it is registered yet: it may still wait for volumes (the trust bundle) to start.
    on_injected_pod: Callable[[str], Awaitable[None]] | None = None
    # Secret release is on: SecretPolicy CRs are watched (the CRD may be missing: none then)
    # and the policies in force handed over whole on every change.
    on_secret_policies: Callable[[list[SecretPolicy]], Awaitable[None]] | None = None


@dataclass(slots=True)
class _CrKind:
    kind: str
    plural: str
    parse: Callable[[list[Any]], Sequence[Any]]
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    in_force: Mapping[tuple[str, str], Any] = field(default_factory=dict)
    docs: Mapping[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    announced: bool = False


class KubeSource:
    """Feeds the control plane from the cluster. ``run()`` supervises every watcher.

    ``pods`` holds the registrations announced; ``services`` (namespace -> name -> selector)
    and ``not_ready`` (from EndpointSlices) are what they were derived with. Pods are first
    listed once Services and EndpointSlices are, so no registration is announced with a
    service name only to be corrected a moment later."""

    def __init__(
        self,
        kube: KubeClient,
        callbacks: SourceCallbacks,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Clock = lambda: datetime.now(UTC),
        metrics: KubeMetrics | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 30.0),
        watch_nodes: bool = False,
        instance: str = "",
    ) -> None:
        self.kube, self.cb, self.is_leader, self.clock = kube, callbacks, is_leader, clock
        self.metrics = metrics
        self.events = EventRecorder(kube, clock, instance)
        self.kinds = {
            "AttestationPolicy": _CrKind(
                "AttestationPolicy", "attestationpolicies", parse_policies
            ),
            "MeshPolicy": _CrKind("MeshPolicy", "meshpolicies", parse_mesh_policies),
        }
        if callbacks.on_secret_policies is not None:
            self.kinds["SecretPolicy"] = _CrKind(
                "SecretPolicy", "secretpolicies", parse_secret_policy
            )
        self.pods: dict[str, Registration] = {}
        self._pod_objects: dict[str, dict[str, Any]] = {}  # of the pods in ``pods``
        self.services: dict[str, dict[str, ServiceSelector]] = {}
        self.slices: dict[tuple[str, str], frozenset[WorkloadRef]] = {}
        self.not_ready: frozenset[WorkloadRef] = frozenset()
        self.nodes: dict[str, NodeInfo] = {}
        self._lock = asyncio.Lock()
        self.watchers: list[Watcher] = []

        def watcher(spec: WatchSpec) -> Watcher:
            w = Watcher(kube, spec, metrics=metrics, watch_timeout=watch_timeout, backoff=backoff)
            self.watchers.append(w)
            return w

        for k in self.kinds.values():
            watcher(
                WatchSpec(
                    k.plural,
                    kube.custom.list_cluster_custom_object,
                    (GROUP, VERSION, k.plural),
                    self._cr_snapshot(k),
                    self._cr_event(k),
                    optional=k.kind == "SecretPolicy",  # its CRD is installed with the feature
                )
            )
        self._inputs = (
            watcher(
                WatchSpec(
                    "services",
                    kube.core.list_service_for_all_namespaces,
                    (),
                    self._service_snapshot,
                    self._service_event,
                )
            ),
            watcher(
                WatchSpec(
                    "endpointslices",
                    kube.discovery.list_endpoint_slice_for_all_namespaces,
                    (),
                    self._slice_snapshot,
                    self._slice_event,
                    optional=True,
                )
            ),
        )
        watcher(
            WatchSpec(
                "pods",
                kube.core.list_pod_for_all_namespaces,
                (),
                self._pod_snapshot,
                self._pod_event,
            )
        )
        if watch_nodes:
            watcher(
                WatchSpec("nodes", kube.core.list_node, (), self._node_snapshot, self._node_event)
            )

    def watcher(self, resource: str) -> Watcher:
        """The watcher of one resource (``pods``, ``services``, ``nodes``, ...)."""
        return next(w for w in self.watchers if w.spec.resource == resource)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for w in self.watchers:
                    tg.create_task(w.run())
        finally:
            for w in self.watchers:
                w.stop_stream()

    async def wait_synced(self) -> None:
        await asyncio.gather(*(w.synced.wait() for w in self.watchers))

    # custom resources

    def _cr_snapshot(self, k: _CrKind) -> Callable[[list[dict[str, Any]]], Awaitable[None]]:
        async def snapshot(items: list[dict[str, Any]]) -> None:
            async with self._lock:
                k.objects = {object_key(o): o for o in items}
                await self._reconcile(k)

        return snapshot

    def _cr_event(self, k: _CrKind) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
        async def event(etype: str, obj: dict[str, Any]) -> None:
            async with self._lock:
                if etype == "DELETED":
                    k.objects.pop(object_key(obj), None)
                else:
                    k.objects[object_key(obj)] = obj
                await self._reconcile(k)

        return event

    async def _reconcile(self, k: _CrKind) -> None:
        result = reconcile(list(k.objects.values()), k.in_force, k.parse)
        changed = dict(result.in_force) != dict(k.in_force)
        k.in_force = result.in_force
        accepted = {(ns, name) for ns, name, _ in result.accepted}
        k.docs = {
            key: clean(k.objects[key]) if key in accepted else k.docs[key]
            for key in result.in_force
            if key in accepted or key in k.docs
        }
        if changed or not k.announced:
            k.announced = True
            values = [result.in_force[key] for key in sorted(result.in_force)]
            if k.kind == "AttestationPolicy":
                await self.cb.on_policy_documents([k.docs[key] for key in sorted(k.docs)])
            elif k.kind == "SecretPolicy":
                if self.cb.on_secret_policies is not None:
                    await self.cb.on_secret_policies(values)
            else:
                await self.cb.on_mesh_policies(values)
        if not self.is_leader():
            return
        for ns, name, gen in result.accepted:
            await self._set_accepted(k, ns, name, gen, None)
        for refused in result.refused:
            if self.metrics is not None:
                self.metrics.refused.labels(kind=k.kind).inc()
            await self._set_accepted(
                k, refused.namespace, refused.name, refused.generation, refused
            )

    async def _set_accepted(
        self, k: _CrKind, ns: str, name: str, gen: int | None, refused: Refused | None
    ) -> None:
        obj = k.objects.get((ns, name))
        if obj is None:
            return
        if refused is None:
            wanted = build_condition(
                CONDITION_ACCEPTED, True, "Valid", "policy accepted", self.clock(), gen
            )
        else:
            kept = "; the previous valid version stays in force" if (ns, name) in k.in_force else ""
            message = f"{len(refused.problems)} problem(s): " + "; ".join(refused.problems) + kept
            wanted = build_condition(
                CONDITION_ACCEPTED, False, "Invalid", message, self.clock(), gen
            )
        current = find_condition(obj, CONDITION_ACCEPTED)
        if same_condition(current, wanted):
            return
        if current is not None and current.get("status") == wanted["status"]:
            wanted["lastTransitionTime"] = current.get("lastTransitionTime")
        others = [
            c
            for c in (obj.get("status") or {}).get("conditions") or []
            if c.get("type") != CONDITION_ACCEPTED
        ]
        patch = {"status": {"observedGeneration": gen, "conditions": [*others, wanted]}}
        try:
            await self.kube.call(
                self.kube.custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                ns,
                k.plural,
                name,
                patch,
                _content_type="application/merge-patch+json",
            )
            if refused is not None:
                await self.events.record(
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": k.kind,
                        "name": name,
                        "namespace": ns,
                        "uid": (obj.get("metadata") or {}).get("uid", ""),
                    },
                    "Invalid",
                    wanted["message"],
                )
        except KubeError as exc:
            log.warning("cannot update status of %s %s/%s: %s", k.kind, ns, name, exc)

    # pods, and the Services and EndpointSlices their registrations are derived with

    def _derive(self, pod: Mapping[str, Any]) -> Registration | None:
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        return registration_from_pod(pod, self.services.get(ns, {}).values(), self.not_ready)

    async def _announce(self, name: str, reg: Registration | None) -> None:
        """Tell the consumer about a pod's registration if it changed. Holds ``_lock``."""
        if reg is None:
            self._pod_objects.pop(name, None)
            if self.pods.pop(name, None) is not None:
                await self.cb.on_removed(name)
        elif self.pods.get(name) != reg:
            self.pods[name] = reg
            await self.cb.on_registration(reg)

    async def _rederive(self, names: Iterable[str]) -> None:
        """Re-derive known pods' registrations after a Service or readiness change."""
        for name in sorted(set(names)):
            obj = self._pod_objects.get(name)
            if obj is not None:
                await self._announce(name, self._derive(obj))

    def _in_namespaces(self, namespaces: Collection[str]) -> list[str]:
        return [name for name, reg in self.pods.items() if reg.namespace in namespaces]

    async def _pod_snapshot(self, items: list[dict[str, Any]]) -> None:
        for w in self._inputs:  # the first list waits for Services and EndpointSlices
            await w.synced.wait()
        async with self._lock:
            seen: dict[str, tuple[Registration, dict[str, Any]]] = {}
            for item in items:
                await self._injected_pod(item)
                reg = self._derive(item)
                if reg is not None:
                    seen[reg.name] = (reg, item)
            for name in sorted(set(self.pods) - set(seen)):
                await self._announce(name, None)
            for name, (reg, item) in sorted(seen.items()):
                self._pod_objects[name] = item
                await self._announce(name, reg)

    async def _pod_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            ns, pod = object_key(obj)
            name = workload_name(ns, pod)
            reg = None if etype == "DELETED" else self._derive(obj)
            if etype != "DELETED":
                await self._injected_pod(obj)
            if reg is not None:
                self._pod_objects[name] = obj
            await self._announce(name, reg)

    async def _injected_pod(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if self.cb.on_injected_pod is not None and ann.get(ANNOTATION_INJECTED) == "true":
            await self.cb.on_injected_pod(str(meta.get("namespace") or "default"))

    async def _service_snapshot(self, items: list[dict[str, Any]]) -> None:
        async with self._lock:
            services: dict[str, dict[str, ServiceSelector]] = {}
            for item in items:
                sel = parse_service(item)
                if sel is not None:
                    services.setdefault(sel.namespace, {})[sel.name] = sel
            changed = {
                ns
                for ns in set(services) | set(self.services)
                if services.get(ns) != self.services.get(ns)
            }
            self.services = services
            await self._rederive(self._in_namespaces(changed))

    async def _service_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            ns, name = object_key(obj)
            sel = None if etype == "DELETED" else parse_service(obj)
            current = self.services.get(ns, {})
            if current.get(name) == sel:
                return  # e.g. a status or port change: the selector is what matters
            updated = {k: v for k, v in current.items() if k != name}
            if sel is not None:
                updated[name] = sel
            if updated:
                self.services[ns] = updated
            else:
                self.services.pop(ns, None)
            await self._rederive(self._in_namespaces({ns}))

    async def _set_not_ready(self) -> None:
        old = self.not_ready
        self.not_ready = frozenset().union(*self.slices.values())
        await self._rederive(ref.name for ref in old ^ self.not_ready)

    async def _slice_snapshot(self, items: list[dict[str, Any]]) -> None:
        async with self._lock:
            self.slices = {object_key(item): not_ready_endpoints(item) for item in items}
            await self._set_not_ready()

    async def _slice_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            if etype == "DELETED":
                self.slices.pop(object_key(obj), None)
            else:
                self.slices[object_key(obj)] = not_ready_endpoints(obj)
            await self._set_not_ready()

    # nodes

    async def _node_snapshot(self, items: list[dict[str, Any]]) -> None:
        seen = {n.name: n for n in map(parse_node, items) if n is not None}
        for name in sorted(set(self.nodes) - set(seen)):
            await self._node_gone(name)
        for _, info in sorted(seen.items()):
            await self._node_seen(info)

    async def _node_event(self, etype: str, obj: dict[str, Any]) -> None:
        info = parse_node(obj)
        if info is None:
            return
        if etype == "DELETED":
            await self._node_gone(info.name)
        else:
            await self._node_seen(info)

    async def _node_seen(self, info: NodeInfo) -> None:
        old = self.nodes.get(info.name)
        if old == info:
            return
        self.nodes[info.name] = info
        was_untrusted = old is not None and old.platform_untrusted
        if info.platform_untrusted and not was_untrusted:
            log.warning(
                "node %s carries the %s taint: a platform on it failed attestation",
                info.name,
                TAINT_PLATFORM_UNTRUSTED,
            )
        elif was_untrusted and not info.platform_untrusted:
            log.info("node %s: the %s taint was removed", info.name, TAINT_PLATFORM_UNTRUSTED)
        self._count_untrusted()
        if self.cb.on_node is not None:
            await self.cb.on_node(info)

    async def _node_gone(self, name: str) -> None:
        if self.nodes.pop(name, None) is None:
            return
        self._count_untrusted()
        if self.cb.on_node_removed is not None:
            await self.cb.on_node_removed(name)

    def _count_untrusted(self) -> None:
        if self.metrics is not None:
            self.metrics.untrusted_nodes.set(sum(n.platform_untrusted for n in self.nodes.values()))


__all__ = ["KubeSource", "SourceCallbacks"]
