"""Every example runs on loopback (smoke tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vectors import REPO

pytestmark = pytest.mark.integration


def free_block(size: int = 30) -> int:
    """A base port whose next ``size`` ports are all free right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + size > 65000:
            continue
        socks = []
        try:
            for p in range(base, base + size):
                sk = socket.socket()
                socks.append(sk)
                sk.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for sk in socks:
                sk.close()
    raise RuntimeError("no free block of ports")


def test_local_mesh_example_runs_every_process(tmp_path: Path) -> None:
    env = {**os.environ, "ATTESTMESH_BIN": str(Path(sys.executable).parent)}
    out = subprocess.run(
        ["bash", str(REPO / "examples" / "local-mesh" / "run.sh"), str(free_block())],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "frontend -> backend over attested mTLS" in out.stdout
    assert "POST (mesh policy allows GET only): HTTP 403" in out.stdout
    assert "backend -> frontend (no mesh policy allows it): HTTP 403" in out.stdout
    assert "local mesh example: OK" in out.stdout
