"""nitro-parent in process: a fake nitro-cli (``EnclaveRunner``) and fake enclaves on the
Unix-socket transport; the parent's bridges, readiness, restarts and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from sidecar.nitro.bridge import PARENT_CID, UnixTransport
from sidecar.nitro.config import (
    CONTROL_PORT,
    INBOUND_PORT,
    Backoff,
    EnclaveConfig,
    Status,
    build_routes,
    control_plane_destinations,
    decode,
    encode,
    parse_config,
)
from sidecar.nitro.nitrocli import NitroCliError, RunningEnclave
from sidecar.nitro.parent import Parent, ParentSettings
from tests.integration.envoy_harness import free_port


@dataclass
class FakeEnclave:
    cid: int
    servers: list[asyncio.AbstractServer] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)
    config: EnclaveConfig | None = None
    alive: bool = True
    tokens: list[str] = field(default_factory=list)

    def kill(self) -> None:
        self.alive = False
        for s in self.servers:
            s.close()
        for w in self.writers:
            w.transport.abort()


@dataclass
class FakeNitro:
    """``EnclaveRunner``: each run-enclave starts a FakeEnclave; ``mode`` says how it behaves
    (``ok``: hello, config, attested status; ``silent``: never listens; ``garbage``)."""

    directory: Path
    mode: str = "ok"
    calls: list[tuple[str, ...]] = field(default_factory=list)
    enclaves: dict[str, FakeEnclave] = field(default_factory=dict)
    next_cid: int = 16

    async def run_enclave(self, args: Sequence[str]) -> RunningEnclave:
        self.calls.append(("run-enclave", *args))
        if self.mode == "refused":
            raise NitroCliError("nitro_cli_failed", "[ E26 ] Insufficient memory")
        cid, self.next_cid = self.next_cid, self.next_cid + 1
        enclave = FakeEnclave(cid)
        self.enclaves[f"i-enc{cid}"] = enclave
        if self.mode != "silent":
            await self._boot(enclave)
        return RunningEnclave(f"i-enc{cid}", cid, 2, 512)

    async def _boot(self, enclave: FakeEnclave) -> None:
        transport = UnixTransport(self.directory, enclave.cid)

        async def control(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            enclave.writers.append(w)
            if self.mode == "garbage":
                w.write(b"GET / HTTP/1.1\r\n")
                return
            w.write(encode({"type": "hello", "version": 1}))
            enclave.config = parse_config(decode(await r.readline()))
            if self.mode == "flood":  # one unbounded line instead of status reports
                with contextlib.suppress(ConnectionError):
                    for _ in range(64):
                        w.write(b"x" * 65536)
                        await w.drain()
                return
            status = Status(True, time.time() + 3600, f"{enclave.cid:x}")
            w.write(encode(status.to_message()))
            while line := await r.readline():
                msg = decode(line)
                if msg["type"] == "token":
                    enclave.tokens.append(msg["token"])

        async def inbound(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            enclave.writers.append(w)
            w.write(b"enclave " + await r.read())
            w.close()

        enclave.servers.append((await transport.listen(CONTROL_PORT, control))[0])
        enclave.servers.append((await transport.listen(INBOUND_PORT, inbound))[0])

    async def state(self, enclave_id: str) -> str | None:
        self.calls.append(("describe-enclaves",))
        e = self.enclaves.get(enclave_id)
        return "RUNNING" if e is not None and e.alive else None

    async def terminate(self, enclave_id: str, timeout_s: float | None = None) -> None:
        self.calls.append(("terminate-enclave", enclave_id, str(timeout_s)))
        e = self.enclaves.get(enclave_id)
        if e is not None:
            e.kill()


@dataclass
class Running:
    parent: Parent
    nitro: FakeNitro
    ports: dict[str, int]
    session: aiohttp.ClientSession
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def readyz(self) -> tuple[int, dict[str, object]]:
        async with self.session.get(f"http://127.0.0.1:{self.ports['ready']}/readyz") as r:
            return r.status, await r.json()

    async def until(self, check: object, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(aiohttp.ClientError):  # not listening yet
                    if await check():  # type: ignore[operator]
                        return
                await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(tmp_path: Path, mode: str = "ok", boot_timeout_s: float = 5.0,
                  dest_port: int = 1) -> AsyncIterator[Running]:  # fmt: skip
    ports = {"inbound": free_port(), "ready": free_port()}
    routes = build_routes(control_plane_destinations(
        "https://127.0.0.1:8443", "127.0.0.1:18000", [f"127.0.0.1:{dest_port}"]
    ))  # fmt: skip
    token = tmp_path / "token"
    token.write_text("pod-token\n")
    settings = ParentSettings(
        run_args=("run-enclave", "--eif-path", "/e.eif"),
        config=EnclaveConfig(
            "shop/web-0",
            "https://127.0.0.1:8443",
            "127.0.0.1:18000",
            "mesh.example",
            routes,
            "10.0.0.5",
            ports["inbound"],
            "",
        ),
        token_file=token,
        inbound_listen="127.0.0.1",
        ready_host="127.0.0.1",
        ready_port=ports["ready"],
        grace_s=3.0,
        boot_timeout_s=boot_timeout_s,
        backoff=Backoff(initial_s=0.05, maximum_s=0.2),
        token_poll_s=0.05,
    )
    nitro = FakeNitro(tmp_path, mode)
    parent = Parent(settings, nitro, UnixTransport(tmp_path, PARENT_CID))
    stop = asyncio.Event()
    task = asyncio.create_task(parent.run(stop))
    async with aiohttp.ClientSession() as session:
        r = Running(parent, nitro, ports, session, stop, task)
        try:
            yield r
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            for e in nitro.enclaves.values():
                e.kill()


async def test_parent_configures_the_enclave_bridges_and_restarts_it(tmp_path: Path) -> None:
    async def upper(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write((await r.read()).upper())
        w.close()

    dest = await asyncio.start_server(upper, "127.0.0.1", 0)
    dest_port = dest.sockets[0].getsockname()[1]
    try:
        async with running(tmp_path, dest_port=dest_port) as r:

            async def ready() -> bool:
                return (await r.readyz())[0] == 200

            await r.until(ready)
            (first,) = r.nitro.enclaves.values()
            cfg = first.config
            assert cfg is not None and cfg.token == "pod-token"
            assert [x.name for x in cfg.routes] == ["api", "xds", "peer-0"]
            # the parent's vsock ports are real listeners; peer-0 reaches exactly its peer
            peer = cfg.routes[2]
            rd, wr = await UnixTransport(tmp_path, first.cid).connect(PARENT_CID, peer.vsock_port)
            wr.write(b"from the enclave")
            wr.write_eof()
            assert await asyncio.wait_for(rd.read(), 5) == b"FROM THE ENCLAVE"
            wr.close()
            # the pod's inbound port reaches the enclave's inbound vsock port
            rd, wr = await asyncio.open_connection("127.0.0.1", r.ports["inbound"])
            wr.write(b"mesh")
            wr.write_eof()
            assert await asyncio.wait_for(rd.read(), 5) == b"enclave mesh"
            wr.close()

            first.kill()  # the enclave exits: not ready, then restarted and ready again

            async def restarted() -> bool:
                status, view = await r.readyz()
                return status == 200 and view["enclave_cid"] == 17 and view["restarts"] == 1

            await r.until(restarted)
            # over vsock only the enclave it runs may use its bridges: not the old CID, nor
            # another pod's enclave on the node (Unix sockets carry no CID: admitted)
            assert r.parent._admit((17, 1024)) and not r.parent._admit((16, 1024))
            assert not r.parent._admit((18, 1024)) and r.parent._admit("")
            second = r.nitro.enclaves["i-enc17"]
            assert second.config is not None and second.config.routes == cfg.routes
        calls = [c[0] for c in r.nitro.calls]
        assert calls.count("run-enclave") == 2
        # the dead enclave was cleaned up, the running one terminated within the grace period
        terminations = [c for c in r.nitro.calls if c[0] == "terminate-enclave"]
        assert terminations == [("terminate-enclave", "i-enc16", "30.0"),
                                ("terminate-enclave", "i-enc17", "3.0")]  # fmt: skip
    finally:
        dest.close()


@pytest.mark.parametrize("mode", ["silent", "garbage"])
async def test_an_enclave_that_never_says_hello_is_restarted(tmp_path: Path, mode: str) -> None:
    async with running(tmp_path, mode=mode, boot_timeout_s=0.5) as r:

        async def retried() -> bool:
            return r.parent.state.restarts >= 2

        await r.until(retried)
        status, view = await r.readyz()
        assert status == 503 and view["attested"] is False
        assert all(e.config is None for e in r.nitro.enclaves.values())
        ended = {c[1] for c in r.nitro.calls if c[0] == "terminate-enclave"}
        assert {"i-enc16", "i-enc17"} <= ended
        reason = "boot_timeout" if mode == "silent" else "bad_message"
        metric = r.parent.registry.get_sample_value(
            "attestmesh_nitro_control_refused_total", {"reason": reason}
        )
        assert metric is not None and metric >= 2


async def test_an_oversized_control_message_ends_the_session(tmp_path: Path) -> None:
    """The control channel reads at most MAX_MESSAGE per line: a longer one is refused (not
    buffered), counted, and the enclave restarted."""
    async with running(tmp_path, mode="flood") as r:

        async def retried() -> bool:
            return r.parent.state.restarts >= 1

        await r.until(retried)
        metric = r.parent.registry.get_sample_value(
            "attestmesh_nitro_control_refused_total", {"reason": "bad_message"}
        )
        assert metric is not None and metric >= 1
        assert r.nitro.enclaves["i-enc16"].config is not None  # it was configured first
        assert ("terminate-enclave", "i-enc16", "30.0") in r.nitro.calls


async def test_a_new_pod_token_is_sent_to_the_running_enclave(tmp_path: Path) -> None:
    async with running(tmp_path) as r:

        async def ready() -> bool:
            return (await r.readyz())[0] == 200

        await r.until(ready)
        enclave = r.nitro.enclaves["i-enc16"]
        assert enclave.config is not None and enclave.config.token == "pod-token"
        (tmp_path / "token").write_text("rotated-token\n")

        async def sent() -> bool:
            return enclave.tokens == ["rotated-token"]

        await r.until(sent)
        await asyncio.sleep(0.2)  # polled again: an unchanged token is not sent twice
        assert enclave.tokens == ["rotated-token"]


async def test_a_failing_run_enclave_is_retried_with_backoff(tmp_path: Path) -> None:
    async with running(tmp_path, mode="refused") as r:

        async def retried() -> bool:
            return r.parent.state.restarts >= 3

        started = time.monotonic()
        await r.until(retried)
        # three attempts with the backoff's 0.05 s then 0.1 s between them
        assert time.monotonic() - started >= 0.15
        status, view = await r.readyz()
        assert status == 503 and view["running"] is False
        failed = r.parent.registry.get_sample_value(
            "attestmesh_nitro_enclave_starts_total", {"outcome": "failed"}
        )
        assert failed is not None and failed >= 3
        assert not [c for c in r.nitro.calls if c[0] == "terminate-enclave"]
