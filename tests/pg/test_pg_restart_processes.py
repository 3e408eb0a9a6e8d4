"""PostgreSQL restarted under attestation load on two real ``attestmesh controlplane`` replicas:
both reconnect, recover (a failed write no longer needs a restart of the replica) and catch up;
every certificate an agent was given is durable; attestations succeed again at both."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import psycopg
import pytest

from attestmesh.demo import GOOD
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context
from tests.component.test_agent import RecordingSink
from tests.pg.processes import healthy, start, stop_all, write_mesh
from tests.pg_harness import PgCluster

pytestmark = pytest.mark.integration


async def test_a_postgresql_restart_under_load_with_real_replicas(
    tmp_path: Path, pg: PgCluster, pg_url: str
) -> None:
    mesh = write_mesh(tmp_path)
    platform, tokens = mesh.platform, mesh.tokens
    a, b = mesh.base, mesh.replica(1)
    procs = []
    try:
        procs.append(start(a, tmp_path / "a.log", pg_url))
        await healthy(a, procs[0], tmp_path / "a.log")
        procs.append(start(b, tmp_path / "b.log", pg_url))
        await healthy(b, procs[1], tmp_path / "b.log")
        bundle = (a.state_dir / "ca" / "root.pem").read_bytes()
        given: list[tuple[str, int]] = []
        per_replica = {"a": 0, "b": 0}
        stop = asyncio.Event()

        async def load(name: str, s: object, key: str) -> None:
            agent = Agent(
                url=f"https://localhost:{s.api_port}",  # type: ignore[attr-defined]
                workload=name,
                source=SimEvidenceSource(platform, GOOD),
                sink=RecordingSink(),
                ssl_context=client_ssl_context(bundle),
                token=lambda: tokens[name],
                timeout_s=5.0,
            )
            async with aiohttp.ClientSession() as session:
                while not stop.is_set():
                    try:
                        cert = await agent.attest_once(session)
                    except AgentError:
                        await asyncio.sleep(0.2)
                        continue
                    given.append((name, cert.serial))
                    per_replica[key] += 1

        tasks = [
            asyncio.create_task(load("frontend", a, "a")),
            asyncio.create_task(load("backend", b, "b")),
        ]
        async with asyncio.timeout(30):
            while min(per_replica.values()) < 5:
                await asyncio.sleep(0.05)
        await asyncio.to_thread(pg.restart)
        after = dict(per_replica)
        async with asyncio.timeout(60):  # both replicas recovered and issue again
            while not all(per_replica[k] >= after[k] + 5 for k in after):
                await asyncio.sleep(0.1)
        stop.set()
        await asyncio.gather(*tasks)
        for p in procs:
            assert p.poll() is None  # nobody had to restart
        logs = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
        assert "state store recovered" in logs  # a write failed, and the replica came back
        with psycopg.connect(pg_url) as conn:
            docs = dict(conn.execute("SELECT name, doc FROM workloads").fetchall())
            revoked = {int(s) for (s,) in conn.execute("SELECT serial FROM revocations")}
        live = {(n, int(c[0])) for n, d in docs.items() for c in json.loads(d)["certificates"]}
        lost = [g for g in given if g not in live and g[1] not in revoked]
        assert lost == [], lost
    finally:
        stop_all(procs)
