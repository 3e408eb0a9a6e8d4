"""Real Envoys and two real control-plane replicas on one PostgreSQL database.

1. The Envoys' ADS goes to replica B only; the agents attest at replica A only: traffic flows
   (B learned the attestations from the database), an operator quarantine on A cuts it (B's
   Envoys get the change and the CRL), a release and re-attestation on A restores it.
2. The Envoys are restarted with both replicas in their bootstrap; the replica holding their
   streams is killed with SIGKILL: traffic keeps flowing and the streams move to the other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import subprocess
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import GOOD, NAMES, call, free_port, join_token, tiny_app, write_config
from attestmesh.serve import ControlPlaneSettings, control_plane_spiffe_id
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.bootstrap import ControlPlaneAddress, XdsTls, build_bootstrap
from sidecar.envoy_proc import EnvoyProcess
from sidecar.sds import LocalSds, start_sds
from tests.pg.test_controlplane_pg import cli, start
from tests.polling import until_awaited

eventually = partial(until_awaited, within=30.0, every=0.05)

pytestmark = pytest.mark.integration


async def streams(session: aiohttp.ClientSession, s: ControlPlaneSettings) -> float:
    try:
        async with session.get(f"http://127.0.0.1:{s.ops_port}/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError:
        return -1.0
    for line in text.splitlines():
        if line.startswith("attestmesh_xds_streams "):
            return float(line.split()[1])
    return 0.0


@contextlib.asynccontextmanager
async def workload(
    name: str,
    ports: dict[str, int],
    root: Path,
    platform: ec.EllipticCurvePrivateKey,
    token: str,
    api: Sequence[ControlPlaneSettings],
    bundle: bytes,
) -> AsyncIterator[tuple[Agent, LocalSds]]:
    sock = root / f"sds-{name}.sock"
    async with tiny_app(name, ports["app"]):
        sds = LocalSds()
        server = await start_sds(sds, sock)
        agent = Agent(
            url=[f"https://127.0.0.1:{s.api_port}" for s in api],
            workload=name,
            source=SimEvidenceSource(platform, GOOD),
            sink=sds,
            ssl_context=client_ssl_context(bundle),
            token=lambda: token,
        )
        try:
            yield agent, sds
        finally:
            server.close()
            await server.wait_closed()
            sock.unlink(missing_ok=True)


def envoy_for(
    name: str,
    ports: dict[str, int],
    root: Path,
    xds: Sequence[ControlPlaneSettings],
    tag: str,
) -> EnvoyProcess:
    s = xds[0]
    boot = build_bootstrap(
        name,
        [ControlPlaneAddress("127.0.0.1", r.xds_port) for r in xds],
        root / f"sds-{name}.sock",
        ports["admin"],
        xds_tls=XdsTls(s.state_dir / "ca" / "root.pem", control_plane_spiffe_id(s.trust_domain)),
    )
    return EnvoyProcess(name, boot, root / f"envoy-{tag}", ports["admin"])


async def test_changes_on_one_replica_reach_envoys_on_the_other_and_envoys_fail_over(
    tmp_path: Path, pg_url: str
) -> None:
    platform = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    tokens = {n: join_token(n) for n in NAMES}
    a = write_config(tmp_path, ports, pub, tokens)
    b = dataclasses.replace(
        a,
        state_dir=tmp_path / "state-b",
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}
    envoys: list[EnvoyProcess] = []
    try:
        procs["a"] = start(a, tmp_path / "a.log", pg_url)
        procs["b"] = start(b, tmp_path / "b.log", pg_url)
        bundle = (a.state_dir / "ca" / "root.pem").read_bytes()
        fe_to_be = ports["frontend"]["outbound"]
        async with contextlib.AsyncExitStack() as stack, aiohttp.ClientSession() as session:
            agents = {
                n: (
                    await stack.enter_async_context(
                        workload(n, ports[n], tmp_path, platform, tokens[n], [a], bundle)
                    )
                )[0]
                for n in NAMES
            }
            for agent in agents.values():  # at replica A only
                await agent.attest_once(session)
            envoys = [envoy_for(n, ports[n], tmp_path, [b], "1") for n in NAMES]  # ADS: B only
            for e in envoys:
                await e.start()
            for e in envoys:
                await e.wait_ready()

            async def flows() -> bool:
                return (await call(session, fe_to_be))[0] == 200

            async def cut() -> bool:
                return (await call(session, fe_to_be))[0] != 200

            await eventually(flows)
            assert await streams(session, b) >= 2 and await streams(session, a) == 0
            out = cli("quarantine", "add", "backend", "--reason", "compromised",
                      "--ops-port", str(a.ops_port), "--state-dir", str(a.state_dir))  # fmt: skip
            assert out.returncode == 0, out
            await eventually(cut)  # decided on A, enforced by Envoys that only talk to B
            out = cli("quarantine", "release", "backend",
                      "--ops-port", str(a.ops_port), "--state-dir", str(a.state_dir))  # fmt: skip
            assert out.returncode == 0, out
            agents["backend"].current = None  # released: attest afresh (as its run loop does)
            await agents["backend"].attest_once(session)  # at A
            await eventually(flows)

            # 2. both replicas in the bootstrap; kill the one holding the streams
            for e in envoys:
                await e.stop()
            envoys = [envoy_for(n, ports[n], tmp_path, [a, b], "2") for n in NAMES]
            for e in envoys:
                await e.start()
            for e in envoys:
                await e.wait_ready()
            await eventually(flows)

            async def both_connected() -> bool:
                return await streams(session, a) + await streams(session, b) >= 2

            await eventually(both_connected)
            holder = "a" if await streams(session, a) >= 1 else "b"
            survivor = b if holder == "a" else a
            procs[holder].kill()
            procs[holder].wait(10)
            results = [(await call(session, fe_to_be))[0] for _ in range(20)]
            assert results == [200] * 20, results  # established traffic keeps flowing

            async def moved() -> bool:
                return await streams(session, survivor) >= 2

            await eventually(moved)  # both Envoys reconnected to the survivor
            await eventually(flows)
    finally:
        for e in envoys:
            await e.stop()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)
