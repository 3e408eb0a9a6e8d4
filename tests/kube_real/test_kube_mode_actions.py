"""Kube-mode actions driven by attestation outcomes, against a real kube-apiserver 1.20.2 (moved
here from tests/component/test_kube_mode.py, which ran them against tests/fakekube).

A pod is created through the server, its agent attests with a real TokenRequest token bound to
it, and what the control plane does about a policy's ``onFailure`` / ``mode`` is read back
through the server: eviction deletes the pod, audit mode writes an ``AttestationAudit`` Event
and nothing else. Each test has a namespace of its own (the cluster is shared by the session).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from attestmesh.kube_mode import Work, WorkKind
from sidecar.agent import AgentError
from tests.kube_real.cluster import free_port
from tests.kube_real.plane import (
    BAD,
    GOOD,
    Env,
    audited,
    control_plane,
    injected_fixture_pod,
    namespace_doc,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
)
from tests.kube_real.rest import Rest, until
from xds.kube import CONDITION_ATTESTED, LABEL_QUARANTINED, TAINT_PLATFORM_UNTRUSTED
from xds.state import Status, Trigger

pytestmark = pytest.mark.integration


def own_namespace(admin: Rest, ns: str) -> None:
    admin.apply(namespace_doc(ns))
    admin.apply(service_account_doc(ns, "web"))


def events(admin: Rest, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in admin.items("v1", "Event", ns) if e["reason"] == reason]


async def test_quarantine_and_evict_deletes_the_pod_through_the_server(
    env: Env, tmp_path: Path
) -> None:
    admin, ns = env.admin, "act-evict"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("web", ns, onFailure="quarantineAndEvict"))
    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        # not bound to a node: the server deletes an evicted pod at once (no kubelet needed)
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.2.0.5")
        workload = f"{ns}/web-0"
        await until(lambda: cp.state.workloads.get(workload), what="web-0 registered")
        await until(lambda: [p.name for p in cp.policies if p.name == f"{ns}/web"] or None)
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            await plane.agent(workload, token, GOOD).attest_once(session)
            assert cp.status_of(workload) is Status.ATTESTED
            with pytest.raises(AgentError) as exc:  # a tampered image
                await plane.agent(workload, token, BAD).attest_once(session)
            assert exc.value.status == 403
        await plane.mode.drained()

        def gone() -> bool | None:
            return admin.get_or_none("v1", "Pod", ns, "web-0") is None or None

        await until(gone, what="web-0 evicted")
        (event,) = await until(lambda: events(admin, ns, "Quarantined") or None, what="Event")
        assert event["involvedObject"]["name"] == "web-0" and event["type"] == "Warning"
        # the pod's deletion reaches the control plane through its watch
        await until(lambda: workload not in cp.state.workloads or None, what="forgotten")


async def test_audit_mode_records_an_event_and_quarantines_nothing(
    env: Env, tmp_path: Path
) -> None:
    admin, ns = env.admin, "act-audit"
    await asyncio.to_thread(own_namespace, admin, ns)
    rollout = policy(
        "web-next", ns, mode="audit", referenceValues={"sim": {"measurement": [BAD.hex()]}}
    )
    for doc in (policy("web", ns), rollout):
        await asyncio.to_thread(admin.apply, doc)
    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.2.0.6")
        workload = f"{ns}/web-0"
        await until(lambda: cp.state.workloads.get(workload), what="web-0 registered")
        await until(
            lambda: len([p for p in cp.policies if p.name.startswith(f"{ns}/")]) == 2 or None
        )
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            await plane.agent(workload, token, GOOD).attest_once(session)
        await plane.mode.drained()
        assert cp.status_of(workload) is Status.ATTESTED
        (event,) = await until(
            lambda: events(admin, ns, "AttestationAudit") or None, what="audit Event"
        )
        assert "would quarantine" in event["message"] and "measurement" in event["message"]
        assert event["involvedObject"]["name"] == "web-0"
        pod = await asyncio.to_thread(admin.get, "v1", "Pod", ns, "web-0")
        assert LABEL_QUARANTINED not in pod["metadata"]["labels"]
        conds = [c for c in pod["status"].get("conditions", []) if c["type"] == CONDITION_ATTESTED]
        assert all(c["status"] != "False" for c in conds), conds
        assert await asyncio.to_thread(events, admin, ns, "Quarantined") == []


def node_reads(env: Env, name: str) -> int:
    """GETs of node ``name`` the control plane made, per the server's audit log."""
    events = audited(env)
    return sum(
        1
        for e in events
        if e["verb"] == "get" and e["requestURI"].split("?")[0] == f"/api/v1/nodes/{name}"
    )


async def test_nodes_are_watched_and_untrusted_ones_counted(env: Env, tmp_path: Path) -> None:
    admin, ns = env.admin, "act-nodes"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("web", ns))
    n1, n2 = "act-n1", "act-n2"
    tainted = {"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}
    for name, spec in ((n1, {}), (n2, {"taints": [tainted]})):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}, "spec": spec}
        await asyncio.to_thread(admin.apply, node)
    async with control_plane(env, tmp_path / "state") as plane:
        source, cp = plane.mode.source, plane.running.cp
        gauge = plane.mode.kube_metrics.untrusted_nodes._value
        # the session's cluster holds other tests' nodes: count relative to them
        others = sum(n.platform_untrusted for k, n in source.nodes.items() if k not in (n1, n2))
        assert {n1, n2} <= set(source.nodes) and gauge.get() == others + 1
        probe = f"http://127.0.0.1:{plane.mode.settings.probe_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(probe) as resp:
            assert f"attestmesh_kube_untrusted_nodes {others + 1.0}" in await resp.text()

        stored = await running_pod(
            admin, injected_fixture_pod("web-0", ns=ns, nodeName=n1), "10.2.0.7"
        )
        workload = f"{ns}/web-0"
        await until(lambda: cp.state.workloads.get(workload), what="web-0 registered")
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            await plane.agent(workload, token).attest_once(session)
        # a platform failure taints the pod's node through the server; the watch sees it
        assert cp.quarantine(
            workload, Trigger.TCB_REVOKED, "tcb_status_not_accepted: SNP TCB revoked",
            code="tcb_status_not_accepted", platform=True,
        )  # fmt: skip
        await plane.mode.drained()
        await until(lambda: source.nodes[n1].platform_untrusted or None, what="n1 tainted")
        assert gauge.get() == others + 2
        stored_n1 = await asyncio.to_thread(admin.get, "v1", "Node", None, n1)
        assert tainted in stored_n1["spec"]["taints"]
        # re-applying reads no node the watch already knows as tainted
        before = await asyncio.to_thread(node_reads, env, n1)
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        assert plane.mode.completed[-1].kind is WorkKind.REAPPLY
        assert await asyncio.to_thread(node_reads, env, n1) == before

        # nodes deleted: forgotten, nothing else changes
        for name in (n2, n1):
            await asyncio.to_thread(admin.delete, "v1", "Node", None, name)
        await until(lambda: not ({n1, n2} & set(source.nodes)) or None, what="nodes forgotten")
        assert gauge.get() == others
        assert cp.status_of(workload) is Status.QUARANTINED
        assert cp.release(workload)
        async with aiohttp.ClientSession() as session:
            await plane.agent(workload, token).attest_once(session)
        assert cp.status_of(workload) is Status.ATTESTED


async def test_only_the_leader_acts_every_replica_attests(env: Env, tmp_path: Path) -> None:
    admin, ns = env.admin, "act-follow"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, policy("web", ns))
    async with (
        control_plane(env, tmp_path / "a", "cp-a") as leader,
        # its own webhook port (the configuration points at the leader's)
        control_plane(
            replace(env, webhook_port=free_port()), tmp_path / "b", "cp-b", lead=False
        ) as follower,
    ):
        # one real Lease: the second replica synced and does not hold it
        assert leader.mode.elector.is_leader and not follower.mode.elector.is_leader
        cp = follower.running.cp
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.2.0.8")
        workload = f"{ns}/web-0"
        await until(lambda: cp.state.workloads.get(workload), what="web-0 registered")
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            await follower.agent(workload, token).attest_once(session)  # the follower attests
            with pytest.raises(AgentError) as exc:
                await follower.agent(workload, token, BAD).attest_once(session)
            assert exc.value.status == 403
        assert cp.status_of(workload) is Status.QUARANTINED
        await follower.mode.drained()
        assert [w.kind for w in follower.mode.completed] == [WorkKind.QUARANTINE]
        # a follower writes nothing (its quarantine work ran and made no request)
        pod = await asyncio.to_thread(admin.get, "v1", "Pod", ns, "web-0")
        assert LABEL_QUARANTINED not in pod["metadata"]["labels"]
        conds = [c for c in pod["status"].get("conditions", []) if c["type"] == CONDITION_ATTESTED]
        assert conds == []
        assert await asyncio.to_thread(events, admin, ns, "Quarantined") == []
        assert not follower.mode.elector.is_leader
