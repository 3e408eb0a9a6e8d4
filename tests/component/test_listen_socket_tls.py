"""``start_h2``'s TLS on the socket itself (``attestmesh.listen._SocketTLS``) on real sockets:
a write larger than the socket buffers arrives whole and in order, the application is paused
while the peer does not read and resumed when it does, a peer that never reads is closed by
the write timeout, ``close`` sends what was written first, and a peer that drops the TCP
connection ends it. The seam on CPython (``SSLContext._wrap_socket``) is checked here."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trustme

from attestmesh.listen import CloseReason, Listener, ListenLimits, start_h2
from tests.polling import until

# far more than the socket buffers hold: the server's send buffer autotunes up to
# net.ipv4.tcp_wmem's maximum (4 MiB here), and the client's receive buffer is kept small
# (``connect(..., rcvbuf=...)``), with asyncio's TLS read buffer (256 KiB) above it
PAYLOAD = os.urandom(16 * 2**20)
LIMITS = ListenLimits(write_timeout=30, idle_timeout=30, body_timeout=30, header_timeout=30)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


class Blob(asyncio.Protocol):
    """Sends PAYLOAD when the client writes ``go`` (eight times: ``flood``); ``bye``: last
    words, then close."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.paused = 0
        self.resumed = 0
        self.lost = False

    def listen_phase(self) -> tuple[bool, object]:
        return True, 0  # always busy: no idle timeout in the way

    def listen_body(self) -> float | None:
        return None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if b"go" in data:
            self.transport.write(PAYLOAD)
        if b"flood" in data:  # more than the kernel's buffers on both sides can take
            for _ in range(8):
                self.transport.write(PAYLOAD)
        if b"bye" in data:
            self.transport.write(b"last words")
            self.transport.close()

    def pause_writing(self) -> None:
        self.paused += 1

    def resume_writing(self) -> None:
        self.resumed += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


class Service:
    """An H2 service whose connections are ``make()``'s (kept in ``conns``)."""

    def __init__(self, make: Callable[[], Any] = Blob) -> None:
        self.make = make
        self.conns: list[Any] = []
        self.servers: list[asyncio.Server] = []

    def configure(self, **_: object) -> None:
        pass

    def protocol(self, report: Callable[[str], None] | None) -> asyncio.Protocol:
        conn = self.make()
        self.conns.append(conn)
        return conn  # type: ignore[no-any-return]

    def serving(self, server: asyncio.Server) -> None:
        self.servers.append(server)


@asynccontextmanager
async def served(
    ca: trustme.CA, limits: ListenLimits = LIMITS, service: Service | None = None
) -> AsyncIterator[tuple[Service, Listener, list[CloseReason]]]:
    """``service`` (default: of Blobs) served with TLS on a fresh port; its connections
    aborted and its servers closed after."""
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(tls)
    service = service or Service()
    seen: list[CloseReason] = []
    lst = await start_h2(
        service, "127.0.0.1", 0, ssl=tls, limits=limits, on_refused=lambda _, r: seen.append(r)
    )
    try:
        yield service, lst, seen
    finally:
        for conn in service.conns:
            if conn.transport is not None:
                conn.transport.abort()
        for server in service.servers:
            server.close()
            await server.wait_closed()


async def connect(
    ca: trustme.CA, port: int, rcvbuf: int | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    if rcvbuf is None:
        return await asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
        )
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # no autotuning
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return await asyncio.open_connection(sock=sock, ssl=ctx, server_hostname="localhost")
    except BaseException:
        sock.close()
        raise


def reading(writer: asyncio.StreamWriter, on: bool) -> None:
    transport = writer.transport
    assert isinstance(transport, asyncio.Transport)
    transport.resume_reading() if on else transport.pause_reading()


def test_the_cpython_seam_exists() -> None:
    assert callable(getattr(ssl.SSLContext, "_wrap_socket", None))


async def test_a_large_write_arrives_whole_and_in_order_and_pauses_the_application(
    ca: trustme.CA,
) -> None:
    async with served(ca) as (service, lst, seen):
        reader, writer = await connect(ca, lst.port, rcvbuf=65_536)
        try:
            reading(writer, False)
            writer.write(b"go")
            await until(lambda: bool(service.conns) and service.conns[0].paused > 0)
            blob = service.conns[0]
            assert blob.transport is not None
            assert blob.transport.get_write_buffer_size() > 0
            assert blob.resumed == 0
            reading(writer, True)
            async with asyncio.timeout(10):
                got = await reader.readexactly(len(PAYLOAD))
            assert got == PAYLOAD
            await until(lambda: blob.resumed == blob.paused)
            assert blob.transport.get_write_buffer_size() == 0
            assert blob.transport.get_extra_info("cipher") is not None
            assert blob.transport.get_extra_info("peername")[0] == "127.0.0.1"
            assert lst.stats().open == 1 and not seen
            writer.close()
            await until(lambda: blob.lost)
            assert lst.stats().open == 0 and not seen
        finally:
            writer.close()  # a failed assertion leaves no socket to a later test


async def test_a_peer_that_never_reads_is_closed_by_the_write_timeout(ca: trustme.CA) -> None:
    limits = ListenLimits(write_timeout=0.5, idle_timeout=30, body_timeout=30, header_timeout=30)
    async with served(ca, limits) as (service, lst, seen):
        _, writer = await connect(ca, lst.port)
        reading(writer, False)
        writer.write(b"flood")
        await until(lambda: bool(service.conns) and service.conns[0].lost)
        assert seen == [CloseReason.WRITE_TIMEOUT]
        assert lst.stats().open == 0
        writer.close()


async def test_close_sends_what_was_written_then_ends_the_connection(ca: trustme.CA) -> None:
    async with served(ca) as (service, lst, seen):
        reader, writer = await connect(ca, lst.port)
        writer.write(b"bye")
        async with asyncio.timeout(5):
            assert await reader.read() == b"last words"  # then EOF (close_notify)
        await until(lambda: service.conns[0].lost)
        assert lst.stats().open == 0 and not seen
        writer.close()


async def test_a_peer_that_drops_the_tcp_connection_ends_it(ca: trustme.CA) -> None:
    async with served(ca) as (service, lst, seen):
        _, writer = await connect(ca, lst.port)
        writer.write(b"hello")
        await until(lambda: bool(service.conns) and service.conns[0].transport is not None)
        writer.transport.abort()
        await until(lambda: service.conns[0].lost)
        assert lst.stats().open == 0 and not seen
