"""xds.kube driven through the real kubernetes client against tests/fakekube, only for what a
real API server cannot be made to produce on demand (each test names it: a 500, a 410 ending an
open watch) or does not serve in 1.20 (discovery.k8s.io/v1 EndpointSlices), plus the pure
parts. Everything else runs against kube-apiserver 1.20.2: tests/kube_real/test_kube_adapter.py
(which shares ``Recorder`` and ``running`` from here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from functools import partial
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from certs.policy import AttestationPolicy, parse_policies
from tests.fakekube import FakeKube
from tests.polling import until
from xds.kube import (
    TAINT_PLATFORM_UNTRUSTED,
    KubeClient,
    KubeMetrics,
    KubeSource,
    NodeInfo,
    ReviewedToken,
    ServiceSelector,
    SourceCallbacks,
    TokenReviewer,
    TokenReviewError,
    WorkloadRef,
    not_ready_endpoints,
    parse_node,
    parse_service,
    registration_from_pod,
    select_service,
)
from xds.meshpolicy import MeshPolicy
from xds.state import (
    Registration,
)

eventually = partial(until, every=0.02)

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_interval=0.1) as k:
        yield k


def kc(k: FakeKube) -> KubeClient:
    return KubeClient(client.ApiClient(k.configuration()), request_timeout=5)


def policy_cr(name: str, ns: str = "shop", **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"serviceAccounts": ["web"]},
        "allowedTees": ["sim"],
        "referenceValues": {"sim": {"measurement": ["aa" * 48]}},
    }
    base.update(spec)
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": base,
    }


def pod_obj(name: str, ns: str = "shop", ip: str = "10.1.0.5", node: str = "n1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app": "web"},
            "annotations": {
                "attestmesh.dev/injected": "true",
                "attestmesh.dev/inbound-port": "15006",
                "attestmesh.dev/outbound": "billing=15001",
            },
        },
        "spec": {
            "serviceAccountName": "web",
            "nodeName": node,
            "containers": [{"name": "app", "image": "x", "ports": [{"containerPort": 8080}]}],
        },
        "status": {"phase": "Running", "podIP": ip},
    }


# --- TokenReview ------------------------------------------------------------------------------


async def test_a_failed_token_review_is_token_review_failed(kube: FakeKube) -> None:
    """Fake only: a 500 answering the TokenReview. The reviews a real server answers (pod
    claims, audiences, bad tokens, non-service-account users) run on kube-apiserver 1.20.2:
    tests/kube_real/test_kube_adapter.py."""
    kube.add_token("good", "shop", "web")
    reviewer = TokenReviewer(kc(kube))
    assert await reviewer.verify_token("good") == ReviewedToken("shop", "web")
    assert kube.token_reviews[-1] == {"token": "good", "audiences": ["attestmesh"]}
    kube.fail("POST", "tokenreviews", 500)
    with pytest.raises(TokenReviewError) as exc:
        await reviewer.verify_token("good")
    assert exc.value.reason == "token_review_failed"


# --- source: CRs and pods ---------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.policies: list[list[AttestationPolicy]] = []
        self.mesh: list[list[MeshPolicy]] = []
        self.registered: list[Registration] = []
        self.removed: list[str] = []

    def callbacks(self) -> SourceCallbacks:
        async def on_policy_documents(docs: list[dict[str, Any]]) -> None:
            self.policies.append(list(parse_policies(docs)))

        async def on_mesh(p: list[MeshPolicy]) -> None:
            self.mesh.append(p)

        async def on_reg(r: Registration) -> None:
            self.registered.append(r)

        async def on_removed(n: str) -> None:
            self.removed.append(n)

        return SourceCallbacks(on_policy_documents, on_mesh, on_reg, on_removed)


@contextlib.asynccontextmanager
async def running(source: KubeSource) -> AsyncIterator[None]:
    task = asyncio.create_task(source.run())
    try:
        await asyncio.wait_for(source.wait_synced(), 5)
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_watch_backs_off_on_errors(kube: FakeKube) -> None:
    """Fake only: a 500 answering the first list (a real server answers it, or is down)."""
    kube.fail("GET", "/api/v1/pods", 500)
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(kube), rec.callbacks(), metrics=metrics, backoff=(0.01, 0.05))
    async with running(source):
        pass
    assert metrics.watch_restarts.labels(resource="pods", reason="error")._value.get() == 1


# --- Services, EndpointSlices, Nodes ----------------------------------------------------------


def service_obj(name: str, selector: dict[str, str] | None, ns: str = "shop") -> dict[str, Any]:
    spec: dict[str, Any] = {"ports": [{"port": 80, "targetPort": 8080}]}
    if selector is not None:
        spec["selector"] = selector
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": ns},
            "spec": spec}  # fmt: skip


def slice_obj(
    name: str, service: str, pods: dict[str, dict[str, bool]], ns: str = "shop"
) -> dict[str, Any]:
    """An EndpointSlice of ``service``: pod name -> its endpoint's conditions."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [f"10.1.0.{i + 5}"],
                "conditions": conditions,
                "targetRef": {"kind": "Pod", "name": pod, "namespace": ns},
            }
            for i, (pod, conditions) in enumerate(sorted(pods.items()))
        ],
        "ports": [{"port": 8080, "protocol": "TCP"}],
    }


def node_obj(name: str, *, untrusted: bool = False) -> dict[str, Any]:
    taints = (
        [{"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}]
        if untrusted
        else []
    )
    labels = {"attestmesh.dev/platform-untrusted": "true"} if untrusted else {}
    return {"metadata": {"name": name, "labels": labels}, "spec": {"taints": taints}}


def test_service_selection_and_registration_precedence_are_pure() -> None:
    billing = parse_service(service_obj("billing", {"app": "web"}))
    assert billing == ServiceSelector("shop", "billing", {"app": "web"})
    assert parse_service(service_obj("external", None)) is None  # no selector: no pods
    assert parse_service(service_obj("empty", {})) is None
    alpha = parse_service(service_obj("alpha", {"app": "web", "tier": "front"}))
    elsewhere = parse_service(service_obj("aaa", {"app": "web"}, ns="other"))
    services = [s for s in (billing, alpha, elsewhere) if s is not None]
    assert select_service("shop", {"app": "web"}, services) == "billing"
    # several select the pod: the lowest name, whatever the order
    both = {"app": "web", "tier": "front"}
    assert select_service("shop", both, services) == "alpha"
    assert select_service("shop", both, services[::-1]) == "alpha"
    assert select_service("shop", {"app": "db"}, services) is None

    # a Service in another namespace never selects: "aaa" is the lowest name but not shop's
    assert select_service("other", {"app": "web"}, services) == "aaa"
    assert select_service("evil", {"app": "web"}, services) is None

    def service_of(pod: dict[str, Any], given: list[ServiceSelector]) -> str:
        reg = registration_from_pod(pod, given)
        assert reg is not None  # injected, running, with an IP: registered either way
        return reg.service

    pod = pod_obj("web-0")
    reg = registration_from_pod(pod, services)
    assert reg is not None and reg.service == "billing" and reg.ready
    # no Service selects it: no mesh service; the app label and the service account name none
    pod["metadata"]["labels"]["app.kubernetes.io/name"] = "web"
    assert service_of(pod, []) == ""
    # what the pod says of itself never makes membership: the old service annotation is ignored
    pod["metadata"]["annotations"]["attestmesh.dev/service"] = "checkout"
    assert service_of(pod, services) == "billing"
    assert service_of(pod, []) == ""
    # the same pod in another namespace: only that namespace's Services count
    for ns, expected in (("other", "aaa"), ("evil", "")):
        moved = pod_obj("web-0", ns=ns)
        moved["metadata"]["annotations"]["attestmesh.dev/service"] = "billing"
        moved_reg = registration_from_pod(moved, services)
        assert moved_reg is not None
        assert (moved_reg.namespace, moved_reg.service) == (ns, expected)
    not_ready = registration_from_pod(pod, services, {WorkloadRef("shop", "web-0")})
    assert not_ready is not None and not not_ready.ready


def test_endpoint_slice_readiness_and_nodes_are_pure() -> None:
    s = slice_obj(
        "billing-x",
        "billing",
        {
            "ready": {"ready": True},
            "unknown": {},  # absent ready: ready, as the API defines it
            "starting": {"ready": False},
            "leaving": {"ready": True, "terminating": True},  # e.g. publishNotReadyAddresses
        },
    )
    s["endpoints"].append({"addresses": ["10.9.9.9"], "conditions": {"ready": False}})  # no ref
    s["endpoints"].append(
        {"addresses": ["10.9.9.8"], "conditions": {"ready": False},
         "targetRef": {"kind": "Node", "name": "n1"}}
    )  # fmt: skip
    s["endpoints"].append("garbage")
    assert not_ready_endpoints(s) == {
        WorkloadRef("shop", "starting"),
        WorkloadRef("shop", "leaving"),
    }
    assert not_ready_endpoints({}) == frozenset()

    info = parse_node(node_obj("n1", untrusted=True))
    assert info is not None and info.platform_untrusted and info.quarantine_applied
    plain = parse_node(node_obj("n2"))
    assert plain is not None and not plain.platform_untrusted
    assert parse_node({"metadata": {}}) is None


async def test_a_failed_first_service_list_and_a_410_mid_watch_lose_no_service(
    kube: FakeKube,
) -> None:
    """Fake only: a 500 answering the first Service list (pods wait for it), and an open
    Service watch ended by 410 Gone at the moment the test chooses (a real server sends that
    only after a restart on compacted history: test_watch_restart shows it for pods). Service
    selection itself runs on the real server (tests/kube_real/test_kube_adapter.py)."""
    await kube.put_object("services", service_obj("billing", {"app": "web"}))
    await kube.put_object("pods", pod_obj("web-0"))
    kube.fail("GET", "/api/v1/services", 500)  # the first Service list fails: pods wait
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(
        kc(kube), rec.callbacks(), metrics=metrics, watch_timeout=2, backoff=(0.05, 0.1)
    )
    async with running(source):
        # announced once, already with the Service's name (pods are listed after Services)
        assert metrics.watch_restarts.labels(resource="services", reason="error")._value.get() == 1
        assert [(r.name, r.service) for r in rec.registered] == [("shop/web-0", "billing")]
        await kube.delete_object("services", "shop", "billing")
        await eventually(lambda: source.pods["shop/web-0"].service == "")
        # a Service created while the watch is gone (410): seen after the relist
        services = source.watcher("services")
        lists = services.lists
        kube.compact(drop_watches=True)
        await kube.put_object("services", service_obj("billing", {"app": "web"}))
        await eventually(lambda: source.pods["shop/web-0"].service == "billing")
        await eventually(lambda: services.lists == lists + 1)
    assert metrics.watch_restarts.labels(resource="services", reason="gone")._value.get() >= 1


async def test_endpoint_slices_set_readiness(kube: FakeKube) -> None:
    """Fake only: discovery.k8s.io/v1 EndpointSlices, which kube-apiserver 1.20 does not serve
    (v1beta1 only; no newer full server can be built here)."""
    await kube.put_object("services", service_obj("billing", {"app": "web"}))
    await kube.put_object("pods", pod_obj("web-0"))
    await kube.put_object("pods", pod_obj("web-1", ip="10.1.0.6"))
    group = "discovery.k8s.io"
    both_ready = {"web-0": {"ready": True}, "web-1": {"ready": True}}
    await kube.put_object(
        "endpointslices",
        slice_obj("billing-a", "billing", {**both_ready, "web-1": {"ready": False}}),
        group,
    )
    rec = Recorder()
    source = KubeSource(kc(kube), rec.callbacks(), watch_timeout=2)

    def ready(name: str) -> bool:
        return source.pods[name].ready

    async with running(source):
        # known before the pods were listed: announced not ready from the start
        assert {r.name: r.ready for r in rec.registered} == {
            "shop/web-0": True,
            "shop/web-1": False,
        }
        await kube.put_object(
            "endpointslices", slice_obj("billing-a", "billing", both_ready), group
        )
        await eventually(lambda: ready("shop/web-1"))
        # terminating: out of traffic even where the slice still says ready
        leaving = {**both_ready, "web-0": {"ready": True, "terminating": True}}
        await kube.put_object("endpointslices", slice_obj("billing-a", "billing", leaving), group)
        await eventually(lambda: not ready("shop/web-0"))
        assert ready("shop/web-1")
        # another Service's slice also counts: not ready in any slice is not ready
        await kube.put_object(
            "endpointslices", slice_obj("billing-a", "billing", both_ready), group
        )
        await kube.put_object(
            "endpointslices", slice_obj("web-b", "web", {"web-1": {"ready": False}}), group
        )
        await eventually(lambda: ready("shop/web-0") and not ready("shop/web-1"))
        # the slice goes (e.g. its Service was deleted): ready again
        slices = source.watcher("endpointslices")
        lists = slices.lists
        kube.compact(drop_watches=True)
        await kube.delete_object("endpointslices", "shop", "web-b", group)
        await eventually(lambda: ready("shop/web-1"))
        await eventually(lambda: slices.lists == lists + 1)
        # the pod's IP changes through the pod watch, readiness kept
        await kube.put_object(
            "endpointslices", slice_obj("billing-a", "billing", {"web-0": {"ready": False}}), group
        )
        await eventually(lambda: not ready("shop/web-0"))
        await kube.put_object("pods", pod_obj("web-0", ip="10.1.0.50"))
        await eventually(lambda: source.pods["shop/web-0"].inbound.address == "10.1.0.50")
        assert not ready("shop/web-0")
    assert source.not_ready == {WorkloadRef("shop", "web-0")}


async def test_the_node_watch_relists_after_a_410_mid_watch(kube: FakeKube) -> None:
    """Fake only: an open Node watch ended by 410 Gone at the moment the test chooses (see the
    Service test above). Listing, watching and counting nodes run on the real server
    (tests/kube_real/test_kube_mode_actions.py)."""
    await kube.put_object("nodes", node_obj("n1", untrusted=True))
    await kube.put_object("nodes", node_obj("n2", untrusted=True))
    removed: list[str] = []

    async def on_node(info: NodeInfo) -> None:
        pass

    async def on_node_removed(name: str) -> None:
        removed.append(name)

    rec = Recorder()
    cb = rec.callbacks()
    cb.on_node, cb.on_node_removed = on_node, on_node_removed
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(kube), cb, metrics=metrics, watch_timeout=2, watch_nodes=True)
    untrusted = metrics.untrusted_nodes._value
    async with running(source):
        assert untrusted.get() == 2
        await kube.put_object("nodes", node_obj("n1"))  # an operator removed the taint
        await eventually(lambda: untrusted.get() == 1)
        nodes = source.watcher("nodes")
        lists = nodes.lists
        kube.compact(drop_watches=True)
        await kube.delete_object("nodes", "", "n2")  # while the watch is gone
        await eventually(lambda: removed == ["n2"])
        await eventually(lambda: nodes.lists == lists + 1)
        assert untrusted.get() == 0
        await kube.put_object("nodes", node_obj("n3"))  # and it watches again
        await eventually(lambda: "n3" in source.nodes)
    assert set(source.nodes) == {"n1", "n3"}
    assert metrics.watch_restarts.labels(resource="nodes", reason="gone")._value.get() >= 1
