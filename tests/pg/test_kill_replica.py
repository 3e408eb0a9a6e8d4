"""Three real ``attestmesh controlplane`` replicas on one PostgreSQL database under attestation
load from agents that know all three: an operator quarantines a workload on one replica, another
replica is killed with SIGKILL mid-load. No attestation fails after the agent's retry, the
quarantine holds on every survivor, and the dead replica's share of the load moves on."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import psycopg
import pytest

from attestmesh.demo import GOOD
from attestmesh.serve import ControlPlaneSettings
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context
from tests.component.test_agent import RecordingSink
from tests.pg.processes import healthy, start, stop_all, write_mesh

pytestmark = pytest.mark.integration

WORKLOADS = 12
AFTER_KILL_S = 5.0


def quarantine_cli(s: ControlPlaneSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attestmesh.cli", "quarantine", *args,
         "--ops-port", str(s.ops_port), "--state-dir", str(s.state_dir)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


async def test_kill_9_of_one_of_three_replicas_under_attestation_load(
    tmp_path: Path, pg_url: str
) -> None:
    names = [f"w-{i:02d}" for i in range(WORKLOADS)]
    mesh = write_mesh(tmp_path, names)
    platform, tokens = mesh.platform, mesh.tokens
    replicas = [mesh.replica(k) for k in range(3)]
    logs = [tmp_path / f"cp-{k}.log" for k in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start(replicas[0], logs[0], pg_url))  # the first creates the CA
        await healthy(replicas[0], procs[0], logs[0])
        for k in (1, 2):
            procs.append(start(replicas[k], logs[k], pg_url))
        for k in (1, 2):
            await healthy(replicas[k], procs[k], logs[k])
        bundle = (replicas[0].state_dir / "ca" / "root.pem").read_bytes()
        urls = [f"https://localhost:{s.api_port}" for s in replicas]
        quarantined = names[0]
        hard_failures: list[str] = []
        refusals: dict[str, int] = {}
        done: dict[str, int] = {n: 0 for n in names}
        stop = asyncio.Event()

        async def agent_loop(i: int, name: str) -> None:
            # most agents prefer replica 0 (the one to be killed), the rest spread over 1 and 2
            order = urls if i % 3 else [urls[1], urls[2], urls[0]]
            agent = Agent(
                url=order,
                workload=name,
                source=SimEvidenceSource(platform, GOOD),
                sink=RecordingSink(),
                ssl_context=client_ssl_context(bundle),
                token=lambda: tokens[name],
                timeout_s=5.0,
                connect_timeout_s=1.0,
            )
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    for attempt in range(2):  # the agent's retry
                        try:
                            await agent.attest_once(session)
                            done[name] += 1
                            break
                        except AgentError as exc:
                            if exc.status == 403:
                                refusals[name] = refusals.get(name, 0) + 1
                                return  # quarantined: a refusal, the same everywhere
                            if attempt == 1:
                                hard_failures.append(f"{name}: {exc}")
                            await asyncio.sleep(0.5)

        load = [asyncio.create_task(agent_loop(i, n)) for i, n in enumerate(names)]
        await asyncio.sleep(2.0)
        out = await asyncio.to_thread(
            quarantine_cli, replicas[1], "add", quarantined, "--reason", "compromised"
        )
        assert out.returncode == 0, out
        await asyncio.sleep(0.5)
        before = dict(done)
        procs[0].kill()  # SIGKILL mid-load
        await asyncio.sleep(AFTER_KILL_S)  # the load goes on without it
        stop.set()
        await asyncio.gather(*load)
        assert hard_failures == [], hard_failures
        # every agent attested again after the kill, those that preferred the dead one too
        assert all(done[n] > before[n] for n in names[1:]), (before, done)
        assert refusals.get(quarantined) == 1
        for s in replicas[1:]:  # the quarantine holds on every survivor
            listed = await asyncio.to_thread(quarantine_cli, s, "list", "--json")
            assert [i["name"] for i in json.loads(listed.stdout)] == [quarantined], listed
        with psycopg.connect(pg_url) as conn:
            (doc,) = conn.execute(
                "SELECT doc FROM workloads WHERE name = %s", (quarantined,)
            ).fetchone()  # type: ignore[misc]
        assert json.loads(doc)["status"] == "quarantined"
    finally:
        stop_all(procs)
