"""Real ``attestmesh controlplane`` replica processes on one PostgreSQL database: the mesh they
serve (a sim platform key, registrations with join tokens), their settings, starting them and
waiting until they are ready. Shared by the fault tests (tests/pg) and
benchmarks/bench_replicas.py."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import NAMES, free_port, join_token, write_config
from attestmesh.serve import ControlPlaneSettings


@dataclass(frozen=True)
class Mesh:
    """The settings every replica shares (``base``: the first replica's), the platform key the
    sim evidence is signed with (``platform_pem``: the same key as a PKCS#8 file, for client
    processes) and the join token of every registered workload."""

    base: ControlPlaneSettings
    platform: ec.EllipticCurvePrivateKey
    platform_pem: Path
    tokens: dict[str, str]

    def replica(self, k: int) -> ControlPlaneSettings:
        """Replica ``k``'s settings: its own state directory and ports (0: ``base``'s)."""
        if k == 0:
            return self.base
        return dataclasses.replace(
            self.base,
            state_dir=self.base.state_dir.parent / f"state-{k}",
            api_port=free_port(),
            xds_port=free_port(),
            ops_port=free_port(),
        )

    def bundle(self) -> bytes:
        """The trust bundle (the shared root), once replica 0 is ready."""
        return (self.base.state_dir / "ca" / "root.pem").read_bytes()


def write_mesh(tmp: Path, names: Sequence[str] = ()) -> Mesh:
    """The demo's configuration in ``tmp`` (its policy and workloads), and, if ``names`` is
    given, ``workloads.yaml`` replaced by these workloads, each with its own join token."""
    platform = ec.generate_private_key(ec.SECP256R1())
    pem = tmp / "platform.pem"
    pem.write_bytes(
        platform.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pub = tmp / "sim.pub.pem"
    pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    tokens = {n: join_token(n) for n in NAMES}
    base = write_config(tmp, ports, pub, tokens)
    if names:
        tokens = {n: join_token(n) for n in names}
        base.registrations_file.write_text(
            yaml.safe_dump(
                {
                    "workloads": [
                        {
                            "name": n,
                            "namespace": "default",
                            "serviceAccount": "frontend",
                            "inbound": f"127.0.0.1:{20000 + i}",
                            "appPort": 21000 + i,
                            "outbound": {},
                            "tokenSha256": hashlib.sha256(tokens[n].encode()).hexdigest(),
                        }
                        for i, n in enumerate(names)
                    ]
                }
            )
        )
    return Mesh(base, platform, pem, tokens)


def start(
    s: ControlPlaneSettings,
    log: Path | None,
    url: str,
    *,
    burst: int = 1000,
    extra: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """``attestmesh controlplane`` for ``s`` on the database ``url`` (output to ``log``, or
    discarded)."""
    args = [
        sys.executable, "-m", "attestmesh.cli", "controlplane",
        "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
        "--workloads", str(s.registrations_file),
        "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
        "--ops-port", str(s.ops_port), "--sim-platform-key", str(s.sim_platform_keys[0]),
        "--attest-burst", str(burst), *extra,
    ]  # fmt: skip
    env = {**os.environ, "ATTESTMESH_STORE": url}
    if log is None:
        return subprocess.Popen(
            args,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    with log.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)


def _tail(log: Path | None) -> str:
    return log.read_text()[-3000:] if log is not None and log.exists() else "(no log)"


async def healthy(
    s: ControlPlaneSettings,
    proc: subprocess.Popen[bytes],
    log: Path | None,
) -> None:
    """Wait (at most 40 s) until the replica says it is ready (/readyz 200); it exiting is a
    failure."""
    async with asyncio.timeout(40), aiohttp.ClientSession() as session:
        while True:
            assert proc.poll() is None, _tail(log)
            try:
                async with session.get(f"http://127.0.0.1:{s.ops_port}/readyz") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)


def wait_ready(
    s: ControlPlaneSettings,
    proc: subprocess.Popen[bytes],
    log: Path | None = None,
    timeout: float = 60,
) -> None:
    """``healthy`` without an event loop (the benchmark)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited with {proc.returncode}: {_tail(log)}")
        try:
            url = f"http://127.0.0.1:{s.ops_port}/readyz"
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"replica not ready within {timeout} s: {_tail(log)}")


def stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL whatever still runs of ``procs`` (these processes only) and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
