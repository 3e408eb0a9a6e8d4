"""Pods, Services, EndpointSlices and Nodes -> what the mesh knows of them. Pure.

Pods become registrations (``registration_from_pod``); the Service selecting a pod names its
mesh service, and its EndpointSlice endpoints say whether it is ready. The workload name
(``workload_name``) is decided here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from xds.kube.names import (
    ANNOTATION_APP_PORT,
    ANNOTATION_INBOUND_PORT,
    ANNOTATION_INJECTED,
    ANNOTATION_OUTBOUND,
    DEFAULT_INBOUND_PORT,
    LABEL_PLATFORM_UNTRUSTED,
    TAINT_PLATFORM_UNTRUSTED,
)
from xds.state import Endpoint, Registration


def workload_name(namespace: str, pod: str) -> str:
    """The registration name (and Envoy node id) of a pod. The one place this is decided."""
    return f"{namespace}/{pod}"


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    namespace: str
    pod: str

    @classmethod
    def parse(cls, name: str) -> WorkloadRef:
        ns, sep, pod = name.partition("/")
        if not sep or not ns or not pod:
            raise ValueError(f"not a <namespace>/<pod> workload name: {name!r}")
        return cls(ns, pod)

    @property
    def name(self) -> str:
        return workload_name(self.namespace, self.pod)


def _port(value: Any) -> int | None:
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def parse_outbound(text: str) -> dict[str, int]:
    """``"billing=15001, ledger=15002"`` -> {service: local port}; bad entries are skipped."""
    out: dict[str, int] = {}
    for item in text.split(","):
        name, sep, port = item.strip().partition("=")
        p = _port(port)
        if sep and name.strip() and p is not None:
            out[name.strip()] = p
    return out


@dataclass(frozen=True, slots=True)
class ServiceSelector:
    """A Service with a pod selector: it names the mesh service of the pods it selects."""

    namespace: str
    name: str
    selector: Mapping[str, str]

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return namespace == self.namespace and all(
            labels.get(k) == v for k, v in self.selector.items()
        )


def parse_service(obj: Mapping[str, Any]) -> ServiceSelector | None:
    """A Service -> its selector; a Service without one (ExternalName, hand-written endpoints)
    selects no pod -> None."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name = meta.get("name")
    selector = spec.get("selector")
    if not isinstance(name, str) or not name or not isinstance(selector, Mapping) or not selector:
        return None
    return ServiceSelector(
        str(meta.get("namespace") or "default"),
        name,
        {str(k): str(v) for k, v in selector.items()},
    )


def select_service(
    namespace: str, labels: Mapping[str, str], services: Iterable[ServiceSelector]
) -> str | None:
    """The Service naming a pod's mesh service: of those selecting it, the lowest name (a pod
    selected by several Services belongs to one mesh service; the choice must not depend on
    watch order)."""
    names = [s.name for s in services if s.selects(namespace, labels)]
    return min(names) if names else None


def not_ready_endpoints(endpoint_slice: Mapping[str, Any]) -> frozenset[WorkloadRef]:
    """The pods an EndpointSlice (discovery.k8s.io/v1) says must not receive traffic: endpoints
    whose ``conditions.ready`` is false or ``conditions.terminating`` true. An absent ``ready``
    means ready, as the API defines it. Endpoints that are not pods are ignored."""
    meta = endpoint_slice.get("metadata") or {}
    namespace = str(meta.get("namespace") or "default")
    out: set[WorkloadRef] = set()
    for ep in endpoint_slice.get("endpoints") or []:
        if not isinstance(ep, Mapping):
            continue
        ref = ep.get("targetRef") or {}
        conditions = ep.get("conditions") or {}
        if not isinstance(ref, Mapping) or not isinstance(conditions, Mapping):
            continue
        name = ref.get("name")
        if ref.get("kind") != "Pod" or not isinstance(name, str) or not name:
            continue
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            out.add(WorkloadRef(str(ref.get("namespace") or namespace), name))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the control plane knows of a Node: its labels and taints (key, effect)."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[tuple[str, str], ...] = ()

    @property
    def platform_untrusted(self) -> bool:
        """Tainted by attestmesh: a workload's platform on this node failed attestation."""
        return (TAINT_PLATFORM_UNTRUSTED, "NoSchedule") in self.taints

    @property
    def quarantine_applied(self) -> bool:
        """The taint and the label a platform failure puts on the node are both in place."""
        return self.platform_untrusted and self.labels.get(LABEL_PLATFORM_UNTRUSTED) == "true"


def parse_node(obj: Mapping[str, Any]) -> NodeInfo | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    taints = tuple(
        sorted(
            (str(t.get("key")), str(t.get("effect")))
            for t in (obj.get("spec") or {}).get("taints") or []
            if isinstance(t, Mapping)
        )
    )
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    return NodeInfo(name, labels, taints)


def pod_ports(pod: Mapping[str, Any]) -> tuple[int, int | None]:
    """(inbound, app) ports a pod's Registration has: the inbound port from the
    ``attestmesh.dev/inbound-port`` annotation, else ``DEFAULT_INBOUND_PORT``; the app port from
    ``attestmesh.dev/app-port``, else the first declared containerPort, else None (such a pod
    is not registered). The injector reads them the same way."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    ann = meta.get("annotations") or {}
    inbound = _port(ann.get(ANNOTATION_INBOUND_PORT)) or DEFAULT_INBOUND_PORT
    app_port = _port(ann.get(ANNOTATION_APP_PORT))
    if app_port is None:
        for c in spec.get("containers") or []:
            ports = (c.get("ports") or []) if isinstance(c, Mapping) else []
            first = ports[0] if ports else None
            if isinstance(first, Mapping) and (app_port := _port(first.get("containerPort"))):
                break
    return inbound, app_port


def registration_from_pod(
    pod: Mapping[str, Any],
    services: Iterable[ServiceSelector] = (),
    not_ready: Collection[WorkloadRef] = frozenset(),
) -> Registration | None:
    """An injected, running pod with an IP -> its Registration; anything else -> None.

    Its mesh service is (its namespace, the Service in its namespace selecting it); a pod no
    Service selects serves no mesh service (it may still call others). It is not ready when
    listed in ``not_ready`` (from EndpointSlices). Its ``pod_uid`` is the pod's
    ``metadata.uid``: agents' tokens must be bound to that very pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ann = meta.get("annotations") or {}
    if ann.get(ANNOTATION_INJECTED) != "true" or meta.get("deletionTimestamp"):
        return None
    if status.get("phase") in ("Succeeded", "Failed") or not status.get("podIP"):
        return None
    namespace, name = meta.get("namespace") or "default", meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    inbound, app_port = pod_ports(pod)
    if app_port is None:
        return None
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    uid = meta.get("uid")
    # Membership only through what the pod's own namespace declares: a Service there selecting
    # it. Nothing the pod says of itself (annotations, labels) makes it a member of a service.
    service = select_service(namespace, labels, services) or ""
    return Registration(
        name=workload_name(namespace, name),
        namespace=namespace,
        service_account=sa,
        service=service,
        inbound=Endpoint(status["podIP"], inbound),
        app_port=app_port,
        outbound=parse_outbound(str(ann.get(ANNOTATION_OUTBOUND, ""))),
        labels=labels,
        ready=WorkloadRef(namespace, name) not in not_ready,
        pod_uid=uid if isinstance(uid, str) and uid else None,
    )


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object; a missing namespace is ``default``."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def parse_namespace(etype: str, obj: Mapping[str, Any]) -> tuple[str, dict[str, str]] | None:
    """A Namespace watch event -> (name, labels); a deleted namespace has no labels; an object
    without a name -> None."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    labels = {} if etype == "DELETED" else (meta.get("labels") or {})
    return name, {str(k): str(v) for k, v in labels.items()}


def is_recreated(previous_uid: str | None, reg: Registration) -> bool:
    """A registration for a pod name already known under another pod uid: another pod (a
    StatefulSet pod recreated, possibly while no replica watched). Nothing of the previous
    pod's standing may carry over. A known name without a uid so far is not a recreation."""
    return previous_uid is not None and previous_uid != reg.pod_uid


def departed(known: Iterable[str], live: Collection[str]) -> list[str]:
    """Workloads known to the control plane that are pods (``<namespace>/<pod>`` names) but
    not among the ``live`` pods the watch listed: deleted while no replica watched. Local
    registrations (names without a namespace) are left alone. Sorted."""
    return sorted(name for name in set(known) - set(live) if "/" in name)


__all__ = [
    "NodeInfo",
    "ServiceSelector",
    "WorkloadRef",
    "departed",
    "is_recreated",
    "not_ready_endpoints",
    "object_key",
    "parse_namespace",
    "parse_node",
    "parse_outbound",
    "parse_service",
    "pod_ports",
    "registration_from_pod",
    "select_service",
    "workload_name",
]
