"""An attacker's review of ``start_h2``'s TLS on the socket itself (``attestmesh.listen.
_SocketTLS``) and of the lean ADS connection's peer identity (``xds.adsconn.identity_of``), on
real sockets: each test is either a hole found (and fixed) or a property checked and found
sound (a client without a certificate never reaches the application, a dripped handshake is
cut, every path closes both descriptors and reports ``connection_lost`` once, a TLS 1.3
KeyUpdate while the socket is full does not spin the loop)."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import random
import socket
import ssl
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.utils import CryptographyDeprecationWarning

from attestmesh import listen
from attestmesh.listen import CloseReason, Listener, ListenLimits, start_h2
from tests.polling import until
from tests.unit.test_adsconn_identity import _cert
from xds.adsconn import identity_of
from xds.server import PeerIdentity

SHORT = ListenLimits(
    handshake_timeout=1.0, write_timeout=1.0, idle_timeout=30, body_timeout=30, header_timeout=30
)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


class App(asyncio.Protocol):
    """Always busy (no idle timeout in the way). ``fill``: write until the socket is full and
    a little is left over (less than the high-water mark: the application is not paused);
    ``close``: then close. ``boom``: the application fails."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.made = 0
        self.lost = 0
        self.full = False

    def listen_phase(self) -> tuple[bool, object]:
        return True, 0

    def listen_body(self) -> float | None:
        return None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.made += 1

    def data_received(self, data: bytes) -> None:
        if b"boom" in data:
            raise RuntimeError("the application failed")
        if b"fill" in data:
            asyncio.get_running_loop().create_task(self._fill(close=b"close" in data))

    async def _fill(self, close: bool) -> None:
        transport = self.transport
        assert transport is not None
        chunk = os.urandom(16_384)
        while transport.get_write_buffer_size() == 0 and not transport.is_closing():
            transport.write(chunk)
            for _ in range(3):
                await asyncio.sleep(0)
        self.full = True
        if close:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost += 1


class Service:
    def __init__(self) -> None:
        self.apps: list[App] = []
        self.servers: list[asyncio.Server] = []

    def configure(self, **_: object) -> None:
        pass

    def protocol(self, report: Callable[[str], None] | None) -> asyncio.Protocol:
        app = App()
        self.apps.append(app)
        return app

    def serving(self, server: asyncio.Server) -> None:
        self.servers.append(server)


def server_context(ca: trustme.CA, client_auth: bool = False) -> ssl.SSLContext:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(tls)
    if client_auth:
        ca.configure_trust(tls)
        tls.verify_mode = ssl.CERT_REQUIRED
    return tls


@asynccontextmanager
async def served(
    ca: trustme.CA, limits: ListenLimits = SHORT, tls: ssl.SSLContext | None = None
) -> AsyncIterator[tuple[Service, Listener, list[CloseReason]]]:
    service = Service()
    seen: list[CloseReason] = []
    lst = await start_h2(
        service,
        "127.0.0.1",
        0,
        ssl=tls or server_context(ca),
        limits=limits,
        on_refused=lambda _, r: seen.append(r),
    )
    try:
        yield service, lst, seen
    finally:
        for app in service.apps:
            if app.transport is not None:
                app.transport.abort()
        for server in service.servers:
            server.close()
            await server.wait_closed()
        await asyncio.sleep(0.01)


def client_context(ca: trustme.CA, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if cert:
        ca.issue_cert("client.example").configure_cert(ctx)
    return ctx


def small_socket(port: int) -> socket.socket:
    """A blocking client socket with a tiny receive buffer: the server's fills at once."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(("127.0.0.1", port))
    return raw


async def tls_client(ca: trustme.CA, port: int, cert: bool = False) -> ssl.SSLSocket:
    """A blocking TLS client on a small socket, its handshake done in a thread (the server
    runs on this loop)."""

    def connect() -> ssl.SSLSocket:
        raw = small_socket(port)
        return client_context(ca, cert).wrap_socket(raw, server_hostname="localhost")

    return await asyncio.get_running_loop().run_in_executor(None, connect)


def open_fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


async def in_thread(fn: Callable[[], object]) -> object:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


# -- findings ----------------------------------------------------------------------------------


async def test_a_close_that_cannot_drain_ends_within_the_shutdown_timeout(
    ca: trustme.CA,
) -> None:
    """The server closes (a refused node, a protocol error, shutdown) while the peer reads
    nothing and less than the high-water mark is left: the application is never paused, so
    the write timeout never starts. The TLS shutdown must be bounded (``handshake_timeout``,
    "also TLS shutdown", as asyncio's SSLProtocol has it), or a peer holds the slot, the
    SSL object and the backlog for ever."""
    async with served(ca) as (service, lst, seen):
        tls = await tls_client(ca, lst.port)
        try:
            tls.sendall(b"fill close")
            await until(lambda: bool(service.apps) and service.apps[0].full)
            app = service.apps[0]
            assert app.transport is not None and app.transport.is_closing()
            await until(lambda: app.lost == 1, within=SHORT.handshake_timeout + 3)
            assert lst.stats().open == 0
            assert seen == [CloseReason.WRITE_TIMEOUT]
        finally:
            tls.close()


async def test_a_half_close_from_a_peer_that_does_not_read_ends_within_the_shutdown_timeout(
    ca: trustme.CA,
) -> None:
    """Same hole from the peer's side: it fills the server's socket, then half-closes (the
    server answers EOF with ``close``) and never reads."""
    async with served(ca) as (service, lst, seen):
        tls = await tls_client(ca, lst.port)
        try:
            tls.sendall(b"fill")
            await until(lambda: bool(service.apps) and service.apps[0].full)
            tls.shutdown(socket.SHUT_WR)  # TCP FIN, no close_notify
            app = service.apps[0]
            await until(lambda: app.transport is not None and app.transport.is_closing())
            await until(lambda: app.lost == 1, within=SHORT.handshake_timeout + 3)
            assert lst.stats().open == 0
            assert seen == [CloseReason.WRITE_TIMEOUT]
        finally:
            tls.close()


async def test_an_exception_in_the_application_closes_and_releases_the_connection(
    ca: trustme.CA,
) -> None:
    """asyncio's transports end a connection whose protocol raised (``_fatal_error``); here
    the exception left the reader callback, the connection stayed open in whatever state the
    application was left in, its slot held."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        async with served(ca) as (service, lst, _seen):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", lst.port, ssl=client_context(ca), server_hostname="localhost"
            )
            writer.write(b"boom")
            await until(lambda: bool(errors))
            app = service.apps[0]
            await until(lambda: app.lost == 1, within=3)
            assert lst.stats().open == 0
            async with asyncio.timeout(3):
                assert await reader.read() == b""  # the server ended it
            writer.close()
            assert app.lost == 1
    finally:
        loop.set_exception_handler(None)
    assert isinstance(errors[0].get("exception"), RuntimeError)


class _NoSeam(ssl.SSLContext):
    _wrap_socket = None  # a Python whose private seam is missing (or renamed)


async def test_start_h2_fails_at_start_without_the_cpython_seam(ca: trustme.CA) -> None:
    """Without ``SSLContext._wrap_socket`` every connection raised in its reader callback
    (and spun on it until the handshake timeout): the port looked up and served nobody."""
    tls = _NoSeam(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(tls)
    with pytest.raises(RuntimeError, match="_wrap_socket"):
        await start_h2(Service(), "127.0.0.1", 0, ssl=tls, limits=SHORT)


class _ClientSide(ssl.SSLContext):
    """A seam whose arguments changed meaning: the connection it makes is client-side."""

    def _wrap_socket(self, sock: socket.socket, server_side: bool, *args: object) -> object:
        return super()._wrap_socket(sock, False, None)  # type: ignore[misc]


async def test_start_h2_fails_at_start_when_the_seam_makes_no_server_connection(
    ca: trustme.CA,
) -> None:
    tls = _ClientSide(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(tls)
    with pytest.raises(RuntimeError, match="_wrap_socket"):
        await start_h2(Service(), "127.0.0.1", 0, ssl=tls, limits=SHORT)


def _leaf_der(serial: int = 12_345) -> bytes:
    uri = x509.UniformResourceIdentifier("spiffe://attestmesh.local/ns/default/sa/a")
    return _cert([uri], serial).public_bytes(serialization.Encoding.DER)


def test_a_certificate_openssl_accepts_and_cryptography_refuses_has_no_identity() -> None:
    """An X.509 v2 certificate (OpenSSL verifies it; Python 3.11's default context is not
    X509_STRICT): cryptography raises InvalidVersion, not ValueError, and identity_of let it
    escape into the HTTP/2 layer's data_received (and the reader callback)."""
    der = _leaf_der()
    v3 = b"\xa0\x03\x02\x01\x02"
    assert v3 in der
    v2 = der.replace(v3, b"\xa0\x03\x02\x01\x01", 1)
    assert identity_of(v2) == PeerIdentity((), None)


def test_identity_of_never_raises_on_a_damaged_certificate() -> None:
    der = _leaf_der()
    rng = random.Random(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CryptographyDeprecationWarning)  # a non-positive serial
        for _ in range(5_000):
            damaged = bytearray(der)
            for _ in range(rng.randint(1, 3)):
                damaged[rng.randrange(len(damaged))] = rng.randrange(256)
            assert isinstance(identity_of(bytes(damaged)), PeerIdentity)


# -- checked and found sound -------------------------------------------------------------------


async def test_a_client_without_a_certificate_never_reaches_the_application(
    ca: trustme.CA,
) -> None:
    async with served(ca, tls=server_context(ca, client_auth=True)) as (service, lst, _):

        def attempt() -> bytes:
            raw = small_socket(lst.port)
            with client_context(ca).wrap_socket(raw, server_hostname="localhost") as tls:
                tls.settimeout(3)
                try:
                    tls.sendall(b"fill")  # TLS 1.3: the client is done before the server
                    return tls.recv(10)
                except (ssl.SSLError, OSError):
                    return b""

        assert await in_thread(attempt) == b""
        await until(lambda: lst.stats().open == 0)
        assert not service.apps or all(app.made == 0 for app in service.apps)
        # with a certificate the same client gets through
        tls = await tls_client(ca, lst.port, cert=True)
        await until(lambda: any(app.made for app in service.apps))
        tls.close()


async def test_a_dripped_handshake_is_cut_by_the_handshake_timeout(ca: trustme.CA) -> None:
    async with served(ca) as (service, lst, seen):
        hello = bytearray()
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = client_context(ca).wrap_bio(incoming, outgoing, server_hostname="localhost")
        with pytest.raises(ssl.SSLWantReadError):
            obj.do_handshake()
        hello += outgoing.read()
        reader, writer = await asyncio.open_connection("127.0.0.1", lst.port)
        started = time.monotonic()
        for byte in hello[:-1]:  # never complete
            writer.write(bytes([byte]))
            await asyncio.sleep(0.05)
            if writer.transport.is_closing() or reader.at_eof():
                break
            if time.monotonic() - started > SHORT.handshake_timeout + 2:
                break
        await until(lambda: lst.stats().open == 0, within=SHORT.handshake_timeout + 2)
        assert seen == [CloseReason.HANDSHAKE_TIMEOUT]
        assert all(app.made == 0 for app in service.apps)
        writer.close()


async def test_every_path_closes_both_descriptors_and_reports_lost_once(ca: trustme.CA) -> None:
    """Silent TCP (handshake timeout), garbage instead of a ClientHello, a reset in the middle
    of the handshake, a peer that drops an established connection, the server closing one,
    the server aborting one: the descriptor count comes back, and every application that
    saw ``connection_made`` saw ``connection_lost`` exactly once."""
    async with served(ca) as (service, lst, _):
        await asyncio.sleep(0.05)
        before = open_fds()
        silent = socket.create_connection(("127.0.0.1", lst.port))
        garbage = socket.create_connection(("127.0.0.1", lst.port))
        garbage.sendall(b"\x16\x03\x01\x00\x05hello" * 10)
        reset = socket.create_connection(("127.0.0.1", lst.port))
        reset.sendall(b"\x16\x03\x01\x02\x00\x01")  # part of a ClientHello
        await asyncio.sleep(0.1)
        reset.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        reset.close()
        ctx = client_context(ca)
        streams = []
        for _ in range(3):
            streams.append(
                await asyncio.open_connection(
                    "127.0.0.1", lst.port, ssl=ctx, server_hostname="localhost"
                )
            )
        await until(lambda: sum(a.made for a in service.apps) == 3)
        made = [a for a in service.apps if a.made]
        streams[0][1].transport.abort()  # the peer drops it
        transports = [a.transport for a in made]
        # which application is which stream does not matter: one dropped by the peer, the
        # others closed and aborted by the server (whichever two are still open)
        await until(lambda: sum(1 for a in made if a.lost) == 1)
        still = [t for a, t in zip(made, transports, strict=True) if not a.lost]
        assert len(still) == 2 and all(t is not None for t in still)
        still[0].close()  # type: ignore[union-attr]  # the server closes one
        still[1].abort()  # type: ignore[union-attr]  # and aborts the other
        await until(lambda: all(a.lost for a in made))
        await until(lambda: lst.stats().open == 0, within=SHORT.handshake_timeout + 3)
        for s in (silent, garbage):
            s.close()
        for _, writer in streams[1:]:
            writer.close()
        await asyncio.sleep(0.1)
        assert open_fds() == before
        assert [a.lost for a in made] == [1, 1, 1]
        assert all(a.lost == 0 for a in service.apps if not a.made)


def _ssl_pointer(tls: ssl.SSLSocket) -> int | None:
    """The SSL* of CPython's _ssl._SSLSocket (after PyObject_HEAD and the socket's weakref)."""
    inner = tls._sslobj  # type: ignore[attr-defined]
    value = ctypes.c_void_p.from_address(id(inner) + 3 * ctypes.sizeof(ctypes.c_void_p)).value
    return value


async def test_a_key_update_while_the_server_socket_is_full_does_not_spin(
    ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TLS 1.3 KeyUpdate(update_requested) obliges the server to write while its socket is
    full: if OpenSSL answered it inside SSL_read, the read would want to write and a level-
    triggered reader would spin. OpenSSL 3 queues the answer for the next write: no spin."""
    name = ctypes.util.find_library("ssl")
    if name is None:
        pytest.skip("no libssl to call SSL_key_update with")
    libssl = ctypes.CDLL(name)
    libssl.SSL_key_update.argtypes = [ctypes.c_void_p, ctypes.c_int]
    libssl.SSL_version.argtypes = [ctypes.c_void_p]
    calls = 0
    original = listen._SocketTLS._read_ready

    def counted(self: listen._SocketTLS) -> None:
        nonlocal calls
        calls += 1
        original(self)

    monkeypatch.setattr(listen._SocketTLS, "_read_ready", counted)
    limits = ListenLimits(write_timeout=30, idle_timeout=30, body_timeout=30, header_timeout=30)
    async with served(ca, limits) as (service, lst, _):
        tls = await tls_client(ca, lst.port)
        try:
            pointer = _ssl_pointer(tls)
            if pointer is None or libssl.SSL_version(pointer) != 0x0304:
                pytest.skip("cannot reach this CPython's SSL object")
            tls.sendall(b"fill")
            await until(lambda: bool(service.apps) and service.apps[0].full)
            assert libssl.SSL_key_update(pointer, 1) == 1
            tls.sendall(b"x")  # sends the KeyUpdate, then a record to read
            await asyncio.sleep(0.3)
            tls.sendall(b"y")
            before = calls
            await asyncio.sleep(1.0)
            assert calls - before < 20  # a spin makes tens of thousands
            assert service.apps[0].lost == 0
        finally:
            threading.Thread(target=tls.close).start()


class _Failing(Service):
    def protocol(self, report: Callable[[str], None] | None) -> asyncio.Protocol:
        raise RuntimeError("the application cannot be made")


async def test_an_application_that_cannot_be_made_leaves_no_descriptor(ca: trustme.CA) -> None:
    """``_to_socket_tls`` dups the accepted socket before the application is made: when that
    fails, both descriptors must be closed then (not by the garbage collector, with a
    ResourceWarning, whenever the exception's traceback is dropped)."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    service = _Failing()
    lst = await start_h2(service, "127.0.0.1", 0, ssl=server_context(ca), limits=SHORT)
    try:
        await asyncio.sleep(0.05)
        before = open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            client = socket.create_connection(("127.0.0.1", lst.port))
            await until(lambda: bool(errors))
            await asyncio.sleep(0.05)
            assert open_fds() == before + 1  # the client's own
            errors.clear()  # the traceback (and the frame holding the dup) goes here
            gc.collect()
        client.close()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert lst.stats().open == 0
    finally:
        loop.set_exception_handler(None)
        for server in service.servers:
            server.close()
            await server.wait_closed()


async def test_a_handshake_finished_after_the_server_closed_is_not_served(ca: trustme.CA) -> None:
    """A TCP connection accepted before the service closed its server, its TLS handshake done
    after: it must not reach the application (a stream opened on a closing control plane),
    and its descriptor must not wait for the garbage collector when the loop ends."""
    async with served(ca) as (service, lst, _):
        raw = socket.create_connection(("127.0.0.1", lst.port))
        await until(lambda: lst.stats().open == 1)
        for server in service.servers:
            server.close()
            await server.wait_closed()

        def handshake() -> bool:
            try:
                with client_context(ca).wrap_socket(raw, server_hostname="localhost") as tls:
                    tls.settimeout(3)
                    tls.sendall(b"hello")
                    return tls.recv(10) != b""
            except (ssl.SSLError, OSError):
                return False

        await in_thread(handshake)
        await until(lambda: lst.stats().open == 0, within=3)
        assert all(app.made == 0 for app in service.apps)
