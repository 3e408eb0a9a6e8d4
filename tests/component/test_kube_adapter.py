"""xds.kube driven through the real kubernetes client against the fake API server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry

from certs.policy import AttestationPolicy, parse_policies
from tests.fakekube import FakeKube
from xds.kube import (
    CONDITION_ACCEPTED,
    CONDITION_ATTESTED,
    LABEL_QUARANTINED,
    TAINT_PLATFORM_UNTRUSTED,
    ActionResult,
    KubeActions,
    KubeClient,
    KubeMetrics,
    KubeSource,
    LeaderElector,
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
    Endpoint,
    MeshState,
    Registration,
    Trigger,
    quarantine,
    register,
)

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


async def eventually(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not check():
            await asyncio.sleep(0.02)


# --- TokenReview ------------------------------------------------------------------------------


async def test_verify_token(kube: FakeKube) -> None:
    kube.add_token("good", "shop", "web")
    kube.add_token("other-aud", "shop", "web", audiences=["vault"])
    reviewer = TokenReviewer(kc(kube))
    assert await reviewer.verify_token("good") == ReviewedToken("shop", "web")  # no pod claims
    assert kube.token_reviews[-1] == {"token": "good", "audiences": ["attestmesh"]}
    for token, reason in (
        ("other-aud", "token_invalid"),
        ("bad", "token_invalid"),
        ("", "token_missing"),
    ):
        with pytest.raises(TokenReviewError) as exc:
            await reviewer.verify_token(token)
        assert exc.value.reason == reason
    kube.fail("POST", "tokenreviews", 500)
    with pytest.raises(TokenReviewError) as exc:
        await reviewer.verify_token("good")
    assert exc.value.reason == "token_review_failed"


async def test_verify_token_refuses_non_service_account_users(kube: FakeKube) -> None:
    kube.add_token("user", "shop", "web")
    kube.tokens["user"].username = "alice"
    with pytest.raises(TokenReviewError) as exc:
        await TokenReviewer(kc(kube)).verify_token("user")
    assert exc.value.reason == "token_not_service_account"


# --- leader election ---------------------------------------------------------------------------


def leading(elector: LeaderElector) -> bool:
    """``is_leader`` read anew (an ``assert`` on the property would narrow it for mypy)."""
    return elector.is_leader


async def test_two_electors_one_leader_and_takeover_after_expiry(kube: FakeKube) -> None:
    now = [T0]

    def clock() -> datetime:
        return now[0]

    a = LeaderElector(kc(kube), "cp-a", clock=clock)
    b = LeaderElector(kc(kube), "cp-b", clock=clock)
    assert await a.step() is True
    assert await b.step() is False and b.holder == "cp-a"
    now[0] += timedelta(seconds=10)
    assert await a.step() is True  # renew
    now[0] += timedelta(seconds=10)
    assert await b.step() is False  # renewed 10 s ago: still a's
    assert a.is_leader and not b.is_leader
    # a stops renewing (partition); after the lease duration b takes over
    now[0] += timedelta(seconds=16)
    assert not leading(a)  # a's own renewal expired: it stops acting even before it learns
    assert await b.step() is True
    lease = kube.get(
        "leases", "attestmesh-system", "attestmesh-controlplane-leader", "coordination.k8s.io"
    )
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "cp-b"
    assert lease["spec"]["leaseTransitions"] == 1
    assert await a.step() is False and a.holder == "cp-b"


async def test_conflict_loses_leadership(kube: FakeKube) -> None:
    now = [T0]
    a = LeaderElector(kc(kube), "cp-a", clock=lambda: now[0])
    assert await a.step() is True
    kube.fail("PUT", "leases", 409)
    now[0] += timedelta(seconds=1)
    assert await a.step() is False
    assert not a.is_leader


async def test_run_loop_with_injected_sleep(kube: FakeKube) -> None:
    changes: list[bool] = []
    steps = 0

    async def sleep(_: float) -> None:
        nonlocal steps
        steps += 1
        if steps >= 3:
            raise asyncio.CancelledError
        await asyncio.sleep(0)

    a = LeaderElector(kc(kube), "cp-a", sleep=sleep, on_change=changes.append)
    with contextlib.suppress(asyncio.CancelledError):
        await a.run()
    assert changes == [True, False]


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


def accepted(kube: FakeKube, name: str) -> dict[str, Any] | None:
    obj = kube.get("attestationpolicies", "shop", name, "attestmesh.dev")
    assert obj is not None
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == CONDITION_ACCEPTED:
            return dict(c)
    return None


async def test_policies_invalid_cr_refused_with_every_problem_and_previous_kept(
    kube: FakeKube,
) -> None:
    await kube.put_object("attestationpolicies", policy_cr("good"), "attestmesh.dev")
    bad = policy_cr("bad", allowedTees=["sim", "quantum"], certificateTTL="forever")
    await kube.put_object("attestationpolicies", bad, "attestmesh.dev")
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(
        kc(kube), rec.callbacks(), metrics=metrics, watch_timeout=2, clock=lambda: T0
    )
    async with running(source):
        assert [p.name for p in rec.policies[-1]] == ["shop/good"]
        assert rec.mesh[-1] == []
        await eventually(lambda: accepted(kube, "bad") is not None)
        cond = accepted(kube, "bad")
        assert cond is not None
        assert cond["status"] == "False" and cond["reason"] == "Invalid"
        assert "quantum" in cond["message"] and "forever" in cond["message"]
        await eventually(lambda: accepted(kube, "good") is not None)
        assert (accepted(kube, "good") or {})["status"] == "True"
        events = kube.list("events", "shop")
        assert any(
            e["reason"] == "Invalid" and e["involvedObject"]["name"] == "bad" for e in events
        )

        # the good policy turns invalid: refused, its previous version stays in force
        broken = policy_cr("good", allowedTees=[])
        await kube.put_object("attestationpolicies", broken, "attestmesh.dev")
        await eventually(lambda: (accepted(kube, "good") or {}).get("status") == "False")
        cond = accepted(kube, "good") or {}
        assert "previous valid version stays in force" in cond["message"]
        assert [p.name for p in rec.policies[-1]] == ["shop/good"]
        assert rec.policies[-1][0].allowed_tees  # the old, valid spec

        # fixed: accepted again, new version in force
        fixed = policy_cr("good", mode="audit")
        await kube.put_object("attestationpolicies", fixed, "attestmesh.dev")
        await eventually(lambda: (accepted(kube, "good") or {}).get("status") == "True")
        await eventually(lambda: rec.policies[-1][0].mode.value == "audit")

        # deleted: leaves
        await kube.delete_object("attestationpolicies", "shop", "good", "attestmesh.dev")
        await eventually(lambda: rec.policies[-1] == [])
    assert metrics.refused.labels(kind="AttestationPolicy")._value.get() >= 2


async def test_status_writes_only_by_the_leader(kube: FakeKube) -> None:
    await kube.put_object("attestationpolicies", policy_cr("bad", allowedTees=[]), "attestmesh.dev")
    rec = Recorder()
    source = KubeSource(kc(kube), rec.callbacks(), is_leader=lambda: False, watch_timeout=2)
    async with running(source):
        await asyncio.sleep(0.2)
    assert accepted(kube, "bad") is None
    assert kube.list("events", "shop") == []


async def test_pods_become_registrations_and_watch_relists_after_410(kube: FakeKube) -> None:
    await kube.put_object("pods", pod_obj("web-0"))
    plain = pod_obj("plain")
    plain["metadata"]["annotations"] = {}
    await kube.put_object("pods", plain)
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(kube), rec.callbacks(), metrics=metrics, watch_timeout=2)
    async with running(source):
        assert [r.name for r in rec.registered] == ["shop/web-0"]
        reg = rec.registered[0]
        assert reg.inbound == Endpoint("10.1.0.5", 15006)
        assert reg.app_port == 8080 and reg.outbound == {"billing": 15001}
        # labelled app=web, service account web, but no Service selects it: it serves no mesh
        # service (it may still call billing)
        assert reg.service_account == "web" and reg.service == ""

        await kube.put_object("pods", pod_obj("web-1", ip="10.1.0.6"))
        await eventually(lambda: [r.name for r in rec.registered][-1:] == ["shop/web-1"])

        pods_watcher = source.watchers[-1]
        lists_before = pods_watcher.lists
        kube.compact(drop_watches=True)
        await kube.delete_object("pods", "shop", "web-0")
        await eventually(lambda: rec.removed == ["shop/web-0"])
        await eventually(lambda: pods_watcher.lists == lists_before + 1)
        gone = metrics.watch_restarts.labels(resource="pods", reason="gone")._value.get()
        assert gone >= 1
        await kube.put_object("pods", pod_obj("web-2", ip="10.1.0.7"))
        await eventually(lambda: [r.name for r in rec.registered][-1:] == ["shop/web-2"])
    assert source.pods.keys() == {"shop/web-1", "shop/web-2"}


async def test_watch_backs_off_on_errors(kube: FakeKube) -> None:
    kube.fail("GET", "/api/v1/pods", 500)
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(kube), rec.callbacks(), metrics=metrics, backoff=(0.01, 0.05))
    async with running(source):
        pass
    assert metrics.watch_restarts.labels(resource="pods", reason="error")._value.get() == 1


# --- quarantine actions ------------------------------------------------------------------------


async def seeded(kube: FakeKube) -> None:
    await kube.put_object("nodes", {"metadata": {"name": "n1"}, "spec": {}})
    await kube.put_object("pods", pod_obj("web-0"))


async def test_quarantine_is_idempotent(kube: FakeKube) -> None:
    await seeded(kube)
    actions = KubeActions(kc(kube), clock=lambda: T0, metrics=KubeMetrics(CollectorRegistry()))
    for _ in range(2):
        out = await actions.quarantine(
            "shop/web-0",
            "tcb_revoked: SNP TCB revoked",
            Trigger.TCB_REVOKED,
            evict=False,
            platform_failed=True,
        )
        assert out.result is ActionResult.DONE and out.node_tainted == "n1"
    pod = kube.get("pods", "shop", "web-0")
    assert pod is not None
    assert pod["metadata"]["labels"][LABEL_QUARANTINED] == "true"
    conds = [c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED]
    assert len(conds) == 1
    assert conds[0]["status"] == "False" and conds[0]["reason"] == "TcbRevoked"
    node = kube.get("nodes", "", "n1")
    assert node is not None
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_PLATFORM_UNTRUSTED]
    assert node["spec"]["taints"][0]["effect"] == "NoSchedule"
    assert node["metadata"]["labels"]["attestmesh.dev/platform-untrusted"] == "true"
    pod_events = [e for e in kube.list("events", "shop") if e["reason"] == "Quarantined"]
    assert len(pod_events) == 1 and pod_events[0]["count"] == 2  # aggregated
    # the second pass wrote nothing to the pod or the node
    pod_writes = [r for r in kube.requests if r[0] == "PATCH" and "/pods/web-0" in r[1]]
    node_writes = [r for r in kube.requests if r[0] == "PATCH" and "/nodes/n1" in r[1]]
    assert len(pod_writes) == 2 and len(node_writes) == 1


async def test_quarantine_and_evict(kube: FakeKube) -> None:
    await seeded(kube)
    actions = KubeActions(kc(kube))
    out = await actions.quarantine(
        WorkloadRef("shop", "web-0"),
        "appraisal failed",
        Trigger.APPRAISAL_FAILED,
        evict=True,
        platform_failed=False,
    )
    assert out.evicted and out.node_tainted is None
    assert kube.get("pods", "shop", "web-0") is None
    again = await actions.quarantine(
        "shop/web-0",
        "appraisal failed",
        Trigger.APPRAISAL_FAILED,
        evict=True,
        platform_failed=False,
    )
    assert again.result is ActionResult.POD_GONE


async def test_eviction_blocked_by_disruption_budget(kube: FakeKube) -> None:
    await seeded(kube)
    kube.block_eviction("shop", "web-0")
    out = await KubeActions(kc(kube)).quarantine(
        "shop/web-0", "x", Trigger.DEADLINE_MISSED, evict=True, platform_failed=False
    )
    assert out.result is ActionResult.EVICTION_BLOCKED
    assert kube.get("pods", "shop", "web-0") is not None
    assert any(e["reason"] == "EvictionBlocked" for e in kube.list("events", "shop"))


async def test_audit_mode_and_followers_do_nothing_but_record(kube: FakeKube) -> None:
    await seeded(kube)
    metrics = KubeMetrics(CollectorRegistry())
    actions = KubeActions(kc(kube), metrics=metrics)
    await actions.record_audit("shop/web-0", "measurement_not_allowed", Trigger.APPRAISAL_FAILED)
    pod = kube.get("pods", "shop", "web-0")
    assert pod is not None and LABEL_QUARANTINED not in pod["metadata"]["labels"]
    assert [e["reason"] for e in kube.list("events", "shop")] == ["AttestationAudit"]
    assert metrics.audits.labels(trigger="appraisal_failed")._value.get() == 1
    follower = KubeActions(kc(kube), is_leader=lambda: False)
    out = await follower.quarantine(
        "shop/web-0", "x", Trigger.OPERATOR, evict=True, platform_failed=True
    )
    assert out.result is ActionResult.NOT_LEADER
    assert kube.get("pods", "shop", "web-0") is not None


async def test_release_and_reapply_from_persisted_state(kube: FakeKube) -> None:
    await seeded(kube)
    reg = Registration("shop/web-0", "shop", "web", "web", Endpoint("10.1.0.5", 15006), 8080)
    state, _ = register(MeshState("example.org"), reg, T0)
    local = Registration("local-1", "default", "x", "x", Endpoint("127.0.0.1", 1), 2)
    state, _ = register(state, local, T0)
    state, _ = quarantine(
        state, "shop/web-0", Trigger.TCB_REVOKED, "tcb_status_not_accepted: Revoked", T0,
        code="tcb_status_not_accepted", platform=True,
    )  # fmt: skip
    state, _ = quarantine(state, "local-1", Trigger.OPERATOR, "manual", T0)
    actions = KubeActions(kc(kube), clock=lambda: T0)
    first = await actions.reapply(state)
    second = await actions.reapply(state)  # e.g. after a restart
    assert set(first) == {"shop/web-0"} and first == second
    assert first["shop/web-0"].node_tainted == "n1"  # authentic evidence indicts the platform
    node = kube.get("nodes", "", "n1")
    assert node is not None and len(node["spec"]["taints"]) == 1
    assert await actions.release("shop/web-0") is ActionResult.DONE
    pod = kube.get("pods", "shop", "web-0")
    assert pod is not None and LABEL_QUARANTINED not in pod["metadata"]["labels"]
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED)
    assert cond["status"] == "True"


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


async def test_services_name_pods_and_their_changes_reregister(kube: FakeKube) -> None:
    await kube.put_object("services", service_obj("billing", {"app": "web"}))
    await kube.put_object("services", service_obj("zeta", {"app": "web"}))
    # another namespace's Service selecting the same labels, with the lowest name: never shop's
    await kube.put_object("services", service_obj("aaa", {"app": "web"}, ns="other"))
    await kube.put_object("pods", pod_obj("web-0"))
    annotated = pod_obj("web-1", ip="10.1.0.6")
    annotated["metadata"]["annotations"]["attestmesh.dev/service"] = "checkout"  # ignored
    await kube.put_object("pods", annotated)
    await kube.put_object("pods", pod_obj("web-9", ns="other", ip="10.2.0.9"))
    kube.fail("GET", "/api/v1/services", 500)  # the first Service list fails: pods wait
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(
        kc(kube), rec.callbacks(), metrics=metrics, watch_timeout=2, backoff=(0.05, 0.1)
    )

    def service_of(name: str) -> str:
        return source.pods[name].service

    def shop_services() -> set[str]:
        return {service_of("shop/web-0"), service_of("shop/web-1")}

    async with running(source):
        # announced once, already with the Service's name (pods are listed after Services);
        # the annotation names nothing, each namespace's pods get only their own Service
        assert metrics.watch_restarts.labels(resource="services", reason="error")._value.get() == 1
        assert len(rec.registered) == 3
        assert {r.name: r.service for r in rec.registered} == {
            "shop/web-0": "billing",
            "shop/web-1": "billing",
            "other/web-9": "aaa",
        }
        # the lowest-named Service goes: the next one names the pods (both, annotation or not)
        await kube.delete_object("services", "shop", "billing")
        await eventually(lambda: shop_services() == {"zeta"})
        assert len(rec.registered) == 5
        assert {r.name for r in rec.registered[-2:]} == {"shop/web-0", "shop/web-1"}
        # a change that is not the selector re-registers nothing
        count = len(rec.registered)
        ported = service_obj("zeta", {"app": "web"})
        ported["spec"]["ports"] = [{"port": 81}]
        await kube.put_object("services", ported)
        # the selector no longer matches: no Service in shop selects them; the app label, the
        # service account and the annotation name no mesh service
        await kube.put_object("services", service_obj("zeta", {"app": "other"}))
        await eventually(lambda: shop_services() == {""})
        assert len(rec.registered) == count + 2
        assert service_of("other/web-9") == "aaa"  # other's Service is no fallback for shop

        # a Service created while the watch is gone (410): seen after the relist
        services = source.watcher("services")
        lists = services.lists
        kube.compact(drop_watches=True)
        await kube.put_object("services", service_obj("billing", {"app": "web"}))
        await eventually(lambda: shop_services() == {"billing"})
        await eventually(lambda: services.lists == lists + 1)
        # a pod created later is derived with the Services known
        await kube.put_object("pods", pod_obj("web-2", ip="10.1.0.7"))
        await eventually(lambda: "shop/web-2" in source.pods)
        assert service_of("shop/web-2") == "billing"
    assert service_of("shop/web-1") == "billing"  # the annotation never counted
    assert service_of("other/web-9") == "aaa"
    assert [r.service for r in rec.registered if r.name == "other/web-9"] == ["aaa"]  # once
    assert not rec.removed
    assert metrics.watch_restarts.labels(resource="services", reason="gone")._value.get() >= 1


async def test_endpoint_slices_set_readiness(kube: FakeKube) -> None:
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


async def test_node_watch_lists_watches_and_relists(kube: FakeKube) -> None:
    await kube.put_object("nodes", node_obj("n1", untrusted=True))
    await kube.put_object("nodes", node_obj("n2"))
    seen: list[str] = []
    removed: list[str] = []

    async def on_node(info: NodeInfo) -> None:
        seen.append(info.name)

    async def on_node_removed(name: str) -> None:
        removed.append(name)

    rec = Recorder()
    cb = rec.callbacks()
    cb.on_node, cb.on_node_removed = on_node, on_node_removed
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(kube), cb, metrics=metrics, watch_timeout=2, watch_nodes=True)
    untrusted = metrics.untrusted_nodes._value
    async with running(source):
        assert sorted(seen) == ["n1", "n2"]
        assert source.nodes["n1"].platform_untrusted and untrusted.get() == 1
        await kube.put_object("nodes", node_obj("n2", untrusted=True))
        await eventually(lambda: untrusted.get() == 2)
        await kube.put_object("nodes", node_obj("n1"))  # an operator removed the taint
        await eventually(lambda: untrusted.get() == 1)

        nodes = source.watcher("nodes")
        lists = nodes.lists
        kube.compact(drop_watches=True)
        await kube.delete_object("nodes", "", "n2")
        await eventually(lambda: removed == ["n2"])
        await eventually(lambda: nodes.lists == lists + 1)
        assert untrusted.get() == 0
        await kube.put_object("nodes", node_obj("n3"))
        await eventually(lambda: "n3" in source.nodes)
        await kube.delete_object("nodes", "", "n3")  # a deleted node: gone, nothing else
        await eventually(lambda: "n3" not in source.nodes)
    assert set(source.nodes) == {"n1"}
    assert metrics.watch_restarts.labels(resource="nodes", reason="gone")._value.get() >= 1


async def test_quarantine_skips_reading_a_node_the_watch_saw_tainted(kube: FakeKube) -> None:
    await kube.put_object("nodes", node_obj("n1", untrusted=True))
    await kube.put_object("pods", pod_obj("web-0"))
    known = parse_node(node_obj("n1", untrusted=True))
    actions = KubeActions(kc(kube), clock=lambda: T0, nodes={"n1": known}.get)
    out = await actions.quarantine(
        "shop/web-0", "tcb_revoked: x", Trigger.TCB_REVOKED, evict=False, platform_failed=True
    )
    assert out.node_tainted == "n1"
    assert not [r for r in kube.requests if "/nodes/" in r[1]]  # neither read nor written
    # a node the watch has not seen (or saw untainted) is read and tainted as before
    await kube.put_object("nodes", node_obj("n2"))
    await kube.put_object("pods", pod_obj("web-1", node="n2"))
    out = await actions.quarantine(
        "shop/web-1", "tcb_revoked: x", Trigger.TCB_REVOKED, evict=False, platform_failed=True
    )
    node = kube.get("nodes", "", "n2")
    assert out.node_tainted == "n2" and node is not None
    assert [t["key"] for t in node["spec"]["taints"]] == [TAINT_PLATFORM_UNTRUSTED]
