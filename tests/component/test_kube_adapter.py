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

from certs.policy import AttestationPolicy
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
    SourceCallbacks,
    TokenReviewer,
    TokenReviewError,
    WorkloadRef,
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
    assert await reviewer.verify_token("good") == ("shop", "web")
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
    assert not a.is_leader  # a's own renewal expired: it stops acting even before it learns
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
        async def on_policies(p: list[AttestationPolicy]) -> None:
            self.policies.append(p)

        async def on_mesh(p: list[MeshPolicy]) -> None:
            self.mesh.append(p)

        async def on_reg(r: Registration) -> None:
            self.registered.append(r)

        async def on_removed(n: str) -> None:
            self.removed.append(n)

        return SourceCallbacks(on_policies, on_mesh, on_reg, on_removed)


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
        assert reg.service_account == "web" and reg.service == "web"

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
    state, _ = quarantine(state, "shop/web-0", Trigger.VERIFICATION_FAILED, "chain_invalid: x", T0)
    state, _ = quarantine(state, "local-1", Trigger.OPERATOR, "manual", T0)
    actions = KubeActions(kc(kube), clock=lambda: T0)
    first = await actions.reapply(state)
    second = await actions.reapply(state)  # e.g. after a restart
    assert set(first) == {"shop/web-0"} and first == second
    assert first["shop/web-0"].node_tainted == "n1"  # chain_invalid indicts the platform
    node = kube.get("nodes", "", "n1")
    assert node is not None and len(node["spec"]["taints"]) == 1
    assert await actions.release("shop/web-0") is ActionResult.DONE
    pod = kube.get("pods", "shop", "web-0")
    assert pod is not None and LABEL_QUARANTINED not in pod["metadata"]["labels"]
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED)
    assert cond["status"] == "True"
