"""``attestmesh nitro-parent``: the pod-side half of a Nitro Enclaves workload.

It holds the pod's Nitro resources and:

- starts the enclave with ``nitro-cli run-enclave``, sized from what the pod was granted
  (``config.size_enclave``: never more), restarts it with backoff when it exits (``nitro-cli
  describe-enclaves`` no longer lists it RUNNING, or its control session closed, or it did not
  answer on its control port within ``boot_timeout_s``), and terminates it on SIGTERM within
  the grace period;
- opens the control session (the enclave's vsock ``CONTROL_PORT``): the enclave's hello gets
  its configuration; its status reports decide readiness; token updates follow the pod's token;
- bridges each configured destination (a vsock port the kernel picks -> exactly that
  ``host:port``; nothing else is reachable, and only from the CID of the enclave it started)
  and the pod's inbound mesh port (TCP -> the enclave's vsock ``INBOUND_PORT``);
- serves ``/readyz`` (200 when the enclave runs and its agent holds a valid certificate),
  ``/healthz`` and ``/metrics`` over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from sidecar.nitro.bridge import (
    PORT_ANY,
    Bridge,
    BridgeMetrics,
    Streams,
    Transport,
    dial_tcp,
    listen_tcp,
    listen_vsock,
    peer_cid,
)
from sidecar.nitro.config import (
    CONTROL_PORT,
    INBOUND_PORT,
    PROTOCOL_VERSION,
    Backoff,
    ControlError,
    EnclaveConfig,
    ParentState,
    decode,
    encode,
    parse_status,
)
from sidecar.nitro.nitrocli import NitroCliError, RunningEnclave

log = logging.getLogger(__name__)

TOKEN_POLL_S = 10.0
DESCRIBE_POLL_S = 1.0
HELLO_TIMEOUT_S = 10.0
CONNECT_RETRY_S = 0.2
TERMINATE_TIMEOUT_S = 30.0


class EnclaveRunner(Protocol):
    """What the parent needs of nitro-cli (``nitrocli.NitroCli``; tests give a fake)."""

    async def run_enclave(self, args: Sequence[str]) -> RunningEnclave: ...

    async def state(self, enclave_id: str) -> str | None: ...

    async def terminate(self, enclave_id: str, timeout_s: float | None = None) -> None: ...


@dataclass(frozen=True, slots=True)
class ParentSettings:
    run_args: tuple[str, ...]  # nitro-cli run-enclave arguments (nitrocli.run_enclave_args)
    config: EnclaveConfig  # sent to the enclave (the token is read from token_file)
    token_file: Path | None
    inbound_listen: str  # the pod's address for the inbound mesh port
    ready_host: str
    ready_port: int
    grace_s: float = 25.0
    boot_timeout_s: float = 120.0
    backoff: Backoff = field(default_factory=Backoff)
    token_poll_s: float = TOKEN_POLL_S
    max_connections: int = 256


class Parent:
    def __init__(
        self,
        settings: ParentSettings,
        nitro: EnclaveRunner,
        transport: Transport,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.state = ParentState()
        self._nitro = nitro
        self._transport = transport
        self._clock = clock
        self.registry = registry or CollectorRegistry()
        self._metrics = BridgeMetrics.create(self.registry)
        self._starts = Counter(
            "attestmesh_nitro_enclave_starts_total",
            "nitro-cli run-enclave calls, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._control_refused = Counter(
            "attestmesh_nitro_control_refused_total",
            "Control connections or messages refused, by reason",
            ["reason"],
            registry=self.registry,
        )
        self._session_writer: asyncio.StreamWriter | None = None
        self._lost = asyncio.Event()
        self._token: str | None = None
        self._bridges: list[Bridge] = []
        self._routes = settings.config.routes

    # -- control channel ------------------------------------------------------------------

    def _admit(self, peername: object) -> bool:
        """Only the enclave this parent started may use its bridges (vsock ports are shared by
        every enclave on the host)."""
        cid = peer_cid(peername)
        return cid is None or (self.state.running and cid == self.state.enclave_cid)

    async def _open_session(self, enclave: RunningEnclave, deadline: float) -> Streams | None:
        """Connect to the enclave's control port until it answers or ``deadline``."""
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    return await self._transport.connect(enclave.cid, CONTROL_PORT)
            except (OSError, TimeoutError):
                await asyncio.sleep(CONNECT_RETRY_S)
        return None

    async def _session(self, enclave: RunningEnclave) -> None:
        """The control session with ``enclave``: returns when it ends (``_lost`` is set)."""
        try:
            streams = await self._open_session(
                enclave, time.monotonic() + self.settings.boot_timeout_s
            )
            if streams is None:
                log.error("enclave %s did not answer within its boot timeout", enclave.enclave_id)
                self._control_refused.labels(reason="boot_timeout").inc()
                return
            reader, writer = streams
            try:
                async with asyncio.timeout(HELLO_TIMEOUT_S):
                    hello = decode(await reader.readline())
                if hello["type"] != "hello" or hello.get("version") != PROTOCOL_VERSION:
                    raise ControlError("control_invalid", "expected hello version 1")
                self._session_writer = writer
                self._token = self._read_token()
                config = replace(self.settings.config, routes=self._routes, token=self._token)
                writer.write(encode(config.to_message()))
                while line := await reader.readline():
                    msg = decode(line)
                    if msg["type"] != "status":
                        raise ControlError("control_invalid", "expected status")
                    self.state = replace(self.state, status=parse_status(msg))
                log.error("enclave %s closed its control session", enclave.enclave_id)
            except (ControlError, ValueError, TimeoutError, ConnectionError) as exc:
                self._control_refused.labels(reason="bad_message").inc()
                log.error("enclave %s control session: %s", enclave.enclave_id, exc)
            finally:
                self._session_writer = None
                writer.transport.abort()
        finally:
            self._lost.set()

    def _read_token(self) -> str | None:
        path = self.settings.token_file
        if path is None:
            return None
        try:
            return path.read_text().strip() or None
        except OSError as exc:
            log.warning("cannot read %s: %s", path, exc)
            return self._token

    async def _watch_token(self) -> None:
        while True:
            await asyncio.sleep(self.settings.token_poll_s)
            token = self._read_token()
            session = self._session_writer
            if token != self._token and token is not None and session is not None:
                self._token = token
                session.write(encode({"type": "token", "token": token}))

    # -- enclave lifecycle ----------------------------------------------------------------

    async def _start(self) -> RunningEnclave | None:
        try:
            enclave = await self._nitro.run_enclave(self.settings.run_args)
        except NitroCliError as exc:
            self._starts.labels(outcome="failed").inc()
            log.error("nitro-cli run-enclave failed: %s", exc.detail)
            return None
        self._starts.labels(outcome="started").inc()
        log.info(
            "enclave %s started (CID %d, %d CPUs, %d MiB)",
            enclave.enclave_id, enclave.cid, enclave.cpu_count, enclave.memory_mib,
        )  # fmt: skip
        return enclave

    async def _until_gone(self, enclave: RunningEnclave, stop: asyncio.Event) -> None:
        """Return when the enclave stopped running, its control session ended (or never
        began), or ``stop`` is set."""
        while not stop.is_set() and not self._lost.is_set():
            try:
                state = await self._nitro.state(enclave.enclave_id)
            except NitroCliError as exc:
                log.warning("nitro-cli describe-enclaves: %s", exc.detail)
                state = "RUNNING"  # unknown: keep watching the control session
            if state != "RUNNING":
                log.error("enclave %s is %s", enclave.enclave_id, state or "gone")
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(DESCRIBE_POLL_S):
                    await _first(stop, self._lost)

    async def _terminate(self, enclave: RunningEnclave, timeout_s: float) -> None:
        try:
            await self._nitro.terminate(enclave.enclave_id, timeout_s=max(timeout_s, 0.1))
        except NitroCliError as exc:
            log.warning("nitro-cli terminate-enclave %s: %s", enclave.enclave_id, exc.detail)

    async def _supervise(self, stop: asyncio.Event) -> None:
        failures = 0
        backoff = self.settings.backoff
        while not stop.is_set():
            self._lost.clear()
            enclave = await self._start()
            started = time.monotonic()
            if enclave is not None:
                self.state = replace(
                    self.state,
                    running=True,
                    enclave_id=enclave.enclave_id,
                    enclave_cid=enclave.cid,
                    status=None,
                )
                session = asyncio.create_task(self._session(enclave))
                try:
                    await self._until_gone(enclave, stop)
                finally:
                    self.state = replace(self.state, running=False, status=None)
                    session.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await session
                    if stop.is_set():
                        await self._terminate(enclave, self.settings.grace_s)
                if stop.is_set():
                    return
                await self._terminate(enclave, TERMINATE_TIMEOUT_S)
            failures = backoff.failures_after(failures, time.monotonic() - started)
            self.state = replace(self.state, restarts=self.state.restarts + 1)
            delay = backoff.delay(failures)
            log.warning("restarting the enclave in %.1fs (failure %d)", delay, failures)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()

    # -- servers --------------------------------------------------------------------------

    async def _dial_enclave(self) -> Streams:
        cid = self.state.enclave_cid
        if not self.state.running or cid is None:
            raise ConnectionRefusedError("no enclave running")
        return await self._transport.connect(cid, INBOUND_PORT)

    def _ready_app(self) -> web.Application:
        async def readyz(_: web.Request) -> web.Response:
            view = self.state.view(self._clock())
            return web.json_response(view, status=200 if view["ready"] else 503)

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(
                body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
            )

        app = web.Application()
        app.router.add_get("/readyz", readyz)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/metrics", metrics)
        return app

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        async with contextlib.AsyncExitStack() as stack:
            servers: list[asyncio.AbstractServer] = []
            routes = []
            for route in s.config.routes:
                bridge = Bridge(
                    route.name,
                    dial_tcp(route.host, route.port),
                    self._metrics,
                    max_connections=s.max_connections,
                    admit=self._admit,
                )
                self._bridges.append(bridge)
                server, port = await listen_vsock(self._transport, PORT_ANY, bridge)
                servers.append(server)
                routes.append(replace(route, vsock_port=port))
            self._routes = tuple(routes)
            inbound = Bridge(
                "inbound", self._dial_enclave, self._metrics, max_connections=s.max_connections
            )
            self._bridges.append(inbound)
            servers.append(await listen_tcp(s.inbound_listen, s.config.inbound_port, inbound))

            async def close_servers() -> None:
                for server in servers:
                    server.close()
                for bridge in self._bridges:
                    await bridge.close()
                for server in servers:
                    await server.wait_closed()

            stack.push_async_callback(close_servers)
            runner = web.AppRunner(self._ready_app(), access_log=None)
            await runner.setup()
            stack.push_async_callback(runner.cleanup)
            await web.TCPSite(runner, s.ready_host, s.ready_port).start()
            token_task = asyncio.create_task(self._watch_token())
            try:
                await self._supervise(stop)
            finally:
                token_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await token_task


async def _first(*events: asyncio.Event) -> None:
    waits = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
