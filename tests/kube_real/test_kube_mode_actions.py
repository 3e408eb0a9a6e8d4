"""Kube-mode actions driven by attestation outcomes, against a real kube-apiserver 1.20.2 (moved
here from tests/component/test_kube_mode.py, which ran them against tests/fakekube).

A pod is created through the server, its agent attests with a real TokenRequest token bound to
it, and what the control plane does about a policy's ``onFailure`` / ``mode`` is read back
through the server: eviction deletes the pod, audit mode writes an ``AttestationAudit`` Event
and nothing else. Each test has a namespace of its own (the cluster is shared by the session).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.agent import AgentError
from tests.kube_real.cluster import Cluster
from tests.kube_real.install import Installed
from tests.kube_real.plane import (
    BAD,
    GOOD,
    Env,
    control_plane,
    injected_fixture_pod,
    make_env,
    namespace_doc,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
)
from tests.kube_real.rest import Rest, until
from xds.kube import CONDITION_ATTESTED, LABEL_QUARANTINED
from xds.state import Status

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def env(
    cluster: Cluster, admin: Rest, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Env:
    return make_env(cluster, admin, tmp_path_factory.mktemp("env"))


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
