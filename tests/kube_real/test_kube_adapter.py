"""xds.kube (TokenReview, the Lease, the watching source, quarantine actions) driven through
the real kubernetes client against a real kube-apiserver 1.20.2, as the manifests'
ServiceAccount (its RBAC authorizes every call; moved here from
tests/component/test_kube_adapter.py, which ran them against tests/fakekube; what stays there
are faults a real server cannot be made to produce on demand). Each test has a namespace of its
own; the cluster is shared by the session, so what the source sees is filtered to it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from attestmesh.kube_mode import connect
from tests.component.test_kube_adapter import Recorder, running
from tests.kube_real.plane import (
    GROUP_VERSION,
    Env,
    audited,
    namespace_doc,
    ours,
    policy,
    service_account_doc,
    service_account_token,
    writes_to,
)
from tests.kube_real.rest import Rest, until
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
    ReviewedToken,
    TokenReviewer,
    TokenReviewError,
    WorkloadRef,
    parse_node,
)
from xds.kube.events import EVENT_BURST, EVENT_REFILL, MAX_COUNT, EventRecorder, event_body
from xds.state import Endpoint, MeshState, Registration, Trigger, quarantine, register

pytestmark = pytest.mark.integration

LEASE = ("coordination.k8s.io/v1", "Lease", "attestmesh-system", "attestmesh-controlplane-leader")


def kc(env: Env) -> KubeClient:
    """A client as the control plane (the manifests' ServiceAccount)."""
    return connect(env.kubeconfig, 10)


def own_namespace(admin: Rest, ns: str) -> None:
    admin.apply(namespace_doc(ns))
    admin.apply(service_account_doc(ns, "web"))


def node_doc(name: str, *, untrusted: bool = False) -> dict[str, Any]:
    taints = (
        [{"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}]
        if untrusted
        else []
    )
    labels = {"attestmesh.dev/platform-untrusted": "true"} if untrusted else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {"taints": taints},
    }


def pod_doc(name: str, ns: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceAccountName": "web",
        "automountServiceAccountToken": False,
        "containers": [{"name": "app", "image": "x", "ports": [{"containerPort": 8080}]}],
    }
    if node is not None:
        spec["nodeName"] = node
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
        "spec": spec,
    }


def running_pod(admin: Rest, doc: dict[str, Any], ip: str) -> dict[str, Any]:
    admin.create(doc)
    meta = doc["metadata"]
    return dict(
        admin.patch(
            "v1", "Pod", meta["namespace"], meta["name"],
            {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
            subresource="status",
        )
    )  # fmt: skip


def events(admin: Rest, ns: str, reason: str | None = None) -> list[dict[str, Any]]:
    return [e for e in admin.items("v1", "Event", ns) if reason is None or e["reason"] == reason]


# --- TokenReview ------------------------------------------------------------------------------


async def test_verify_token(env: Env) -> None:
    admin, ns = env.admin, "ad-token"
    await asyncio.to_thread(own_namespace, admin, ns)
    good = await asyncio.to_thread(
        service_account_token, admin, ns, "web", audiences=["attestmesh"]
    )
    other_aud = await asyncio.to_thread(
        service_account_token, admin, ns, "web", audiences=["vault"]
    )
    reviewer = TokenReviewer(kc(env))
    assert await reviewer.verify_token(good) == ReviewedToken(ns, "web")  # no pod claims
    for token, reason in (
        (other_aud, "token_invalid"),
        (good[:-4] + "AAAA", "token_invalid"),  # a bad signature
        ("bad", "token_invalid"),
        ("", "token_missing"),
    ):
        with pytest.raises(TokenReviewError) as exc:
            await reviewer.verify_token(token)
        assert exc.value.reason == reason


async def test_verify_token_refuses_non_service_account_users(env: Env) -> None:
    # a static token of the server's --token-auth-file: authenticated, but a user, not a pod
    user, token = env.cluster.static_user
    assert user == "alice"
    with pytest.raises(TokenReviewError) as exc:
        await TokenReviewer(kc(env)).verify_token(token)
    assert exc.value.reason == "token_not_service_account"


# --- leader election on the one real Lease -----------------------------------------------------


def leading(elector: LeaderElector) -> bool:
    """``is_leader`` read anew (an ``assert`` on the property would narrow it for mypy)."""
    return elector.is_leader


def transitions(admin: Rest) -> int:
    lease = admin.get_or_none(*LEASE)
    return 0 if lease is None else int(lease["spec"].get("leaseTransitions") or 0)


async def test_two_electors_one_leader_and_takeover_after_expiry(env: Env) -> None:
    """The clock is injected (the Lease's times are what the electors write): expiry takes no
    waiting. The session's control planes released the Lease on the way out."""
    now = [datetime.now(UTC)]

    def clock() -> datetime:
        return now[0]

    a = LeaderElector(kc(env), "ad-a", clock=clock)
    b = LeaderElector(kc(env), "ad-b", clock=clock)
    assert await a.step() is True
    assert await b.step() is False and b.holder == "ad-a"
    before = await asyncio.to_thread(transitions, env.admin)
    now[0] += timedelta(seconds=10)
    assert await a.step() is True  # renew
    now[0] += timedelta(seconds=10)
    assert await b.step() is False  # renewed 10 s ago: still a's
    assert a.is_leader and not b.is_leader
    # a stops renewing (partition); after the lease duration b takes over
    now[0] += timedelta(seconds=16)
    assert not leading(a)  # a's own renewal expired: it stops acting even before it learns
    assert await b.step() is True
    lease = await asyncio.to_thread(env.admin.get, *LEASE)
    assert lease["spec"]["holderIdentity"] == "ad-b"
    assert lease["spec"]["leaseTransitions"] == before + 1
    assert await a.step() is False and a.holder == "ad-b"
    await b.release()
    lease = await asyncio.to_thread(env.admin.get, *LEASE)
    assert lease["spec"].get("holderIdentity") in (None, "")


class RacingClient(KubeClient):
    """The control plane's client; ``race`` runs once just before its next Lease replace (a
    replica that writes between this one's read and its write)."""

    race: Callable[[], None] | None = None

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        race, self.race = self.race, None
        if race is not None and getattr(fn, "__name__", "") == "replace_namespaced_lease":
            await asyncio.to_thread(race)
        elif race is not None:
            self.race = race
        return await super().call(fn, *args, **kwargs)


def raced_pending(racing: RacingClient) -> bool:
    return racing.race is not None


async def test_a_real_conflict_loses_leadership(env: Env) -> None:
    racing = RacingClient(kc(env).api_client, request_timeout=10)
    now = [datetime.now(UTC)]
    a = LeaderElector(racing, "ad-a", clock=lambda: now[0])
    assert await a.step() is True

    def other_replica_writes() -> None:
        lease = env.admin.get(*LEASE)
        lease["metadata"].setdefault("annotations", {})["test/raced"] = str(now[0])
        env.admin.call("PUT", env.admin.path(*LEASE[:3], LEASE[3]), lease)

    racing.race = other_replica_writes
    now[0] += timedelta(seconds=1)
    assert await a.step() is False  # the server answered 409: its resourceVersion is stale
    assert not raced_pending(racing) and not a.is_leader
    assert await a.step() is True  # read afresh: still its own Lease, renewed
    await a.release()


async def test_run_loop_with_injected_sleep(env: Env) -> None:
    changes: list[bool] = []
    steps = 0

    async def sleep(_: float) -> None:
        nonlocal steps
        steps += 1
        if steps >= 3:
            raise asyncio.CancelledError
        await asyncio.sleep(0)

    a = LeaderElector(kc(env), "ad-a", sleep=sleep, on_change=changes.append)
    with contextlib.suppress(asyncio.CancelledError):
        await a.run()
    assert changes == [True, False]
    await a.release()


# --- source: CRs and pods ---------------------------------------------------------------------


def accepted(admin: Rest, ns: str, name: str) -> dict[str, Any] | None:
    obj = admin.get(GROUP_VERSION, "AttestationPolicy", ns, name)
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == CONDITION_ACCEPTED:
            return dict(c)
    return None


async def test_policies_invalid_cr_refused_with_every_problem_and_previous_kept(
    env: Env,
) -> None:
    """The mistakes are ones only the CRDs' CEL rules forbid: 1.20 drops the rules and stores
    them (the parser is the check, as on any server without them)."""
    admin, ns = env.admin, "ad-policies"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("good", ns))
    bad = policy("bad", ns, allowedTees=["sim", "tdx"], certificateTTL="1h",
                 reattestationInterval="2h")  # fmt: skip
    await asyncio.to_thread(admin.apply, bad)
    rec = Recorder()
    metrics = KubeMetrics(CollectorRegistry())
    source = KubeSource(kc(env), rec.callbacks(), metrics=metrics, watch_timeout=30)

    def mine() -> list[str]:
        return [p.name for p in rec.policies[-1] if p.name.startswith(f"{ns}/")]

    def good_now() -> Any:
        return next(p for p in rec.policies[-1] if p.name == f"{ns}/good")

    async with running(source):
        assert mine() == [f"{ns}/good"]
        cond = await until(lambda: accepted(admin, ns, "bad"), what="bad's condition")
        assert cond["status"] == "False" and cond["reason"] == "Invalid"
        assert "required because tdx is allowed" in cond["message"]
        assert "must not exceed certificateTTL" in cond["message"]
        good = await until(lambda: accepted(admin, ns, "good"), what="good's condition")
        assert good["status"] == "True"
        invalid = await until(lambda: events(admin, ns, "Invalid") or None, what="Event")
        assert any(e["involvedObject"]["name"] == "bad" for e in invalid)

        # the good policy turns invalid: refused, its previous version stays in force
        broken = policy("good", ns, allowedTees=["sim", "nitro"])
        await asyncio.to_thread(admin.apply, broken)
        await until(lambda: (accepted(admin, ns, "good") or {}).get("status") == "False" or None)
        cond = accepted(admin, ns, "good") or {}
        assert "previous valid version stays in force" in cond["message"]
        assert mine() == [f"{ns}/good"]
        assert sorted(good_now().allowed_tees) == ["sim"]  # the old, valid spec

        # fixed: accepted again, new version in force
        await asyncio.to_thread(admin.apply, policy("good", ns, mode="audit"))
        await until(lambda: (accepted(admin, ns, "good") or {}).get("status") == "True" or None)
        await until(lambda: good_now().mode.value == "audit" or None)

        # deleted: leaves
        await asyncio.to_thread(admin.delete, GROUP_VERSION, "AttestationPolicy", ns, "good")
        await until(lambda: mine() == [] or None)
    assert metrics.refused.labels(kind="AttestationPolicy")._value.get() >= 2


async def test_status_writes_only_by_the_leader(env: Env) -> None:
    admin, ns = env.admin, "ad-follower"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("bad", ns, allowedTees=["sim", "tdx"]))
    rec = Recorder()
    source = KubeSource(kc(env), rec.callbacks(), is_leader=lambda: False, watch_timeout=30)
    async with running(source):
        assert f"{ns}/bad" not in [p.name for p in rec.policies[-1]]  # refused all the same
        await asyncio.sleep(0.3)
    assert await asyncio.to_thread(accepted, admin, ns, "bad") is None
    assert await asyncio.to_thread(events, admin, ns) == []
    assert (
        await asyncio.to_thread(writes_to, env, f"/apis/attestmesh.dev/v1alpha1/namespaces/{ns}/")
        == []
    )


async def test_pods_become_registrations(env: Env) -> None:
    """(The relist after a 410 of the pod watch runs on a restarted real server:
    test_watch_restart.)"""
    admin, ns = env.admin, "ad-pods"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(running_pod, admin, pod_doc("web-0", ns), "10.6.0.5")
    plain = pod_doc("plain", ns)
    plain["metadata"]["annotations"] = {}
    await asyncio.to_thread(running_pod, admin, plain, "10.6.0.9")
    rec = Recorder()
    source = KubeSource(kc(env), rec.callbacks(), watch_timeout=30)

    def mine() -> list[Registration]:
        return [r for r in rec.registered if r.namespace == ns]

    async with running(source):
        (reg,) = mine()
        assert reg.name == f"{ns}/web-0"
        assert reg.inbound == Endpoint("10.6.0.5", 15006)
        assert reg.app_port == 8080 and reg.outbound == {"billing": 15001}
        # labelled app=web, service account web, but no Service selects it: it serves no mesh
        # service (it may still call billing)
        assert reg.service_account == "web" and reg.service == ""

        await asyncio.to_thread(running_pod, admin, pod_doc("web-1", ns), "10.6.0.6")
        await until(lambda: [r.name for r in mine()][-1:] == [f"{ns}/web-1"] or None)
        await asyncio.to_thread(admin.delete, "v1", "Pod", ns, "web-0")
        await until(lambda: f"{ns}/web-0" in rec.removed or None)
    assert {k for k in source.pods if k.startswith(f"{ns}/")} == {f"{ns}/web-1"}


# --- quarantine actions ------------------------------------------------------------------------


async def seeded(env: Env, ns: str, node: str | None) -> None:
    await asyncio.to_thread(own_namespace, env.admin, ns)
    if node is not None:
        await asyncio.to_thread(env.admin.apply, node_doc(node))
    await asyncio.to_thread(running_pod, env.admin, pod_doc("web-0", ns, node), "10.6.1.5")


async def test_quarantine_is_idempotent(env: Env) -> None:
    admin, ns, node = env.admin, "ad-idem", "ad-idem-n1"
    await seeded(env, ns, node)
    actions = KubeActions(kc(env), metrics=KubeMetrics(CollectorRegistry()))
    for _ in range(2):
        out = await actions.quarantine(
            f"{ns}/web-0",
            "tcb_revoked: SNP TCB revoked",
            Trigger.TCB_REVOKED,
            evict=False,
            platform_failed=True,
        )
        assert out.result is ActionResult.DONE and out.node_tainted == node
    pod = await asyncio.to_thread(admin.get, "v1", "Pod", ns, "web-0")
    assert pod["metadata"]["labels"][LABEL_QUARANTINED] == "true"
    conds = [c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED]
    assert len(conds) == 1
    assert conds[0]["status"] == "False" and conds[0]["reason"] == "TcbRevoked"
    stored = await asyncio.to_thread(admin.get, "v1", "Node", None, node)
    (taint,) = ours(stored)
    assert taint["effect"] == "NoSchedule"
    assert stored["metadata"]["labels"]["attestmesh.dev/platform-untrusted"] == "true"
    (event,) = await asyncio.to_thread(events, admin, ns, "Quarantined")
    assert event["count"] == 1  # the second pass changed nothing: no second occurrence
    # the second pass wrote nothing to the pod, the node or the Events
    event_writes = await asyncio.to_thread(writes_to, env, f"/api/v1/namespaces/{ns}/events")
    assert [v for v, _ in event_writes] == ["create"]
    pod_writes = await asyncio.to_thread(writes_to, env, f"/api/v1/namespaces/{ns}/pods/web-0")
    node_writes = await asyncio.to_thread(writes_to, env, f"/api/v1/nodes/{node}")
    assert [v for v, _ in pod_writes] == ["patch", "patch"]  # the label, the condition
    assert [v for v, _ in node_writes] == ["patch"]


async def test_quarantine_and_evict(env: Env) -> None:
    admin, ns = env.admin, "ad-evict"
    await seeded(env, ns, None)  # not bound to a node: an evicted pod is deleted at once
    actions = KubeActions(kc(env))
    out = await actions.quarantine(
        WorkloadRef(ns, "web-0"),
        "appraisal failed",
        Trigger.APPRAISAL_FAILED,
        evict=True,
        platform_failed=False,
    )
    assert out.evicted and out.node_tainted is None
    assert await asyncio.to_thread(admin.get_or_none, "v1", "Pod", ns, "web-0") is None
    again = await actions.quarantine(
        f"{ns}/web-0", "appraisal failed", Trigger.APPRAISAL_FAILED, evict=True,
        platform_failed=False,
    )  # fmt: skip
    assert again.result is ActionResult.POD_GONE


async def test_eviction_blocked_by_disruption_budget(env: Env) -> None:
    """A real PodDisruptionBudget (policy/v1beta1 on 1.20) covering the pod: the server refuses
    the eviction with 429 (no disruption controller runs, so the budget allows nothing)."""
    admin, ns = env.admin, "ad-pdb"
    await seeded(env, ns, None)
    pdb = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "web"}}},
    }
    await asyncio.to_thread(admin.apply, pdb)
    out = await KubeActions(kc(env)).quarantine(
        f"{ns}/web-0", "x", Trigger.DEADLINE_MISSED, evict=True, platform_failed=False
    )
    assert out.result is ActionResult.EVICTION_BLOCKED
    assert await asyncio.to_thread(admin.get_or_none, "v1", "Pod", ns, "web-0") is not None
    assert await asyncio.to_thread(events, admin, ns, "EvictionBlocked")


async def test_events_about_one_object_are_budgeted_and_a_count_stops_at_the_int32_maximum(
    env: Env,
) -> None:
    admin, ns = env.admin, "ad-events"
    await asyncio.to_thread(own_namespace, admin, ns)
    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    recorder = EventRecorder(kc(env), lambda: now[0], "cp-0")
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "namespace": ns}
    for _ in range(EVENT_BURST + 5):  # an agent failing its audit in a loop
        await recorder.record(pod, "AttestationAudit", "would quarantine")
    (event,) = await asyncio.to_thread(events, admin, ns)
    assert event["count"] == EVENT_BURST and recorder.dropped == 5
    now[0] += EVENT_REFILL  # one more may be written
    for _ in range(3):
        await recorder.record(pod, "AttestationAudit", "would quarantine")
    (event,) = await asyncio.to_thread(events, admin, ns)
    assert event["count"] == EVENT_BURST + 1 and recorder.dropped == 7
    assert event["lastTimestamp"] == "2026-01-01T00:05:00Z"
    # another object has a budget of its own; an Event at the API's maximum count stays there
    # (one more would be refused as out of range) and its lastTimestamp still moves
    node = {"apiVersion": "v1", "kind": "Node", "name": "n1", "namespace": ns}
    full = event_body(node, "PlatformUntrusted", "m", now[0], "cp-0")
    await asyncio.to_thread(admin.create, {**full, "count": MAX_COUNT})
    now[0] += timedelta(seconds=1)
    await recorder.record(node, "PlatformUntrusted", "m")
    (event,) = await asyncio.to_thread(events, admin, ns, "PlatformUntrusted")
    assert event["count"] == MAX_COUNT
    assert event["lastTimestamp"] == "2026-01-01T00:05:01Z"


async def test_audit_mode_and_followers_do_nothing_but_record(env: Env) -> None:
    admin, ns = env.admin, "ad-audit"
    await seeded(env, ns, None)
    metrics = KubeMetrics(CollectorRegistry())
    actions = KubeActions(kc(env), metrics=metrics)
    await actions.record_audit(f"{ns}/web-0", "measurement_not_allowed", Trigger.APPRAISAL_FAILED)
    pod = await asyncio.to_thread(admin.get, "v1", "Pod", ns, "web-0")
    assert LABEL_QUARANTINED not in pod["metadata"]["labels"]
    assert [e["reason"] for e in await asyncio.to_thread(events, admin, ns)] == ["AttestationAudit"]
    assert metrics.audits.labels(trigger="appraisal_failed")._value.get() == 1
    follower = KubeActions(kc(env), is_leader=lambda: False)
    out = await follower.quarantine(
        f"{ns}/web-0", "x", Trigger.OPERATOR, evict=True, platform_failed=True
    )
    assert out.result is ActionResult.NOT_LEADER
    assert await asyncio.to_thread(admin.get_or_none, "v1", "Pod", ns, "web-0") is not None


async def test_release_and_reapply_from_persisted_state(env: Env) -> None:
    admin, ns, node = env.admin, "ad-reapply", "ad-reapply-n1"
    await seeded(env, ns, node)
    t0 = datetime.now(UTC)
    name = f"{ns}/web-0"
    reg = Registration(name, ns, "web", "web", Endpoint("10.6.1.5", 15006), 8080)
    state, _ = register(MeshState("example.org"), reg, t0)
    local = Registration("local-1", "default", "x", "x", Endpoint("127.0.0.1", 1), 2)
    state, _ = register(state, local, t0)
    state, _ = quarantine(
        state, name, Trigger.TCB_REVOKED, "tcb_status_not_accepted: Revoked", t0,
        code="tcb_status_not_accepted", platform=True,
    )  # fmt: skip
    state, _ = quarantine(state, "local-1", Trigger.OPERATOR, "manual", t0)
    actions = KubeActions(kc(env))
    first = await actions.reapply(state)
    second = await actions.reapply(state)  # e.g. after a restart
    assert set(first) == {name} and first == second
    assert first[name].node_tainted == node  # authentic evidence indicts the platform
    stored = await asyncio.to_thread(admin.get, "v1", "Node", None, node)
    assert len(ours(stored)) == 1
    assert await actions.release(name) is ActionResult.DONE
    pod = await asyncio.to_thread(admin.get, "v1", "Pod", ns, "web-0")
    assert LABEL_QUARANTINED not in pod["metadata"]["labels"]
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED)
    assert cond["status"] == "True"


async def test_quarantine_skips_reading_a_node_the_watch_saw_tainted(env: Env) -> None:
    admin, ns = env.admin, "ad-known"
    n1, n2 = "ad-known-n1", "ad-known-n2"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, node_doc(n1, untrusted=True))
    await asyncio.to_thread(running_pod, admin, pod_doc("web-0", ns, n1), "10.6.2.5")
    known = parse_node(node_doc(n1, untrusted=True))
    actions = KubeActions(kc(env), nodes={n1: known}.get)
    out = await actions.quarantine(
        f"{ns}/web-0", "tcb_revoked: x", Trigger.TCB_REVOKED, evict=False, platform_failed=True
    )
    assert out.node_tainted == n1
    node_requests = [
        e for e in await asyncio.to_thread(audited, env) if f"/nodes/{n1}" in e["requestURI"]
    ]
    assert node_requests == []  # neither read nor written
    # a node the watch has not seen (or saw untainted) is read and tainted as before
    await asyncio.to_thread(admin.apply, node_doc(n2))
    await asyncio.to_thread(running_pod, admin, pod_doc("web-1", ns, n2), "10.6.2.6")
    out = await actions.quarantine(
        f"{ns}/web-1", "tcb_revoked: x", Trigger.TCB_REVOKED, evict=False, platform_failed=True
    )
    stored = await asyncio.to_thread(admin.get, "v1", "Node", None, n2)
    assert out.node_tainted == n2
    assert len(ours(stored)) == 1


# --- Services ----------------------------------------------------------------------------------


def service_doc(name: str, selector: dict[str, str] | None, ns: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"ports": [{"port": 80, "targetPort": 8080}]}
    if selector is not None:
        spec["selector"] = selector
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


async def test_services_name_pods_and_their_changes_reregister(env: Env) -> None:
    """(A failed first Service list and the relist after a 410 stay on tests/fakekube.)"""
    admin, ns, other = env.admin, "ad-svc", "ad-svc-other"
    for n in (ns, other):
        await asyncio.to_thread(own_namespace, admin, n)
    for doc in (
        service_doc("billing", {"app": "web"}, ns),
        service_doc("zeta", {"app": "web"}, ns),
        # another namespace's Service selecting the same labels, with the lowest name: never ns's
        service_doc("aaa", {"app": "web"}, other),
    ):
        await asyncio.to_thread(admin.apply, doc)
    await asyncio.to_thread(running_pod, admin, pod_doc("web-0", ns), "10.6.3.5")
    annotated = pod_doc("web-1", ns)
    annotated["metadata"]["annotations"]["attestmesh.dev/service"] = "checkout"  # ignored
    await asyncio.to_thread(running_pod, admin, annotated, "10.6.3.6")
    await asyncio.to_thread(running_pod, admin, pod_doc("web-9", other), "10.6.4.9")
    rec = Recorder()
    source = KubeSource(kc(env), rec.callbacks(), watch_timeout=30)
    mine = (f"{ns}/web-0", f"{ns}/web-1", f"{other}/web-9")

    def registered() -> list[Registration]:
        return [r for r in rec.registered if r.name in mine]

    def service_of(name: str) -> str:
        return source.pods[name].service

    def shop_services() -> set[str]:
        return {service_of(f"{ns}/web-0"), service_of(f"{ns}/web-1")}

    async with running(source):
        # announced once, already with the Service's name (pods are listed after Services);
        # the annotation names nothing, each namespace's pods get only their own Service
        assert {r.name: r.service for r in registered()} == {
            f"{ns}/web-0": "billing",
            f"{ns}/web-1": "billing",
            f"{other}/web-9": "aaa",
        }
        assert len(registered()) == 3
        # the lowest-named Service goes: the next one names the pods (both, annotation or not)
        await asyncio.to_thread(admin.delete, "v1", "Service", ns, "billing")
        await until(lambda: shop_services() == {"zeta"} or None)
        assert len(registered()) == 5
        assert {r.name for r in registered()[-2:]} == {f"{ns}/web-0", f"{ns}/web-1"}
        # a change that is not the selector re-registers nothing
        count = len(registered())
        await asyncio.to_thread(
            admin.patch, "v1", "Service", ns, "zeta", {"spec": {"ports": [{"port": 81}]}}
        )
        # the selector no longer matches: no Service in ns selects them; the app label, the
        # service account and the annotation name no mesh service
        await asyncio.to_thread(
            admin.patch, "v1", "Service", ns, "zeta", {"spec": {"selector": {"app": "other"}}}
        )
        await until(lambda: shop_services() == {""} or None)
        assert len(registered()) == count + 2
        assert service_of(f"{other}/web-9") == "aaa"  # other's Service is no fallback for ns
        # a Service created later names them again; a pod created later is derived with it
        await asyncio.to_thread(admin.apply, service_doc("billing", {"app": "web"}, ns))
        await until(lambda: shop_services() == {"billing"} or None)
        await asyncio.to_thread(running_pod, admin, pod_doc("web-2", ns), "10.6.3.7")
        await until(lambda: f"{ns}/web-2" in source.pods or None)
        assert service_of(f"{ns}/web-2") == "billing"
    assert service_of(f"{ns}/web-1") == "billing"  # the annotation never counted
    assert [r.service for r in rec.registered if r.name == f"{other}/web-9"] == ["aaa"]  # once
    assert not [n for n in rec.removed if n in mine]
