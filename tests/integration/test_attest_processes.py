"""The real ``attestmesh controlplane`` verifies and signs in its worker processes: agents get
certificates through them, a killed worker costs no attestation and is replaced, and no
process outlives the control plane (stopped or killed)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from attestmesh.demo import GOOD, NAMES
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context
from sidecar.sds import LocalSds
from tests.integration.test_restart import ControlPlaneProcess, sim_mesh_config

pytestmark = pytest.mark.integration


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


async def ops_metric(session: aiohttp.ClientSession, port: int, name: str) -> float:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


def _workers(pid: int) -> set[int]:
    """The control plane's worker processes (``python -m certs.offload``)."""
    found = set()
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"certs.offload" in cmdline:
            found.add(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited, unreaped child does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_the_control_plane_attests_through_its_worker_processes(
    tmp_path: Path, stop: str
) -> None:
    platform, settings, _, tokens = sim_mesh_config(tmp_path)
    cp = ControlPlaneProcess(settings, tmp_path / "cp.log", ["--attest-processes", "2"])
    await cp.start()
    assert cp.proc is not None
    try:
        tls = client_ssl_context((settings.state_dir / "ca" / "root.pem").read_bytes())
        agent = Agent(
            url=f"https://127.0.0.1:{settings.api_port}", workload=NAMES[0],
            source=SimEvidenceSource(platform, GOOD), sink=LocalSds(), ssl_context=tls,
            token=lambda: tokens[NAMES[0]],
        )  # fmt: skip
        ops = settings.ops_port
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(30):  # the workers start once the control plane serves
                while await ops_metric(session, ops, "attestmesh_attest_worker_processes") < 2:
                    await asyncio.sleep(0.05)
            cert = await agent.attest_once(session)
            assert cert.serial
            assert (
                await ops_metric(session, ops, 'attestmesh_attest_crypto_total{where="process"}')
                == 1
            )
            assert (
                await ops_metric(session, ops, 'attestmesh_attest_crypto_total{where="thread"}')
                == 0
            )
            workers = _workers(cp.proc.pid)
            assert workers == _children(cp.proc.pid) and len(workers) == 2  # and nothing else
            victim = max(workers)
            os.kill(victim, signal.SIGKILL)
            for _ in range(4):  # the agent retries a 503 as its run loop does
                for attempt in range(3):
                    try:
                        assert (await agent.attest_once(session)).serial
                        break
                    except AgentError as exc:  # a job sent to it before its end was seen
                        assert exc.reason == "attest_worker_failed" and attempt < 2
            # at most the one job it may have been sent before the control plane saw it end
            assert (
                await ops_metric(session, ops, 'attestmesh_attest_crypto_total{where="lost"}') <= 1
            )
            async with asyncio.timeout(30):  # and it is replaced
                while not (
                    await ops_metric(session, ops, "attestmesh_attest_worker_processes") == 2
                    and len(_workers(cp.proc.pid) - {victim}) == 2
                ):
                    await asyncio.sleep(0.05)
        family = _children(cp.proc.pid)
        if stop == "sigterm":
            cp.proc.send_signal(signal.SIGTERM)
            assert cp.proc.wait(30) == 0, cp.log.read_text()
        else:
            cp.kill()
        async with asyncio.timeout(15):  # no process outlives it
            while any(alive(p) for p in family):
                await asyncio.sleep(0.05)
    finally:
        cp.kill()
