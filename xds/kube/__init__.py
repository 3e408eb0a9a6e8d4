"""The Kubernetes adapter: the cluster feeds the control plane, and the control plane acts on it.

Public face (what others import; from ``xds.kube``, or the pure names from ``xds.kube.names``):

- ``names``: every shared Kubernetes name (API group, labels, annotations, taints, conditions,
  the token audience, the trust-bundle ConfigMap, the Nitro Enclaves resources). Pure; the
  injector (``sidecar.inject``) and the linter (``attestmesh.lint``) import it alone.
- ``workloads`` (pure): Pods, Services, EndpointSlices, Nodes -> registrations and node info;
  the workload name (``workload_name``).
- ``policies`` (pure): custom resources -> the policies in force (``reconcile``);
  ``conditions`` (pure): status conditions and time formats.
- ``client``: the seam to the API server (``KubeClient``, ``KubeError``, ``connect``);
  ``metrics``: the adapter's Prometheus metrics.
- ``tokenreview``: agent identity (TokenReview; ``check_pod_binding`` pure).
- ``lease``: Lease leader election (``decide_lease`` pure); only the holder writes.
- ``watch``: list + watch with resourceVersion, relist on 410 Gone, backoff.
- ``events``: core/v1 Events, aggregated; ``source``: the watchers -> callbacks.
- ``actions``: quarantine in Kubernetes (labels, conditions, Events, eviction, node taints),
  idempotent and leader-only.
- ``work``: events -> work items (``build_work`` pure), the one worker and the re-apply.
- ``trustbundle``: the trust-bundle ConfigMap reconcile (``plan_trust_configmap`` pure).
- ``webhook``: the webhook configuration's CA bundle (``ca_bundle_ops`` pure) and the serving
  certificate's rotation (``renewal_wait`` pure).

The package sits under ``xds`` beside the other sources of the mesh state (registration files,
the stores): it turns the cluster into registrations, policies and identity checks, and the
mesh's events into cluster writes. It may import ``certs`` and ``xds``, never ``sidecar`` or the
composition root ``attestmesh``; inside it imports go one way, ``names`` <- ``workloads``/
``conditions`` <- ``policies`` <- ``client``/``metrics`` <- ``tokenreview``/``lease``/``watch``/
``events`` <- ``source``/``actions``/``trustbundle``/``webhook`` <- ``work`` (pyproject's import
contracts ``kube-pure``, ``inject-pure``, ``kube-sidecar``, ``kube-layers``).

Names other than ``names``' are resolved on first use (PEP 562), so importing
``xds.kube.names`` loads no I/O module of the adapter.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from xds.kube import names
from xds.kube.names import *  # noqa: F403 (the shared names, exported as they are)

if TYPE_CHECKING:
    from xds.kube.actions import (
        ActionResult,
        KubeActions,
        QuarantineOutcome,
    )
    from xds.kube.client import (
        KubeClient,
        KubeConfigError,
        KubeError,
        connect,
    )
    from xds.kube.conditions import (
        build_condition,
        find_condition,
    )
    from xds.kube.events import (
        EventRecorder,
    )
    from xds.kube.lease import (
        LeaderElector,
        LeaseAction,
        decide_lease,
    )
    from xds.kube.metrics import (
        KubeMetrics,
    )
    from xds.kube.policies import (
        Reconciled,
        Refused,
        reconcile,
    )
    from xds.kube.source import (
        KubeSource,
        SourceCallbacks,
    )
    from xds.kube.tokenreview import (
        ReviewedToken,
        TokenReviewer,
        TokenReviewError,
        TokenReviewIdentity,
        check_pod_binding,
        parse_token_review,
    )
    from xds.kube.trustbundle import (
        TrustBundles,
    )
    from xds.kube.watch import (
        Watcher,
        WatchSpec,
    )
    from xds.kube.webhook import (
        ServingCertRotator,
        WebhookConfiguration,
        renewal_wait,
    )
    from xds.kube.work import (
        ActionQueue,
        KubePublisher,
        Work,
        WorkKind,
        WorkPerformer,
        build_work,
        should_evict,
    )
    from xds.kube.workloads import (
        NodeInfo,
        ServiceSelector,
        WorkloadRef,
        departed,
        is_recreated,
        not_ready_endpoints,
        parse_namespace,
        parse_node,
        parse_outbound,
        parse_service,
        pod_ports,
        registration_from_pod,
        select_service,
        workload_name,
    )

# name -> the module defining it (resolved by __getattr__ on first use)
_LAZY: dict[str, str] = {
    "ActionResult": "actions",
    "KubeActions": "actions",
    "QuarantineOutcome": "actions",
    "KubeClient": "client",
    "KubeConfigError": "client",
    "KubeError": "client",
    "connect": "client",
    "build_condition": "conditions",
    "find_condition": "conditions",
    "EventRecorder": "events",
    "LeaderElector": "lease",
    "LeaseAction": "lease",
    "decide_lease": "lease",
    "KubeMetrics": "metrics",
    "Reconciled": "policies",
    "Refused": "policies",
    "reconcile": "policies",
    "KubeSource": "source",
    "SourceCallbacks": "source",
    "ReviewedToken": "tokenreview",
    "TokenReviewError": "tokenreview",
    "TokenReviewIdentity": "tokenreview",
    "TokenReviewer": "tokenreview",
    "check_pod_binding": "tokenreview",
    "parse_token_review": "tokenreview",
    "TrustBundles": "trustbundle",
    "WatchSpec": "watch",
    "Watcher": "watch",
    "ServingCertRotator": "webhook",
    "WebhookConfiguration": "webhook",
    "renewal_wait": "webhook",
    "ActionQueue": "work",
    "KubePublisher": "work",
    "Work": "work",
    "WorkKind": "work",
    "WorkPerformer": "work",
    "build_work": "work",
    "should_evict": "work",
    "NodeInfo": "workloads",
    "ServiceSelector": "workloads",
    "WorkloadRef": "workloads",
    "departed": "workloads",
    "is_recreated": "workloads",
    "not_ready_endpoints": "workloads",
    "parse_namespace": "workloads",
    "parse_node": "workloads",
    "parse_outbound": "workloads",
    "parse_service": "workloads",
    "pod_ports": "workloads",
    "registration_from_pod": "workloads",
    "select_service": "workloads",
    "workload_name": "workloads",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ActionQueue",
    "ActionResult",
    "EventRecorder",
    "KubeActions",
    "KubeClient",
    "KubeConfigError",
    "KubeError",
    "KubeMetrics",
    "KubePublisher",
    "KubeSource",
    "LeaderElector",
    "LeaseAction",
    "NodeInfo",
    "QuarantineOutcome",
    "Reconciled",
    "Refused",
    "ReviewedToken",
    "ServiceSelector",
    "ServingCertRotator",
    "SourceCallbacks",
    "TokenReviewError",
    "TokenReviewIdentity",
    "TokenReviewer",
    "TrustBundles",
    "WatchSpec",
    "Watcher",
    "WebhookConfiguration",
    "Work",
    "WorkKind",
    "WorkPerformer",
    "WorkloadRef",
    "build_condition",
    "build_work",
    "check_pod_binding",
    "connect",
    "decide_lease",
    "departed",
    "find_condition",
    "is_recreated",
    "not_ready_endpoints",
    "parse_namespace",
    "parse_node",
    "parse_outbound",
    "parse_service",
    "parse_token_review",
    "pod_ports",
    "reconcile",
    "registration_from_pod",
    "renewal_wait",
    "select_service",
    "should_evict",
    "workload_name",
]
__all__ += names.__all__
