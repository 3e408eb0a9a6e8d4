"""Hardened listeners on real sockets: admission caps before TLS, each timeout closing the
connection it is for (and nothing else), the small TLS read buffer on this listener only, and
the HTTP/2 limits in the server's first SETTINGS frame."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpclib.const
import h2.connection
import h2.events
import h2.settings
import pytest
import trustme
from aiohttp import web
from grpclib.client import Channel
from grpclib.encoding.base import CodecBase
from grpclib.server import Server, Stream

import attestmesh.listen as listen_mod
from attestmesh.listen import (
    CloseReason,
    ListenLimits,
    Site,
    connection_totals,
    start_aiohttp,
    start_grpc,
)

FAST = ListenLimits(
    handshake_timeout=0.5,
    header_timeout=0.5,
    body_timeout=0.8,
    idle_timeout=0.6,
    max_connections=50,
    max_connections_per_source=50,
)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_tls(ca: trustme.CA, *, h2: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost", "127.0.0.1").configure_cert(ctx)
    if h2:
        ctx.set_alpn_protocols(["h2"])
    return ctx


def client_tls(ca: trustme.CA, *, h2: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if h2:
        ctx.set_alpn_protocols(["h2"])
    return ctx


class Refusals:
    def __init__(self) -> None:
        self.seen: list[tuple[str, CloseReason]] = []

    def __call__(self, name: str, reason: CloseReason) -> None:
        self.seen.append((name, reason))

    def count(self, reason: CloseReason) -> int:
        return sum(1 for _, r in self.seen if r is reason)


async def slow(request: web.Request) -> web.Response:
    await asyncio.sleep(float(request.query.get("s", "0")))
    return web.Response(text="slow")


async def big(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    chunk = b"z" * 65536
    for _ in range(256):  # 16 MiB: far more than the socket buffers hold
        await resp.write(chunk)
    return resp


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.Response(text=str(len(body)))


@asynccontextmanager
async def http_site(
    tls: ssl.SSLContext | None, limits: ListenLimits = FAST
) -> AsyncIterator[tuple[Site, Refusals]]:
    app = web.Application(client_max_size=4 * 2**20)
    app.router.add_get("/slow", slow)
    app.router.add_post("/echo", echo)
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    seen = Refusals()
    site = await start_aiohttp(
        runner, "127.0.0.1", 0, ssl=tls, limits=limits, name="api", on_refused=seen
    )
    try:
        yield site, seen
    finally:
        await runner.cleanup()


async def closed_by_peer(reader: asyncio.StreamReader, within: float) -> float:
    """Seconds until the server closed the connection (EOF or reset)."""
    t0 = time.monotonic()
    async with asyncio.timeout(within):
        try:
            while await reader.read(4096):
                pass
        except (ConnectionResetError, ssl.SSLError):
            pass
    return time.monotonic() - t0


async def raw(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader, Any]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="idle_timeout"):
        ListenLimits(idle_timeout=0)
    with pytest.raises(ValueError, match="http2_window"):
        ListenLimits(http2_window=1024)
    assert ListenLimits().tls_read_buffer < 256 * 1024


async def test_a_source_opening_connections_too_fast_is_refused_at_accept(
    ca: trustme.CA,
) -> None:
    """The per-source rate: a burst is admitted, the next connection is closed before any TLS
    byte and counted; another source has its own bucket; closing connections gives back no
    tokens (it is the rate of opening, not the number open)."""
    limits = ListenLimits(connect_rate_per_source=0.01, connect_burst_per_source=3)
    async with http_site(server_tls(ca), limits) as (site, seen):
        held = [await raw(site.port) for _ in range(3)]
        for _, w in held:
            w.close()
        await asyncio.sleep(0.05)
        r, w = await raw(site.port)
        assert await closed_by_peer(r, 2) < 1
        w.close()
        assert seen.count(CloseReason.CONNECT_RATE) == 1
        # another source still gets in, and is served
        r2, w2 = await asyncio.open_connection(
            "127.0.0.1",
            site.port,
            ssl=client_tls(ca),
            server_hostname="localhost",
            local_addr=("127.0.0.2", 0),
        )
        w2.write(b"GET /slow?s=0 HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(r2.readuntil(b"\r\n\r\n"), 3)
        assert head.startswith(b"HTTP/1.1 200")
        w2.close()
        assert seen.count(CloseReason.CONNECT_RATE) == 1


async def test_connection_rate_buckets_refill_and_stay_bounded() -> None:
    lst = listen_mod._Listener(
        "api",
        ListenLimits(connect_rate_per_source=2.0, connect_burst_per_source=2),
        None,
        asyncio.Protocol,
        lambda app, received: (listen_mod._Phase.IDLE, None),
        None,
    )
    now = [100.0]
    lst.clock = lambda: now[0]
    assert [lst.admit("10.0.0.1") for _ in range(3)] == [None, None, CloseReason.CONNECT_RATE]
    now[0] += 0.5  # one token back at 2/s
    assert [lst.admit("10.0.0.1") for _ in range(2)] == [None, CloseReason.CONNECT_RATE]
    now[0] += 60  # refilled to the burst, not beyond
    assert [lst.admit("10.0.0.1") for _ in range(3)] == [None, None, CloseReason.CONNECT_RATE]
    # many sources, each once: the table is pruned of refilled buckets as it grows
    for i in range(3 * listen_mod._BUCKETS_PRUNE_AT):
        now[0] += 0.01
        assert lst.admit(f"10.1.{i // 256}.{i % 256}") is None
    assert len(lst.buckets) <= 2 * listen_mod._BUCKETS_PRUNE_AT
    # a pruned (refilled) source starts from a full bucket, as one never seen
    assert "10.1.0.0" not in lst.buckets
    assert lst.admit("10.1.0.0") is None


async def test_connection_caps_close_excess_at_accept_before_tls(ca: trustme.CA) -> None:
    limits = ListenLimits(max_connections=4, max_connections_per_source=2)
    async with http_site(server_tls(ca), limits) as (site, seen):
        held = [await raw(site.port) for _ in range(2)]
        # the third from the same source is closed without a handshake (no TLS bytes sent)
        r, w = await raw(site.port)
        assert await closed_by_peer(r, 2) < 1
        w.close()
        assert seen.count(CloseReason.MAX_PER_SOURCE) == 1
        # another source still gets in, up to the listener's cap
        held += [await raw(site.port, "127.0.0.2") for _ in range(2)]
        await asyncio.sleep(0.05)
        assert site.stats().open == 4
        r, w = await raw(site.port, "127.0.0.3")
        assert await closed_by_peer(r, 2) < 1
        w.close()
        assert seen.count(CloseReason.MAX_CONNECTIONS) == 1
        # a slot freed is a slot again
        held.pop()[1].close()
        await asyncio.sleep(0.05)
        _, w3 = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost",
            local_addr=("127.0.0.3", 0),
        )  # fmt: skip
        assert site.stats().open == 4
        for _, w in [*held, (None, w3)]:
            w.close()


async def test_stalled_handshake_is_closed_by_the_handshake_timeout(ca: trustme.CA) -> None:
    async with http_site(server_tls(ca)) as (site, seen):
        r, w = await raw(site.port)
        w.write(b"\x16\x03\x01\x00")  # the start of a ClientHello, then nothing
        took = await closed_by_peer(r, 3)
        assert FAST.handshake_timeout * 0.9 <= took < FAST.handshake_timeout + 1
        w.close()
        await asyncio.sleep(0.05)
        assert seen.count(CloseReason.HANDSHAKE_TIMEOUT) == 1
        assert site.stats().open == 0


async def test_silent_tls_connection_is_closed_by_the_idle_timeout(ca: trustme.CA) -> None:
    async with http_site(server_tls(ca)) as (site, seen):
        r, w = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost"
        )
        took = await closed_by_peer(r, 3)
        assert FAST.idle_timeout * 0.9 <= took < FAST.idle_timeout + 1
        w.close()
        assert seen.seen == [("api", CloseReason.IDLE_TIMEOUT)]


async def test_partial_header_is_closed_by_the_header_timeout(ca: trustme.CA) -> None:
    limits = ListenLimits(header_timeout=0.5, idle_timeout=30, body_timeout=30)
    async with http_site(server_tls(ca), limits) as (site, seen):
        r, w = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost"
        )
        w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        # dripping header lines does not extend the header's budget: the drip would go on for
        # 6 s, the connection is closed long before (the bound leaves room for a loaded machine)
        with pytest.raises((ConnectionResetError, BrokenPipeError, ssl.SSLError)):
            for _ in range(60):
                w.write(b"X-Drip: 1\r\n")
                await w.drain()
                if r.at_eof():
                    raise ConnectionResetError
                await asyncio.sleep(0.1)
                if r.at_eof() or w.transport.is_closing():
                    raise ConnectionResetError
        assert time.monotonic() - t0 < 3.0
        w.close()
        assert seen.seen == [("api", CloseReason.HEADER_TIMEOUT)]


async def test_dripped_body_is_closed_by_the_body_timeout() -> None:
    limits = ListenLimits(header_timeout=5, idle_timeout=30, body_timeout=0.6)
    async with http_site(None, limits) as (site, seen):
        r, w = await raw(site.port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        t0 = time.monotonic()

        async def drip() -> None:
            for _ in range(100):
                w.write(b"x")
                await asyncio.sleep(0.05)

        dripper = asyncio.create_task(drip())
        took = await closed_by_peer(r, 3)
        dripper.cancel()
        assert 0.5 <= took < 1.6
        assert time.monotonic() - t0 < 2
        w.close()
        assert seen.seen == [("api", CloseReason.BODY_TIMEOUT)]


async def test_peer_that_stops_reading_is_closed_by_the_write_timeout(ca: trustme.CA) -> None:
    limits = ListenLimits(write_timeout=0.5, idle_timeout=30, body_timeout=30, header_timeout=30)
    async with http_site(server_tls(ca), limits) as (site, seen):
        _, w = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost"
        )
        w.transport.pause_reading()  # asks for a large response, then never reads it
        w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(3):
            while site.stats().open:
                await asyncio.sleep(0.05)
        w.close()
        assert seen.seen == [("api", CloseReason.WRITE_TIMEOUT)]


async def test_legitimate_use_is_not_cut(ca: trustme.CA) -> None:
    """A handler slower than every timeout, a keep-alive connection used more slowly than the
    header timeout but within the idle timeout, and a 3 MB body over TLS all complete."""
    limits = ListenLimits(
        header_timeout=0.3, body_timeout=0.3, idle_timeout=0.6, handshake_timeout=0.5
    )
    async with http_site(server_tls(ca), limits) as (site, seen):
        r, w = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost"
        )
        for i in range(4):
            w.write(f"GET /slow?s={0.9 if i == 0 else 0} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 3)
            assert head.startswith(b"HTTP/1.1 200")
            assert await r.readexactly(4) == b"slow"
            await asyncio.sleep(0.4)  # > header timeout, < idle timeout
        body = b"y" * (3 * 2**20)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        w.write(body)
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200")
        assert await r.readexactly(7) == str(len(body)).encode()
        w.close()
        assert seen.seen == []


async def test_small_tls_buffer_is_this_listeners_only(ca: trustme.CA) -> None:
    """An aiohttp TLS site does TLS on the socket (``_SocketTLS``: no read buffer at all); the
    grpclib listener's SSLProtocol reads ``tls_read_buffer`` at once; the 256 KiB asyncio
    default stays for every other TLS server in the process."""
    default = 256 * 1024
    async with http_site(server_tls(ca)) as (site, _):
        runner = site._runner
        _, w = await asyncio.open_connection(
            "127.0.0.1", site.port, ssl=client_tls(ca), server_hostname="localhost"
        )
        await asyncio.sleep(0.05)
        assert runner.server is not None
        (handler,) = runner.server.connections
        assert type(handler.transport).__name__ == "_SocketTLS"
        assert not hasattr(handler.transport, "_ssl_protocol")
        w.close()

    async with grpc_server(server_tls(ca)) as (port, _):
        lean: list[int] = []
        orig = listen_mod._LeanSSLProtocol.__init__

        def spy(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            lean.append(len(self._ssl_buffer))

        listen_mod._LeanSSLProtocol.__init__ = spy  # type: ignore[method-assign]
        try:
            _, w = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_tls(ca, h2=True), server_hostname="localhost"
            )
            await asyncio.sleep(0.05)
        finally:
            listen_mod._LeanSSLProtocol.__init__ = orig  # type: ignore[method-assign]
        assert lean == [FAST.tls_read_buffer]
        w.close()

    seen: list[int] = []

    def plain_factory() -> asyncio.Protocol:
        class P(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                seen.append(len(transport._ssl_protocol._ssl_buffer))  # type: ignore[attr-defined]

        return P()

    srv = await asyncio.get_running_loop().create_server(
        plain_factory, "127.0.0.1", 0, ssl=server_tls(ca)
    )
    port = srv.sockets[0].getsockname()[1]
    _, w = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_tls(ca), server_hostname="localhost"
    )
    await asyncio.sleep(0.05)
    assert seen == [default]
    w.close()
    srv.close()
    await srv.wait_closed()


# -- HTTP/2 (grpclib) ---------------------------------------------------------------------------


class RawCodec(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class Hold:
    """A streaming RPC that answers each message and holds the stream open."""

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            "/t.Hold/Stream": grpclib.const.Handler(
                self.stream, grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes
            )
        }

    async def stream(self, stream: Stream[bytes, bytes]) -> None:
        async for msg in stream:
            await stream.send_message(msg)


@asynccontextmanager
async def grpc_server(
    tls: ssl.SSLContext | None, limits: ListenLimits = FAST
) -> AsyncIterator[tuple[int, Refusals]]:
    server = Server([Hold()], codec=RawCodec())
    seen = Refusals()
    listener = await start_grpc(
        server, "127.0.0.1", 0, ssl=tls, limits=limits, name="xds", on_refused=seen
    )
    try:
        yield listener.port, seen
    finally:
        server.close()
        await server.wait_closed()


async def server_settings(port: int, ca: trustme.CA) -> dict[int, int]:
    r, w = await asyncio.open_connection(
        "127.0.0.1", port, ssl=client_tls(ca, h2=True), server_hostname="localhost"
    )
    conn = h2.connection.H2Connection()
    conn.initiate_connection()
    w.write(conn.data_to_send())
    try:
        async with asyncio.timeout(3):
            while True:
                for ev in conn.receive_data(await r.read(65536)):
                    if isinstance(ev, h2.events.RemoteSettingsChanged):
                        return {int(k): v.new_value for k, v in ev.changed_settings.items()}
    finally:
        w.close()


async def test_http2_limits_are_in_the_first_settings_frame(ca: trustme.CA) -> None:
    limits = ListenLimits(max_streams_per_connection=7, max_header_list_size=8192)
    async with grpc_server(server_tls(ca, h2=True), limits) as (port, _):
        settings = await server_settings(port, ca)
    codes = h2.settings.SettingCodes
    assert settings[codes.MAX_CONCURRENT_STREAMS] == 7
    assert settings[codes.MAX_HEADER_LIST_SIZE] == 8192
    assert settings[codes.INITIAL_WINDOW_SIZE] == 65_535


async def test_http2_connection_without_a_stream_is_closed_but_a_stream_holds_it(
    ca: trustme.CA,
) -> None:
    async with grpc_server(server_tls(ca, h2=True)) as (port, seen):
        # preface and SETTINGS, then no stream: closed by the idle timeout
        r, w = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_tls(ca, h2=True), server_hostname="localhost"
        )
        conn = h2.connection.H2Connection()
        conn.initiate_connection()
        w.write(conn.data_to_send())
        took = await closed_by_peer(r, 3)
        assert FAST.idle_timeout * 0.9 <= took < FAST.idle_timeout + 1
        w.close()
        assert seen.seen == [("xds", CloseReason.IDLE_TIMEOUT)]

        # a real gRPC stream stays open well past every timeout
        channel = Channel("127.0.0.1", port, ssl=client_tls(ca, h2=True), codec=RawCodec())
        try:
            async with channel.request(
                "/t.Hold/Stream", grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes
            ) as stream:
                for _ in range(3):
                    await stream.send_message(b"ping")
                    assert await asyncio.wait_for(stream.recv_message(), 2) == b"ping"
                    await asyncio.sleep(FAST.idle_timeout)
                # larger than the 64 KiB windows both ways: flow control and the client's
                # own SETTINGS (applied through the server's lean settings) work
                big = bytes(range(256)) * 1200
                await stream.send_message(big)
                assert await asyncio.wait_for(stream.recv_message(), 5) == big
                await stream.cancel()
        finally:
            channel.close()
        assert len(seen.seen) == 1


async def test_closed_connections_handlers_do_not_accumulate() -> None:
    """grpclib's own every-10-connections rescan is replaced by an amortised one: closed
    connections' handlers are still dropped."""
    server = Server([Hold()], codec=RawCodec())
    listener = await start_grpc(server, "127.0.0.1", 0, ssl=None, limits=FAST, name="xds")
    try:
        for _ in range(300):
            channel = Channel("127.0.0.1", listener.port, codec=RawCodec())
            async with channel.request(
                "/t.Hold/Stream", grpclib.const.Cardinality.STREAM_STREAM, bytes, bytes
            ) as stream:
                await stream.send_message(b"x")
                assert await stream.recv_message() == b"x"
                await stream.end()
            channel.close()
        await asyncio.sleep(0.1)
        assert listener.stats().open == 0
        assert len(server._handlers) <= 64 + 1
    finally:
        server.close()
        await server.wait_closed()


async def test_plain_tcp_to_tls_xds_is_closed_by_the_handshake_timeout(ca: trustme.CA) -> None:
    async with grpc_server(server_tls(ca, h2=True)) as (port, seen):
        conns = [await raw(port) for _ in range(20)]
        took = await closed_by_peer(conns[0][0], 3)
        assert took < FAST.handshake_timeout + 1
        await asyncio.sleep(0.3)
        for _, w in conns:
            w.close()
        assert seen.count(CloseReason.HANDSHAKE_TIMEOUT) == 20


def test_source_key_groups_ipv6_by_64() -> None:
    from attestmesh.listen import _source_key

    assert _source_key(("2001:db8:1:2::5", 1, 0, 0)) == _source_key(("2001:db8:1:2:ff::1", 9, 0, 0))
    assert _source_key(("2001:db8:1:3::5", 1, 0, 0)) != _source_key(("2001:db8:1:2::5", 1, 0, 0))
    assert _source_key(("::ffff:10.0.0.1", 1, 0, 0)) == _source_key(("10.0.0.1", 2)) == "10.0.0.1"
    assert _source_key("") is None


async def test_connection_totals_count_open_and_closed_over_every_listener(
    ca: trustme.CA,
) -> None:
    """The process-wide totals the GC policy reads: admitted connections open now, and every
    one that closed (its protocol objects are garbage then), plain and TLS alike."""
    open0, closed0 = connection_totals()
    async with http_site(None) as (plain, _), http_site(server_tls(ca)) as (tls, _):
        conns = [await raw(plain.port), await raw(plain.port)]
        conns.append(await asyncio.open_connection("127.0.0.1", tls.port, ssl=client_tls(ca)))
        async with asyncio.timeout(5):
            while connection_totals()[0] < open0 + 3:
                await asyncio.sleep(0.01)
        assert connection_totals() == (open0 + 3, closed0)
        for _, writer in conns:
            writer.close()
        async with asyncio.timeout(5):
            while connection_totals() != (open0, closed0 + 3):
                await asyncio.sleep(0.01)


class _WatchedApp(asyncio.Protocol):
    """What ``_lean_h2_phase`` reads of an application that says when it goes idle."""

    def __init__(self) -> None:
        self.busy = False
        self.changed: Any = None

    def listen_body(self) -> float | None:
        return None

    def listen_phase(self) -> tuple[bool, object]:
        return self.busy, self.busy

    def listen_watch(self, changed: Any) -> None:
        self.changed = changed


class _Transport(asyncio.Transport):
    def is_closing(self) -> bool:
        return False


async def test_a_busy_watched_connection_holds_no_timer_left_from_its_idle_phase() -> None:
    lst = listen_mod._Listener("xds", FAST, None, asyncio.Protocol, listen_mod._lean_h2_phase, None)
    app = _WatchedApp()
    guard = listen_mod._Guard(lst, app)
    guard.connection_made(_Transport())
    assert guard._timer is not None  # idle: the idle timeout is armed
    app.busy = True  # a stream opened (input: observed)
    guard.data_received(b"")
    assert guard._timer is None
    app.busy = False  # the last stream ended here: the application says so
    app.changed()
    assert guard._timer is not None
    guard.connection_lost(None)
