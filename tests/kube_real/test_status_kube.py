"""``attestmesh status`` in Kubernetes mode against the real kube-apiserver 1.20.2 (moved here
from tests/component/test_status.py, which ran it against tests/fakekube): the workload comes
from a pod created through the server and attests with a real token bound to that pod."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from attestmesh import status_cmd
from tests.kube_real.plane import (
    Env,
    control_plane,
    injected_fixture_pod,
    namespace_doc,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
)
from tests.kube_real.rest import until

pytestmark = pytest.mark.integration


async def test_status_lists_the_pod_as_attested(env: Env, tmp_path: Path) -> None:
    admin, ns = env.admin, "status-kube"
    await asyncio.to_thread(admin.apply, namespace_doc(ns))
    await asyncio.to_thread(admin.apply, service_account_doc(ns, "web"))
    await asyncio.to_thread(admin.apply, policy("web", ns))
    async with control_plane(env, tmp_path / "state") as plane:
        cp, workload = plane.running.cp, f"{ns}/web-0"
        stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.3.0.9")
        await until(lambda: cp.state.workloads.get(workload), what="registered")
        await until(lambda: [p for p in cp.policies if p.name == f"{ns}/web"] or None)
        token = await asyncio.to_thread(pod_token, admin, stored)
        async with aiohttp.ClientSession() as session:
            await plane.agent(workload, token).attest_once(session)

        def cli() -> list[dict[str, Any]]:
            parser = argparse.ArgumentParser()
            status_cmd.add_parser(parser.add_subparsers())
            args = parser.parse_args(["status", "--ops-port", str(plane.settings.ops_port),
                                      "--state-dir", str(tmp_path / "state"), "--json"])  # fmt: skip
            out = io.StringIO()
            assert status_cmd.run(args, out) == 0
            return list(json.loads(out.getvalue()))

        (row,) = [r for r in await asyncio.to_thread(cli) if r["name"] == workload]
        assert row["namespace"] == ns and row["status"] == "attested"
        assert row["spiffe_id"] == f"spiffe://attestmesh.local/ns/{ns}/sa/web"
        assert row["tee"] == "sim" and row["certificate_expires_in_s"] > 0
