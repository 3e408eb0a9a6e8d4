"""Bridges on loopback TCP and Unix sockets (the same code runs over AF_VSOCK in production),
and the AF_VSOCK addressing of ``VsockTransport``."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from sidecar.nitro.bridge import (
    PORT_ANY,
    VMADDR_CID_ANY,
    Bridge,
    BridgeError,
    BridgeMetrics,
    UnixTransport,
    VsockTransport,
    dial_tcp,
    dial_vsock,
    listen_tcp,
    listen_vsock,
    parse_host_port,
    peer_cid,
    transport_from_spec,
    vsock_address,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]


def test_vsock_addresses() -> None:
    assert vsock_address(16, 9000) == (16, 9000)
    assert vsock_address(VMADDR_CID_ANY, PORT_ANY, bind=True) == (VMADDR_CID_ANY, PORT_ANY)
    for cid, port in ((VMADDR_CID_ANY, 9000), (16, PORT_ANY), (-1, 1), (16, 0), (True, 1),
                      (16, 2**32), (2**32, 1)):  # fmt: skip
        with pytest.raises(BridgeError):
            vsock_address(cid, port)


def test_peer_cid() -> None:
    assert peer_cid((16, 1234)) == 16
    assert peer_cid("") is None and peer_cid(None) is None and peer_cid(("10.0.0.1", 80)) is None


def test_host_port() -> None:
    assert parse_host_port("[fd00::1]:443") == ("fd00::1", 443)
    assert parse_host_port("cp.svc:8443") == ("cp.svc", 8443)
    for bad in ("cp", "cp:", ":80", "cp:0", "cp:65536", "a b:1", "user@h:1", "h:-1", "h:1x"):
        with pytest.raises(BridgeError):
            parse_host_port(bad)


class FakeSocket:
    """Records what VsockTransport does with its AF_VSOCK socket."""

    def __init__(self, family: int, kind: int, log: list[tuple[object, ...]]) -> None:
        self.log = log
        log.append(("socket", family, kind))
        self.real = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def bind(self, address: object) -> None:
        self.log.append(("bind", address))
        self.real.bind(("127.0.0.1", 0))

    def getsockname(self) -> tuple[int, int]:
        return (VMADDR_CID_ANY, 4242)


async def test_vsock_transport_binds_cid_any_and_connects_to_cid_port() -> None:
    log: list[tuple[object, ...]] = []
    transport = VsockTransport(lambda f, k: FakeSocket(f, k, log))  # type: ignore[arg-type,return-value]

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server, port = await transport.listen(PORT_ANY, handler)
    server.close()
    assert port == 4242
    assert log[:2] == [("socket", socket.AF_VSOCK, socket.SOCK_STREAM),
                       ("bind", (VMADDR_CID_ANY, PORT_ANY))]  # fmt: skip
    with pytest.raises(BridgeError):
        await transport.connect(VMADDR_CID_ANY, 9000)  # never connect to "any"


async def test_vsock_transport_real_socket_binds_a_kernel_picked_port() -> None:
    try:
        probe = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    except OSError as exc:  # pragma: no cover - the machines have /dev/vsock
        pytest.fail(f"AF_VSOCK unavailable: {exc}")
    probe.close()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server, port = await VsockTransport().listen(PORT_ANY, handler)
    try:
        assert 1 <= port < PORT_ANY
        with pytest.raises(BridgeError) as err:  # the same port twice: a clear error
            await VsockTransport().listen(port, handler)
        assert err.value.reason == "vsock_listen"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@contextlib.asynccontextmanager
async def bridged(bridge: Bridge) -> AsyncIterator[int]:
    server = await listen_tcp("127.0.0.1", 0, bridge)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await bridge.close()


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_relay_both_ways_and_half_close() -> None:
    async def echo_after_eof(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # everything until the client's half-close
        w.write(b"got " + data)
        await w.drain()
        w.close()

    registry = CollectorRegistry()
    metrics = BridgeMetrics.create(registry)
    async with (
        tcp_server(echo_after_eof) as dest,
        bridged(Bridge("api", dial_tcp("127.0.0.1", dest), metrics)) as port,
    ):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"hello")
        await w.drain()
        w.write_eof()  # half-close: the answer still comes back
        assert await asyncio.wait_for(r.read(), 5) == b"got hello"
        w.close()
    assert metric(registry, "attestmesh_nitro_bridge_bytes_total", bridge="api",
                  direction="out") == 5  # fmt: skip
    assert metric(registry, "attestmesh_nitro_bridge_bytes_total", bridge="api",
                  direction="in") == 9  # fmt: skip
    assert metric(registry, "attestmesh_nitro_bridge_connections_total", bridge="api") == 1


async def test_a_connection_never_chooses_its_destination() -> None:
    """Whatever a client sends (a CONNECT request, a Host header) reaches the one fixed
    destination; another server is never dialled."""
    seen: dict[str, bytes] = {}

    def recorder(name: str) -> Handler:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            seen[name] = await r.read()
            w.close()

        return handle

    async with (
        tcp_server(recorder("fixed")) as fixed,
        tcp_server(recorder("other")) as other,
        bridged(Bridge("peer-0", dial_tcp("127.0.0.1", fixed))) as port,
    ):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        req = f"CONNECT 127.0.0.1:{other} HTTP/1.1\r\nHost: 127.0.0.1:{other}\r\n\r\n"
        w.write(req.encode())
        w.write_eof()
        await asyncio.wait_for(r.read(), 5)
        w.close()
    assert seen == {"fixed": req.encode()}


async def test_backpressure_bounds_what_the_bridge_buffers() -> None:
    """A destination that stops reading stops the bridge reading from the source: the bytes
    relayed stay bounded by socket buffers, not by what the source sends."""
    release = asyncio.Event()
    received = bytearray()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await release.wait()
        while chunk := await r.read(1 << 16):
            received.extend(chunk)
        w.close()

    registry = CollectorRegistry()
    total = 64 * 1024 * 1024
    metrics = BridgeMetrics.create(registry)
    async with (
        tcp_server(slow) as dest,
        bridged(Bridge("b", dial_tcp("127.0.0.1", dest), metrics)) as port,
    ):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        payload = bytes(range(256)) * (total // 256)

        async def send() -> None:
            w.write(payload)
            await w.drain()
            w.write_eof()

        sender = asyncio.create_task(send())

        def relayed() -> float:
            return metric(registry, "attestmesh_nitro_bridge_bytes_total", bridge="b",
                          direction="out")  # fmt: skip

        async with asyncio.timeout(20):  # until the relay stalls: no progress for 0.3 s
            last = -1.0
            while relayed() == 0 or relayed() != last:
                last = relayed()
                await asyncio.sleep(0.3)
        assert not sender.done()  # the source is held back
        assert 0 < relayed() < 24 * 1024 * 1024, relayed()
        release.set()
        await asyncio.wait_for(sender, 30)
        await asyncio.wait_for(r.read(), 30)
        w.close()
    assert len(received) == total and bytes(received) == payload


async def test_connections_beyond_the_cap_are_closed_and_counted() -> None:
    hold = asyncio.Event()

    async def holding(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await hold.wait()
        w.close()

    registry = CollectorRegistry()
    async with tcp_server(holding) as dest:
        bridge = Bridge("api", dial_tcp("127.0.0.1", dest), BridgeMetrics.create(registry),
                        max_connections=2)  # fmt: skip
        async with bridged(bridge) as port:
            conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            while bridge.active < 2:
                await asyncio.sleep(0.01)
            r3, w3 = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(r3.read(), 5) == b""  # closed at once
            assert metric(registry, "attestmesh_nitro_bridge_refused_total", bridge="api",
                          reason="limit") == 1  # fmt: skip
            assert bridge.active == 2
            hold.set()
            for _, w in [*conns, (r3, w3)]:
                w.close()


async def test_unreachable_destination_and_refused_peer() -> None:
    registry = CollectorRegistry()
    metrics = BridgeMetrics.create(registry)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    async with bridged(Bridge("x", dial_tcp("127.0.0.1", closed), metrics)) as port:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    assert metric(registry, "attestmesh_nitro_bridge_refused_total", bridge="x",
                  reason="connect_failed") == 1  # fmt: skip

    dialled = []

    async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        dialled.append(1)
        raise ConnectionRefusedError

    admitted = Bridge("y", dial, metrics, admit=lambda peer: False)
    async with bridged(admitted) as port:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
    assert dialled == []
    assert metric(registry, "attestmesh_nitro_bridge_refused_total", bridge="y",
                  reason="peer") == 1  # fmt: skip


async def test_unix_transport_is_vsock_over_socket_files(tmp_path: Path) -> None:
    parent, enclave = UnixTransport(tmp_path, 3), UnixTransport(tmp_path, 16)

    async def upper(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write((await r.read()).upper())
        w.close()

    async with tcp_server(upper) as dest:
        bridge = Bridge("api", dial_tcp("127.0.0.1", dest))
        server, port = await listen_vsock(parent, PORT_ANY, bridge)
        server2, port2 = await listen_vsock(parent, PORT_ANY, bridge)
        try:
            assert port == UnixTransport.EPHEMERAL and port2 == port + 1
            path = tmp_path / f"3-{port}.sock"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            # the enclave side dials the parent's port (CID 3)
            r, w = await dial_vsock(enclave, 3, port)()
            w.write(b"attest")
            w.write_eof()
            assert await asyncio.wait_for(r.read(), 5) == b"ATTEST"
            w.close()
            with pytest.raises(OSError):
                await enclave.connect(3, 1)  # nothing listens there
        finally:
            server.close()
            server2.close()
            await bridge.close()


def test_transport_spec(tmp_path: Path) -> None:
    assert isinstance(transport_from_spec("vsock", 3), VsockTransport)
    t = transport_from_spec(f"unix:{tmp_path}", 16)
    assert isinstance(t, UnixTransport) and t.cid == 16
    for bad in ("tcp:1", "unix:", ""):
        with pytest.raises(BridgeError):
            transport_from_spec(bad, 3)


async def test_close_ends_open_connections_without_loop_errors() -> None:
    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx))

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()
        w.close()

    try:
        async with tcp_server(silent) as dest:
            bridge = Bridge("api", dial_tcp("127.0.0.1", dest))
            server = await listen_tcp("127.0.0.1", 0, bridge)
            r, w = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            while bridge.active < 1:
                await asyncio.sleep(0.01)
            await bridge.close()
            assert await asyncio.wait_for(r.read(), 5) == b""  # the client's side ended
            assert bridge.active == 0
            server.close()
            w.close()
            await asyncio.sleep(0.05)  # let any done-callback run
    finally:
        loop.set_exception_handler(None)
    assert errors == []
