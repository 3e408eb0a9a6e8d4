"""The README's main job: ``attestmesh demo`` holds every expectation with real Envoys."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attestmesh.demo import run_demo
from tests.integration.test_attest_processes import alive

pytestmark = pytest.mark.integration


async def test_demo_holds_every_expectation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_demo(tmp_path) == 0
    out = capsys.readouterr().out
    assert "ALL EXPECTATIONS HELD" in out
    assert "FAIL" not in out
    assert out.count("PASS") == 7
    # the state the demo leaves behind: the CA and the SQLite store persisted in its directory
    assert (tmp_path / "state" / "ca" / "root.pem").exists()
    assert (tmp_path / "state" / "state.sqlite3").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_ctrl_c_stops_every_process_the_demo_started(tmp_path: Path, sig: int) -> None:
    """SIGINT (or SIGTERM) while the mesh runs: exit 130, and no Envoy or worker process of
    this demo is left behind (SIGTERM killed the demo at once and left its Envoys running)."""
    # Ctrl-C at a terminal: SIGINT handled as Python does by default. A process started in
    # the background of a shell without job control inherits SIGINT ignored (and rightly keeps
    # ignoring it): CI may run the suite so, hence the handler set here explicitly.
    run_cli = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['attestmesh', *sys.argv[1:]]; "
        "runpy.run_module('attestmesh.cli', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", run_cli, "demo", "--hold", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    drain: threading.Thread | None = None
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "holding the mesh" in line or not line:
                break
        assert "holding the mesh" in lines[-1], "".join(lines)
        # the rest of its output is read on: a full pipe would block the demo's shutdown
        drain = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        drain.start()
        envoys = _envoys_of(tmp_path)
        assert len(envoys) == 2, envoys
        children = _children_of(proc.pid)
        assert len(children) >= 2, children  # its Envoys (and its worker processes)
        proc.send_signal(sig)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no exit 30 s after {sig}:\n" + "".join(lines[-40:])) from None
        assert code == 130, "".join(lines[-40:])
        assert _envoys_of(tmp_path) == []
        assert [p for p in children if alive(p)] == []
        assert not list(tmp_path.glob("sds-*.sock"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if drain is not None:
            drain.join(10)  # at the end of the output, before the pipe is closed under it
        proc.stdout.close()


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _envoys_of(workdir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"{workdir}/envoy/envoy-"], capture_output=True, text=True)
    return out.stdout.split()
