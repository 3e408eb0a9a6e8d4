"""The kubelet's probe port in Kubernetes mode says what the ops port's /healthz and /readyz say:
a control plane whose store write failed is not healthy, and a replica cut off from its database
(several replicas on PostgreSQL) is not ready, so the Service stops sending it agents."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kubernetes import client

from attestmesh.controlplane import ControlPlane
from attestmesh.kube_mode import KubeMode, KubeSettings
from attestmesh.metrics import Metrics
from xds.kube import KubeClient


@dataclass
class StoreView:
    """What the probes read of the control plane."""

    healthy: bool = True
    ready: bool = True


@pytest.fixture
async def probe(tmp_path: Path) -> AsyncIterator[tuple[KubeMode, StoreView, TestClient[Any, Any]]]:
    kube = KubeClient(client.ApiClient(client.Configuration()), request_timeout=1)
    mode = KubeMode(kube, KubeSettings(identity="cp-0"), Metrics(), state_dir=tmp_path)
    view = StoreView()
    mode._cp = cast(ControlPlane, view)  # the probes read healthy and ready only
    test_client = TestClient(TestServer(mode._probe_app()))
    await test_client.start_server()
    try:
        yield mode, view, test_client
    finally:
        await test_client.close()


async def status(c: TestClient[Any, Any], path: str) -> tuple[int, str]:
    resp = await c.get(path)
    return resp.status, (await resp.json())["status"]


async def test_ready_only_when_synced_and_in_contact_with_the_store(
    probe: tuple[KubeMode, StoreView, TestClient[Any, Any]],
) -> None:
    mode, view, c = probe
    assert await status(c, "/readyz") == (503, "syncing")
    mode.synced.set()
    assert await status(c, "/readyz") == (200, "ok")
    view.ready = False  # cut off from PostgreSQL: issuing nothing
    assert await status(c, "/readyz") == (503, "store_unreachable")
    assert await status(c, "/healthz") == (200, "ok")  # alive: it recovers on its own
    view.ready = True
    assert await status(c, "/readyz") == (200, "ok")


async def test_a_failed_store_write_fails_both_probes(
    probe: tuple[KubeMode, StoreView, TestClient[Any, Any]],
) -> None:
    mode, view, c = probe
    mode.synced.set()
    view.healthy = view.ready = False
    assert await status(c, "/healthz") == (503, "store_failed")
    assert await status(c, "/readyz") == (503, "store_failed")
