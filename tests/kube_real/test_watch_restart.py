"""The API server the control plane watches restarts mid-watch and its history is compacted
meanwhile: nothing is lost. A second kube-apiserver on the same etcd (an HA pair) takes writes
while the first is down; etcd is compacted past the watchers' resourceVersions, so the first
server, back, answers their resume with 410 Gone and they relist."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kube_real.cluster import Cluster
from tests.kube_real.install import install
from tests.kube_real.plane import (
    GROUP_VERSION,
    STORE,
    control_plane,
    injected_fixture_pod,
    make_env,
    policy,
    running_pod,
)
from tests.kube_real.rest import Rest, until

pytestmark = pytest.mark.integration


async def test_restart_and_compaction_mid_watch_lose_nothing(
    own_cluster: Callable[[], Cluster], tmp_path: Path
) -> None:
    cluster = await asyncio.to_thread(own_cluster)
    admin = Rest(cluster.admin)
    other: Rest | None = None
    try:
        await asyncio.to_thread(install, admin)
        env = await asyncio.to_thread(make_env, cluster, admin, tmp_path / "env")
        other = Rest(await asyncio.to_thread(cluster.start_second_apiserver))
        await asyncio.to_thread(admin.apply, policy("web", STORE))
        async with control_plane(env, tmp_path / "state") as plane:
            cp, source = plane.running.cp, plane.mode.source
            registry = plane.mode.metrics.registry
            await running_pod(admin, injected_fixture_pod("web-0", "10.1.0.5"), "10.1.0.5")
            await until(lambda: cp.state.workloads.get("store/web-0"), what="web-0 registered")
            (pods,) = [w for w in source.watchers if w.spec.resource == "pods"]
            lists_before = pods.lists

            def restarts(reason: str) -> float:
                value = registry.get_sample_value(
                    "attestmesh_kube_watch_restarts_total", {"resource": "pods", "reason": reason}
                )
                return value or 0.0

            await asyncio.to_thread(cluster.stop_apiserver)
            assert other is not None
            # while the watched server is down: through the other one
            await running_pod(other, injected_fixture_pod("web-1", "10.1.0.6"), "10.1.0.6")
            await asyncio.to_thread(
                other.call,
                "DELETE",
                other.path("v1", "Pod", STORE, "web-0"),
                {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0},
            )
            await asyncio.to_thread(other.apply, policy("late", STORE))
            await asyncio.to_thread(cluster.etcd_compact)
            await asyncio.to_thread(cluster.start_apiserver)

            await until(
                lambda: (
                    "store/web-1" in cp.state.workloads and "store/web-0" not in cp.state.workloads
                ),
                timeout=60,
                what="pods changed while the server was down",
            )
            await until(
                lambda: "store/late" in [p.name for p in cp.policies],
                timeout=60,
                what="policy created while the server was down",
            )
            assert cp.state.get("store/web-1").registration.inbound.address == "10.1.0.6"
            # the pod watch resumed from its resourceVersion (broken stream: no relist), the
            # server answered 410 for the compacted one, and it relisted exactly once
            assert restarts("error") >= 1
            assert restarts("gone") == 1
            assert pods.lists == lists_before + 1
            # and it watches again: a change after the relist arrives as an event
            await running_pod(admin, injected_fixture_pod("web-2", "10.1.0.7"), "10.1.0.7")
            await until(lambda: cp.state.workloads.get("store/web-2"), what="web-2 registered")
            assert pods.lists == lists_before + 1
            obj = await asyncio.to_thread(
                admin.get, GROUP_VERSION, "AttestationPolicy", STORE, "late"
            )
            assert obj["metadata"]["name"] == "late"
    finally:
        admin.close()
        if other is not None:
            other.close()
