"""The Kubernetes adapter's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class KubeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.actions = Counter(
            "attestmesh_kube_actions_total",
            "Kubernetes writes by action and result",
            ["action", "result"],
            registry=registry,
        )
        self.watch_restarts = Counter(
            "attestmesh_kube_watch_restarts_total",
            "Watch restarts by resource and reason (gone: relist after 410; error: backoff; "
            "not_served: the server does not serve the resource)",
            ["resource", "reason"],
            registry=registry,
        )
        self.audits = Counter(
            "attestmesh_kube_audit_events_total",
            "Audit-mode failures recorded without action, by trigger",
            ["trigger"],
            registry=registry,
        )
        self.refused = Counter(
            "attestmesh_kube_refused_resources_total",
            "Custom resources refused as invalid, by kind",
            ["kind"],
            registry=registry,
        )
        self.untrusted_nodes = Gauge(
            "attestmesh_kube_untrusted_nodes",
            "Watched nodes carrying the attestmesh platform-untrusted taint",
            registry=registry,
        )


__all__ = ["KubeMetrics"]
