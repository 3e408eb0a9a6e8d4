"""Byte bridges between an enclave and its parent: TCP on one side, vsock on the other.

An enclave has no network, only vsock to its parent (CID 3 from inside). Each bridge listens on
one fixed address and dials exactly one fixed destination: a connection never chooses where it
goes (no CONNECT-style request, no destination header), so the parent is never an open proxy.

- ``Transport`` is the vsock seam: ``listen(port)`` on this side (``PORT_ANY``: the kernel
  picks one; the bound port is returned), ``connect(cid, port)`` to the other.
  ``VsockTransport`` is AF_VSOCK (production); ``UnixTransport`` maps ``(cid, port)`` to a
  socket file ``<dir>/<cid>-<port>.sock`` (tests: crosses network namespaces like vsock does).
- ``Bridge`` relays each accepted connection to its one destination: both directions are
  pumped with backpressure (a write waits for the other side to drain before reading more) and
  half-close (EOF on one side becomes ``write_eof`` on the other); at most ``max_connections``
  at a time (more are closed at once, counted); a connection whose peer ``admit`` refuses (a
  vsock CID other than the one enclave this parent runs) is closed at once, counted; bytes,
  connections and refusals are counted per bridge name (a fixed set, bounded labels).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from certs.errors import AttestmeshError

PARENT_CID = 3  # the parent instance, as seen from inside an enclave
VMADDR_CID_ANY = 0xFFFFFFFF
PORT_ANY = 0xFFFFFFFF  # VMADDR_PORT_ANY: bind to a port the kernel picks
MAX_CID = 0xFFFFFFFE
MAX_VSOCK_PORT = 0xFFFFFFFE
CHUNK = 64 * 1024
DEFAULT_MAX_CONNECTIONS = 256
CONNECT_TIMEOUT_S = 5.0

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class BridgeError(AttestmeshError):
    """A bridge or transport was misconfigured or could not be set up."""


def vsock_address(cid: int, port: int, *, bind: bool = False) -> tuple[int, int]:
    """The AF_VSOCK socket address ``(cid, port)``, validated (``VMADDR_CID_ANY`` and
    ``PORT_ANY`` only to bind)."""
    if (
        isinstance(cid, bool)
        or not isinstance(cid, int)
        or not (0 <= cid <= MAX_CID or (bind and cid == VMADDR_CID_ANY))
    ):
        raise BridgeError("vsock_address", f"CID {cid!r} out of range")
    if (
        isinstance(port, bool)
        or not isinstance(port, int)
        or not (1 <= port <= MAX_VSOCK_PORT or (bind and port == PORT_ANY))
    ):
        raise BridgeError("vsock_address", f"vsock port {port!r} out of range")
    return cid, port


def peer_cid(peername: object) -> int | None:
    """The CID of an accepted vsock connection's peer (``getpeername()`` is ``(cid, port)``);
    None for a transport without CIDs (the tests' Unix sockets)."""
    if isinstance(peername, tuple) and len(peername) == 2 and isinstance(peername[0], int):
        return peername[0]
    return None


Listener = tuple[asyncio.AbstractServer, int]


class Transport(Protocol):
    """The vsock seam: listen on this side (returns the bound port), connect to the other."""

    async def listen(self, port: int, handler: Handler) -> Listener: ...

    async def connect(self, cid: int, port: int) -> Streams: ...


SocketFactory = Callable[[int, int], socket.socket]


class VsockTransport:
    """AF_VSOCK. Listens on ``(VMADDR_CID_ANY, port)``; ``socket_factory`` is a seam for tests."""

    def __init__(self, socket_factory: SocketFactory | None = None) -> None:
        self._socket = socket_factory or (lambda family, kind: socket.socket(family, kind))

    def _new(self) -> socket.socket:
        family = getattr(socket, "AF_VSOCK", 40)
        try:
            sock = self._socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise BridgeError("vsock_unavailable", f"AF_VSOCK: {exc.strerror or exc}") from None
        return sock

    async def listen(self, port: int, handler: Handler) -> Listener:
        sock = self._new()
        try:
            sock.bind(vsock_address(VMADDR_CID_ANY, port, bind=True))
            sock.listen(128)
            sock.setblocking(False)
            bound = int(sock.getsockname()[1])
        except OSError as exc:
            sock.close()
            raise BridgeError("vsock_listen", f"vsock port {port}: {exc.strerror or exc}") from None
        return await asyncio.start_server(handler, sock=sock, limit=CHUNK), bound

    async def connect(self, cid: int, port: int) -> Streams:
        address = vsock_address(cid, port)
        sock = self._new()
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, address)
        except OSError:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=CHUNK)


class UnixTransport:
    """vsock addresses as socket files ``<directory>/<cid>-<port>.sock``; this side is ``cid``.

    Unix socket files are reached through the file system, so (like vsock) they cross network
    namespaces: the tests run the enclave in its own network namespace with only loopback.
    ``PORT_ANY`` picks the first free port from ``EPHEMERAL``."""

    EPHEMERAL = 49152

    def __init__(self, directory: Path, cid: int) -> None:
        self.directory = directory
        self.cid = vsock_address(cid, 1)[0]

    def path(self, cid: int, port: int) -> Path:
        cid, port = vsock_address(cid, port)
        return self.directory / f"{cid}-{port}.sock"

    async def listen(self, port: int, handler: Handler) -> Listener:
        vsock_address(self.cid, port, bind=True)
        if port == PORT_ANY:
            port = self.EPHEMERAL
            while self.path(self.cid, port).exists():
                port += 1
        path = self.path(self.cid, port)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = await asyncio.start_unix_server(handler, path=str(path), limit=CHUNK)
        path.chmod(0o600)
        return server, port

    async def connect(self, cid: int, port: int) -> Streams:
        return await asyncio.open_unix_connection(str(self.path(cid, port)), limit=CHUNK)


def parse_host_port(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; BridgeError when malformed."""
    host, sep, raw = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise BridgeError("bad_address", f"{text!r} is not host:port")
    if any(c.isspace() or c in "/@" for c in host) or len(host) > 253:
        raise BridgeError("bad_address", f"{text!r} is not host:port")
    return host, int(raw)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# metrics


@dataclass(frozen=True, slots=True)
class BridgeMetrics:
    connections: Counter
    refused: Counter
    active: Gauge
    bytes: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> BridgeMetrics:
        return cls(
            Counter(
                "attestmesh_nitro_bridge_connections_total",
                "Connections relayed by a Nitro bridge (destination reached)",
                ["bridge"],
                registry=registry,
            ),
            Counter(
                "attestmesh_nitro_bridge_refused_total",
                "Connections a Nitro bridge closed at once, by reason",
                ["bridge", "reason"],
                registry=registry,
            ),
            Gauge(
                "attestmesh_nitro_bridge_active_connections",
                "Connections open through a Nitro bridge",
                ["bridge"],
                registry=registry,
            ),
            Counter(
                "attestmesh_nitro_bridge_bytes_total",
                "Bytes relayed by a Nitro bridge (out: from the accepting side)",
                ["bridge", "direction"],
                registry=registry,
            ),
        )


# ---------------------------------------------------------------------------------------------
# relay


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: Callable[[int], None]
) -> None:
    """Copy until EOF, waiting for ``writer`` to drain after every chunk (backpressure); then
    half-close ``writer``. Connection errors end the copy."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            count(len(chunk))
            await writer.drain()
        if writer.can_write_eof() and not writer.is_closing():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()


async def relay(a: Streams, b: Streams, count: Callable[[str, int], None]) -> None:
    """Relay between two connections until both directions ended; close both."""
    (ar, aw), (br, bw) = a, b
    try:
        await asyncio.gather(
            _pump(ar, bw, lambda n: count("out", n)), _pump(br, aw, lambda n: count("in", n))
        )
    finally:
        for w in (aw, bw):
            w.close()
        for w in (aw, bw):
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


Dial = Callable[[], Awaitable[Streams]]


class Bridge:
    """Every connection accepted by the caller's listener goes to ``dial()``: one destination."""

    def __init__(
        self,
        name: str,
        dial: Dial,
        metrics: BridgeMetrics | None = None,
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        admit: Callable[[object], bool] | None = None,
    ) -> None:
        self.name = name
        self._dial = dial
        self._admit = admit
        self._metrics = metrics
        self._max = max_connections
        self._timeout = connect_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.active = 0

    def _refuse(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.refused.labels(bridge=self.name, reason=reason).inc()

    def _count(self, direction: str, n: int) -> None:
        if self._metrics is not None:
            self._metrics.bytes.labels(bridge=self.name, direction=direction).inc(n)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._admit is not None and not self._admit(writer.get_extra_info("peername")):
            self._refuse("peer")
            writer.transport.abort()
            return
        if self.active >= self._max:
            self._refuse("limit")
            writer.transport.abort()
            return
        self.active += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        if self._metrics is not None:
            self._metrics.active.labels(bridge=self.name).inc()
        try:
            try:
                async with asyncio.timeout(self._timeout):
                    other = await self._dial()
            except (OSError, TimeoutError):
                self._refuse("connect_failed")
                writer.transport.abort()
                return
            if self._metrics is not None:
                self._metrics.connections.labels(bridge=self.name).inc()
            await relay((reader, writer), other, self._count)
        except asyncio.CancelledError:
            # close() ended this connection: this is the connection's own task (the server's
            # callback), so the cancellation stops here instead of being logged as an error
            writer.transport.abort()
        finally:
            self.active -= 1
            if task is not None:
                self._tasks.discard(task)
            if self._metrics is not None:
                self._metrics.active.labels(bridge=self.name).dec()

    async def close(self) -> None:
        """End every relayed connection (both sides closed)."""
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def dial_tcp(host: str, port: int) -> Dial:
    async def dial() -> Streams:
        return await asyncio.open_connection(host, port, limit=CHUNK)

    return dial


def dial_vsock(transport: Transport, cid: int, port: int) -> Dial:
    vsock_address(cid, port)

    async def dial() -> Streams:
        return await transport.connect(cid, port)

    return dial


async def listen_tcp(host: str, port: int, bridge: Bridge) -> asyncio.Server:
    try:
        return await asyncio.start_server(bridge.handle, host, port, limit=CHUNK)
    except OSError as exc:
        raise BridgeError("tcp_listen", f"{host}:{port}: {exc.strerror or exc}") from None


async def listen_vsock(transport: Transport, port: int, bridge: Bridge) -> Listener:
    try:
        return await transport.listen(port, bridge.handle)
    except OSError as exc:
        raise BridgeError("vsock_listen", f"vsock port {port}: {exc.strerror or exc}") from None


def transport_from_spec(spec: str, cid: int) -> Transport:
    """``vsock`` (production) or ``unix:DIR`` (tests: socket files in DIR, this side ``cid``)."""
    if spec == "vsock":
        return VsockTransport()
    if spec.startswith("unix:") and len(spec) > 5:
        return UnixTransport(Path(spec[5:]), cid)
    raise BridgeError("usage", f"transport {spec!r}: expected vsock or unix:DIR")
