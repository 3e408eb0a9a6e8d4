"""``attestmesh controlplane`` on the PostgreSQL store, as a real process: the URL comes from
the environment (as from a Kubernetes Secret), the state lives in PostgreSQL (no SQLite file),
a kill -9 and restart keeps an operator's quarantine."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psycopg
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import NAMES, free_port, join_token, write_config
from attestmesh.serve import ControlPlaneSettings

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "attestmesh.cli", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def start(s: ControlPlaneSettings, log: Path, store_url: str) -> subprocess.Popen[bytes]:
    args = [
        sys.executable, "-m", "attestmesh.cli", "controlplane",
        "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
        "--mesh-policy", str(s.mesh_policy_file), "--workloads", str(s.registrations_file),
        "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
        "--ops-port", str(s.ops_port), "--sim-platform-key", str(s.sim_platform_keys[0]),
    ]  # fmt: skip
    env = {**os.environ, "ATTESTMESH_STORE": store_url}
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        url = f"http://127.0.0.1:{s.ops_port}/healthz"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
            if r.status == 200:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"control plane not healthy: {log.read_text()[-3000:]}")


def test_controlplane_keeps_its_state_in_postgresql(tmp_path: Path, pg_url: str) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    s = write_config(tmp_path, ports, pub, {n: join_token(n) for n in NAMES})
    log = tmp_path / "cp.log"
    proc = start(s, log, pg_url)
    try:
        out = cli("quarantine", "add", "backend", "--reason", "suspected compromise",
                  "--ops-port", str(s.ops_port), "--state-dir", str(s.state_dir))  # fmt: skip
        assert out.returncode == 0 and "backend: quarantined" in out.stdout, out
        with psycopg.connect(pg_url) as conn:
            rows = dict(conn.execute("SELECT name, doc FROM workloads").fetchall())
            kinds = [k for (k,) in conn.execute("SELECT kind FROM events ORDER BY id")]
        assert set(rows) == set(NAMES)
        assert json.loads(rows["backend"])["status"] == "quarantined"
        assert json.loads(rows["frontend"])["status"] != "quarantined"
        assert "quarantined" in kinds
        assert not (s.state_dir / "state.sqlite3").exists()  # nothing went to SQLite
    finally:
        proc.kill()
        proc.wait(10)
    proc = start(s, log, pg_url)  # kill -9 and restart: loaded from PostgreSQL
    try:
        listed = cli("quarantine", "list", "--json", "--ops-port", str(s.ops_port),
                     "--state-dir", str(s.state_dir))  # fmt: skip
        items = json.loads(listed.stdout)
        assert [(i["name"], i["quarantine"]["reason"]) for i in items] == [
            ("backend", "suspected compromise")
        ]
    finally:
        proc.kill()
        proc.wait(10)


def test_an_unreachable_store_refuses_to_start(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    s = write_config(tmp_path, ports, pub, {n: join_token(n) for n in NAMES})
    url = f"postgresql://mesh:hunter2-pw@127.0.0.1:{free_port()}/mesh"
    done = subprocess.run(
        [sys.executable, "-m", "attestmesh.cli", "controlplane", "--state-dir", str(s.state_dir),
         "--policy", str(s.policy_file), "--workloads", str(s.registrations_file),
         "--store", url, "--ops-port", str(s.ops_port), "--api-port", str(s.api_port),
         "--xds-port", str(s.xds_port)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "store_unreachable" in done.stderr, done.stderr[-2000:]
    assert "hunter2-pw" not in done.stderr + done.stdout
