"""Killing the control plane leaves established traffic flowing; a restart keeps the
quarantine and the CA. The control plane runs as a real process (``attestmesh controlplane``)
and is killed with SIGKILL; quarantine and release go through the ``attestmesh quarantine`` CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import NAMES, call, free_port, join_token, sidecar, write_config
from attestmesh.serve import ControlPlaneSettings
from sidecar.agent import Agent, client_ssl_context
from tests.polling import until_awaited

eventually = partial(until_awaited, within=15.0, every=0.02)

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attestmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


class ControlPlaneProcess:
    def __init__(self, s: ControlPlaneSettings, log: Path, extra: Sequence[str] = ()) -> None:
        self.s = s
        self.log = log
        self.extra = tuple(extra)  # more flags
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        s = self.s
        args = [
            sys.executable, "-m", "attestmesh.cli", "controlplane",
            "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
            "--mesh-policy", str(s.mesh_policy_file), "--workloads", str(s.registrations_file),
            "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
            "--ops-port", str(s.ops_port), "--sim-platform-key", str(s.sim_platform_keys[0]),
            *self.extra,
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        async with asyncio.timeout(30), aiohttp.ClientSession() as session:
            while True:
                assert self.proc.poll() is None, self.log.read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{s.ops_port}/healthz") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def sim_mesh_config(
    tmp_path: Path,
) -> tuple[
    ec.EllipticCurvePrivateKey, ControlPlaneSettings, dict[str, dict[str, int]], dict[str, str]
]:
    """The demo's two-workload mesh on fresh ports and a fresh simulated platform: (platform
    key, settings, ports, join tokens)."""
    platform = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    tokens = {n: join_token(n) for n in NAMES}
    return platform, write_config(tmp_path, ports, pub, tokens), ports, tokens


@contextlib.asynccontextmanager
async def mesh(tmp_path: Path) -> AsyncIterator[dict[str, object]]:
    platform, settings, ports, tokens = sim_mesh_config(tmp_path)
    cp = ControlPlaneProcess(settings, tmp_path / "controlplane.log")
    try:
        async with contextlib.AsyncExitStack() as stack:
            await cp.start()
            bundle = (settings.state_dir / "ca" / "root.pem").read_bytes()
            tls = client_ssl_context(bundle)
            sidecars = {
                n: await stack.enter_async_context(
                    sidecar(n, settings, ports[n], tmp_path, platform, tokens[n], tls)
                )
                for n in NAMES
            }
            agents = {n: sc.agent for n, sc in sidecars.items()}
            async with aiohttp.ClientSession() as session:
                for a in agents.values():
                    await a.attest_once(session)
                for sc in sidecars.values():
                    await sc.envoy.start()
                for sc in sidecars.values():
                    await sc.envoy.wait_ready()
                yield {
                    "cp": cp, "agents": agents, "ports": ports, "session": session,
                    "settings": settings, "bundle": bundle,
                }  # fmt: skip
    finally:
        cp.kill()


async def test_kill_restart_keeps_traffic_quarantine_and_ca(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        cp: ControlPlaneProcess = m["cp"]  # type: ignore[assignment]
        session: aiohttp.ClientSession = m["session"]  # type: ignore[assignment]
        ports: dict[str, dict[str, int]] = m["ports"]  # type: ignore[assignment]
        agents: dict[str, Agent] = m["agents"]  # type: ignore[assignment]
        s: ControlPlaneSettings = m["settings"]  # type: ignore[assignment]
        fe_to_be, be_to_fe = ports["frontend"]["outbound"], ports["backend"]["outbound"]

        async def fe_ok() -> bool:
            return (await call(session, fe_to_be))[0] == 200

        await eventually(fe_ok)

        # 1. SIGKILL the control plane: established traffic keeps flowing, both ways.
        cp.kill()
        results = [await call(session, p) for _ in range(25) for p in (fe_to_be, be_to_fe)]
        assert all(r == (200, f"hello from {'backend' if i % 2 == 0 else 'frontend'}")
                   for i, r in enumerate(results)), results  # fmt: skip

        # 2. Restart from the same state: the CA is the same, agents attest again with it.
        await cp.start()
        assert (s.state_dir / "ca" / "root.pem").read_bytes() == m["bundle"]
        cert = await agents["frontend"].attest_once(session)
        leaf, inter = x509.load_pem_x509_certificates(cert.chain_pem)
        root = x509.load_pem_x509_certificate(m["bundle"])  # type: ignore[arg-type]
        inter.verify_directly_issued_by(root)
        leaf.verify_directly_issued_by(inter)

        # 3. Quarantine backend by operator command; traffic to and from it stops.
        out = cli("quarantine", "add", "backend", "--reason", "suspected compromise",
                  "--ops-port", str(s.ops_port), "--state-dir", str(s.state_dir))  # fmt: skip
        assert out.returncode == 0 and "backend: quarantined" in out.stdout, out

        async def fe_refused() -> bool:
            return (await call(session, fe_to_be))[0] != 200

        await eventually(fe_refused)

        # The ops endpoint exposes the metrics with bounded labels only.
        metrics, values = "", {}

        async def frontend_connected() -> bool:
            nonlocal metrics, values
            async with session.get(f"http://127.0.0.1:{s.ops_port}/metrics") as resp:
                metrics = await resp.text()
            values = {
                line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line and not line.startswith("#")
            }
            # the frontend's Envoy reconnected after the restart; the quarantined backend's
            # revoked certificate opens no new xDS stream (one opened before the quarantine
            # may still be there)
            return values.get("attestmesh_xds_streams", 0) >= 1

        await eventually(frontend_connected)
        # the attack of a quarantined workload on the xDS port: a stream it held is ended when
        # its certificate is revoked, and its Envoy's retries with that certificate are refused
        # every time (a refused stream is never counted)
        await asyncio.sleep(2.0)
        assert await frontend_connected() and values["attestmesh_xds_streams"] == 1
        assert values["attestmesh_quarantined_workloads"] == 1
        assert values['attestmesh_quarantine_events_total{trigger="operator"}'] == 1
        assert values['attestmesh_attestations_total{reason="ok",result="admitted",tee="sim"}'] >= 1
        assert values["attestmesh_issuance_seconds_count"] >= 1
        assert any(k.startswith("attestmesh_xds_push_ack_seconds_count") for k in values)
        assert "backend" not in metrics and "frontend" not in metrics  # no per-workload labels

        # 4. Kill and restart: the quarantine survived and still cuts traffic.
        cp.kill()
        await cp.start()
        listed = cli("quarantine", "list", "--json", "--ops-port", str(s.ops_port),
                     "--state-dir", str(s.state_dir))  # fmt: skip
        items = json.loads(listed.stdout)
        assert [
            (i["name"], i["quarantine"]["trigger"], i["quarantine"]["reason"]) for i in items
        ] == [("backend", "operator", "suspected compromise")]
        await asyncio.sleep(0.5)  # Envoys reconnect to the new control plane meanwhile
        assert (await call(session, fe_to_be))[0] != 200
        assert (await call(session, be_to_fe))[0] != 200

        # 5. Certificates are refused while quarantined; release needs a fresh attestation.
        with pytest.raises(Exception, match="quarantined"):
            await agents["backend"].attest_once(session)
        out = cli("quarantine", "release", "backend", "--ops-port", str(s.ops_port),
                  "--state-dir", str(s.state_dir))  # fmt: skip
        assert out.returncode == 0 and "pending" in out.stdout, out
        assert (await call(session, fe_to_be))[0] != 200  # released is not yet attested
        agents["backend"].current = None  # after release the agent attests afresh
        await agents["backend"].attest_once(session)
        # The backend's Envoy was refused xDS while its certificate was revoked; the control
        # plane closes a refused connection, so Envoy reconnects with its fresh certificate.
        await eventually(fe_ok)
