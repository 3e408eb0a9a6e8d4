"""Hardened listening sockets: every port is hostile until it has authenticated.

One frozen ``ListenLimits`` configures every listener (attestation API, xDS, ops, webhook):

- admission at accept, before any TLS byte: a cap on open connections per listener and per
  source address (an IPv6 source counts by its /64), and a rate of new connections per source
  (a token bucket); an excess connection is closed at once and reported to ``on_refused``;
- TLS: a handshake timeout; TLS on the socket itself for the aiohttp sites and ``start_h2``
  (``_SocketTLS``, below), and for grpclib's listener a small per-connection read buffer
  (asyncio's SSLProtocol allocates 256 KiB per connection; see ``_LeanSSLProtocol``);
- HTTP/1.1 (aiohttp): idle timeout (no request in flight: keep-alive, or a TLS connection that
  never sends), header timeout (first byte of a request to its complete header) and body timeout
  (complete header to complete body: a dripped body);
- HTTP/2 (xDS: our own ``xds.adsconn`` via ``start_h2``, or grpclib via ``start_grpc``):
  SETTINGS_MAX_CONCURRENT_STREAMS, a bounded header list and small flow control windows
  advertised in the first SETTINGS frame, and an idle timeout for a connection that has no
  open stream. ``start_h2`` counts what the HTTP/2 layer refuses (``protocol_error``,
  ``flood``, ``invalid_request``, ``header_timeout``).

``_SocketTLS`` (aiohttp sites with TLS, ``start_h2``): OpenSSL reads and writes the descriptor;
no read buffer, memory BIO or write backlog kept per idle connection, and no asyncio
SSLProtocol in Python between the socket and the application (for the attestation API, ~15%
less CPU per attestation than asyncio's TLS, bench_issuance at 8 and 64 clients). Its
``ssl_object`` is the C ``_ssl._SSLSocket``: ``getpeercert(True)``, positional.

Connections closed by a timeout are reported to ``on_refused`` too, with the timeout as the
reason. This module imports no metrics library: the caller maps reasons to counters.

Seams on foreign internals, each checked by tests/component/test_listen.py (and
test_listen_socket_tls.py, test_listen_accept_garbage.py): CPython's
``SSLContext._wrap_socket`` (``_SocketTLS``), ``asyncio.Server._sockets`` (``_Acceptor``:
without it asyncio accepts and ``_Admission`` hands the socket over),
``asyncio.sslproto.SSLProtocol`` (Python 3.11-3.13: its constructor and ``max_size``), grpclib
0.4's ``Server`` (``_protocol_factory``, ``_server``, ``_server_closed_fut``) and ``H2Protocol``,
and aiohttp 3's ``RequestHandler`` state (request count, request in progress, current request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import enum
import errno
import ipaddress
import logging
import os
import socket
import ssl as _ssl
import sys
from asyncio import sslproto
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Protocol

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger(__name__)

__all__ = [
    "CloseReason",
    "ListenLimits",
    "Listener",
    "ListenerStats",
    "OnRefused",
    "Site",
    "connection_totals",
    "start_aiohttp",
    "start_grpc",
    "start_h2",
]


class CloseReason(enum.StrEnum):
    """Why a connection was refused or closed by the listener (a bounded metric label)."""

    MAX_CONNECTIONS = "max_connections"
    MAX_PER_SOURCE = "max_per_source"
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    HEADER_TIMEOUT = "header_timeout"
    BODY_TIMEOUT = "body_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    WRITE_TIMEOUT = "write_timeout"
    PROTOCOL_ERROR = "protocol_error"  # HTTP/2 connection error (bad preface, frame, window...)
    FLOOD = "flood"  # HTTP/2 control frames or refused streams without application data
    CONNECT_RATE = "connect_rate"  # a source opened connections faster than its rate allows
    INVALID_REQUEST = "invalid_request"  # a stream refused: not gRPC, bad message or timeout


OnRefused = Callable[[str, CloseReason], None]
"""``on_refused(listener_name, reason)``: called once per refused or timed-out connection."""


@dataclass(frozen=True, slots=True)
class ListenLimits:
    """Limits for one listening port. Times are seconds.

    Memory under attack is bounded by ``max_connections`` x the cost of one connection; one
    source (IPv4 address, IPv6 /64) holds at most ``max_connections_per_source``. Measured per
    connection in the real process (benchmarks/bench_connections.py, defaults): TCP to a TLS
    port with no byte ~2 KB, a stalled TLS handshake ~59 KB, a silent TLS connection ~34 KB, a
    partial header ~34 KB, a dripped body ~41 KB, an idle mTLS ADS stream ~38 KB (about 26 KB
    of it OpenSSL's: the SSL object and the client's parsed certificate chain).

    CPU under attack: a TLS handshake costs the server ~1 ms (OpenSSL 3.0, P-256), so one
    source opens at most ``connect_rate_per_source`` connections per second after a burst of
    ``connect_burst_per_source`` (a token bucket, refused before any TLS byte)."""

    handshake_timeout: float = 10.0  # accept -> TLS handshake complete (also TLS shutdown)
    header_timeout: float = 10.0  # first byte of a request -> its complete header
    body_timeout: float = 30.0  # complete header -> complete body
    idle_timeout: float = 60.0  # nothing in flight: keep-alive, silent TLS, HTTP/2 without stream
    write_timeout: float = 30.0  # the peer does not read what is sent (writing stays paused)
    max_connections: int = 20_000  # open connections on this listener (xDS: >= the mesh)
    max_connections_per_source: int = 1_024  # per source IPv4 address / IPv6 /64
    connect_rate_per_source: float = 256.0  # new connections per second per source, sustained
    connect_burst_per_source: int = 1_024  # ... and at once (a reconnecting node's Envoys)
    max_streams_per_connection: int = 16  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS
    max_header_list_size: int = 16_384  # HTTP/2 SETTINGS_MAX_HEADER_LIST_SIZE
    http2_window: int = 65_535  # HTTP/2 initial stream and connection receive windows
    tls_read_buffer: int = 4_096  # bytes read from the socket at once per TLS connection
    backlog: int = 1_024  # listen(2) backlog

    def __post_init__(self) -> None:
        problems = [f.name for f in fields(self) if not getattr(self, f.name) > 0]
        if self.http2_window < 65_535:
            problems.append("http2_window (at least 65535, the HTTP/2 minimum)")
        if self.tls_read_buffer < 1024:
            problems.append("tls_read_buffer (at least 1024)")
        if problems:
            raise ValueError(f"ListenLimits: must be positive/in range: {', '.join(problems)}")


@dataclass(frozen=True, slots=True)
class ListenerStats:
    open: int
    sources: int
    closed: dict[CloseReason, int]


class _Phase(enum.Enum):
    IDLE = enum.auto()  # nothing in flight
    HEADER = enum.auto()  # part of a request header received
    BODY = enum.auto()  # header complete, body not yet complete
    BUSY = enum.auto()  # the application is working (request complete, or a stream is open)


_PHASE_REASON = {
    _Phase.IDLE: CloseReason.IDLE_TIMEOUT,
    _Phase.HEADER: CloseReason.HEADER_TIMEOUT,
    _Phase.BODY: CloseReason.BODY_TIMEOUT,
}


class _Probe(Protocol):
    def __call__(self, app: Any, received: bool) -> tuple[_Phase, object]:
        """The application's phase, and a key that changes whenever a new phase begins."""
        ...


_SOURCES_KEPT = 4_096  # hosts whose bucket _source_key remembers (then it starts afresh)
_sources: dict[str, str] = {}


def _source_key(peer: object) -> str | None:
    """The per-source bucket: an IPv4 address, or an IPv6 /64 (one host holds a whole /64).
    Remembered per host string (parsing an address cost ~18 us at every accept; a mesh's
    connections come from a few hosts), so the connections of a source share one string."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    host = peer[0]
    key = _sources.get(host)
    if key is None:
        if len(_sources) >= _SOURCES_KEPT:
            _sources.clear()
        key = _sources[host] = _parse_source(host)
    return key


def _parse_source(host: str) -> str:
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class _Totals:
    """Connections admitted by every listener of this process: open now, closed ever."""

    open = 0
    closed = 0


_TOTALS = _Totals()


def connection_totals() -> tuple[int, int]:
    """(open now, ever closed) over every hardened listener of the process: how much
    connection churn there was (attestmesh.gcpolicy reclaims a closed connection's cycles)."""
    return _TOTALS.open, _TOTALS.closed


_BUCKETS_PRUNE_AT = 4_096  # per-source connection-rate buckets before full ones are dropped


class _Listener:
    """Admission and accounting for one listening port."""

    def __init__(
        self,
        name: str,
        limits: ListenLimits,
        tls: _ssl.SSLContext | None,
        app_factory: Callable[[], asyncio.Protocol],
        probe: _Probe,
        on_refused: OnRefused | None,
    ) -> None:
        self.name = name
        self.limits = limits
        self.tls = tls
        self.app_factory = app_factory
        self.probe = probe
        self.on_refused = on_refused
        self.loop = asyncio.get_running_loop()
        self.socket_tls = False  # TLS by _SocketTLS (start_h2) instead of asyncio's SSLProtocol
        # start_h2's server: a TLS handshake that ends after it closed is not served
        self.server: asyncio.Server | None = None
        self.open = 0
        self.per_source: dict[str, int] = {}
        self.closed: dict[CloseReason, int] = {}
        self.clock = self.loop.time
        # source -> (tokens, when): a source absent has a full bucket; entries are pruned
        # (full ones carry nothing) once they outnumber _BUCKETS_PRUNE_AT
        self.buckets: dict[str, tuple[float, float]] = {}
        self._prune_at = _BUCKETS_PRUNE_AT

    def report(self, reason: CloseReason) -> None:
        self.closed[reason] = self.closed.get(reason, 0) + 1
        if self.on_refused is not None:
            try:
                self.on_refused(self.name, reason)
            except Exception:  # a metrics callback must not break the accept path
                log.exception("on_refused callback failed")

    def admit(self, source: str | None) -> CloseReason | None:
        if self.open >= self.limits.max_connections:
            return CloseReason.MAX_CONNECTIONS
        if source is not None:
            n = self.per_source.get(source, 0)
            if n >= self.limits.max_connections_per_source:
                return CloseReason.MAX_PER_SOURCE
            if not self._take_token(source):
                return CloseReason.CONNECT_RATE
            self.per_source[source] = n + 1
        self.open += 1
        _TOTALS.open += 1
        return None

    def _take_token(self, source: str) -> bool:
        limits, now = self.limits, self.clock()
        rate, burst = limits.connect_rate_per_source, float(limits.connect_burst_per_source)
        held = self.buckets.get(source)
        tokens = burst if held is None else min(burst, held[0] + (now - held[1]) * rate)
        if tokens < 1.0:
            return False
        self.buckets[source] = (tokens - 1.0, now)
        if len(self.buckets) > self._prune_at:
            self._prune(now, rate, burst)
        return True

    def _prune(self, now: float, rate: float, burst: float) -> None:
        """Drop the buckets that have filled up again (as good as absent). What is left are
        sources that connected within the last ``burst / rate`` seconds; the next pruning
        waits until the table has doubled from that."""
        self.buckets = {
            s: (t, at) for s, (t, at) in self.buckets.items() if t + (now - at) * rate < burst
        }
        self._prune_at = max(_BUCKETS_PRUNE_AT, 2 * len(self.buckets))

    def release(self, source: str | None) -> None:
        self.open -= 1
        _TOTALS.open -= 1
        _TOTALS.closed += 1
        if source is not None:
            n = self.per_source[source] - 1
            if n:
                self.per_source[source] = n
            else:
                del self.per_source[source]

    def stats(self) -> ListenerStats:
        return ListenerStats(self.open, len(self.per_source), dict(self.closed))

    def __call__(self) -> asyncio.Protocol:
        return _Admission(self)


class _Admission(asyncio.Protocol):
    """The first protocol of every accepted socket: admits it (or closes it) before anything
    is allocated for it. Plain TCP goes straight to the guarded application; TLS waits here,
    cheaply, for the client's first byte (a silent socket costs no TLS state), then goes to
    ``_LeanSSLProtocol`` with what is left of the handshake timeout."""

    __slots__ = ("_listener", "_source", "_started", "_timer", "_transport")

    def __init__(self, listener: _Listener) -> None:
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._source: str | None = None
        self._started = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        lst = self._listener
        assert isinstance(transport, asyncio.Transport)
        source = _source_key(transport.get_extra_info("peername"))
        refused = lst.admit(source)
        if refused is not None:
            _discard(transport)
            lst.report(refused)
            return
        if lst.tls is not None and lst.socket_tls:
            self._to_socket_tls(transport, source)
            return
        if lst.tls is not None:
            self._transport = transport
            self._source = source
            self._started = lst.loop.time()
            self._timer = lst.loop.call_at(
                self._started + lst.limits.handshake_timeout, self._expire
            )
            return
        try:
            guard = _Guard(lst, lst.app_factory())
        except BaseException:
            lst.release(source)
            transport.abort()
            raise
        guard.source = source
        guard.owner = True
        transport.set_protocol(guard)
        guard.connection_made(transport)

    def _to_socket_tls(self, transport: asyncio.Transport, source: str | None) -> None:
        """``start_h2`` on an asyncio without the ``_Acceptor`` seam: the socket leaves
        asyncio's transport (which has read nothing yet) for ``_SocketTLS``, where OpenSSL
        reads and writes it directly."""
        lst = self._listener
        sock: socket.socket | None = None
        try:
            guard = _Guard(lst, lst.app_factory())  # before the dup: a failure leaves no fd
            raw = transport.get_extra_info("socket")
            fd = os.dup(raw.fileno())
            try:
                sock = socket.socket(raw.family, raw.type, raw.proto, fd)
            except BaseException:
                os.close(fd)
                raise
            sock.setblocking(False)
            tls = _SocketTLS(guard, lst, source, sock)
        except BaseException:
            if sock is not None:
                sock.close()  # now, not when the exception's traceback is dropped
            lst.release(source)
            raise
        finally:
            _discard(transport)  # closes asyncio's descriptor; this protocol ignores the loss
        del tls  # the event loop holds it (reader callback, handshake timer)

    def data_received(self, data: bytes) -> None:
        transport, lst = self._transport, self._listener
        if transport is None:
            return
        self._transport = None  # the slot passes to the TLS protocol
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        left = max(self._started + lst.limits.handshake_timeout - lst.loop.time(), 0.001)
        try:
            guard = _Guard(lst, lst.app_factory())
            tls = _LeanSSLProtocol(lst.loop, guard, lst, self._source, left)
        except BaseException:
            lst.release(self._source)
            transport.abort()
            raise
        transport.set_protocol(tls)
        tls.connection_made(transport)
        view = memoryview(data)
        while view and not transport.is_closing():
            buf = tls.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            view = view[n:]
            tls.buffer_updated(n)

    def eof_received(self) -> bool:
        return False

    def _expire(self) -> None:
        self._timer = None
        if self._transport is not None:
            _discard(self._transport)  # connection_lost reports and releases

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return  # refused, or handed over
        self._transport = None
        lst = self._listener
        lst.release(self._source)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        else:
            lst.report(CloseReason.HANDSHAKE_TIMEOUT)


def _discard(transport: asyncio.Transport) -> None:
    """Abort an asyncio socket transport ``_Admission`` is done with (refused, handed over to
    ``_SocketTLS``, or silent past the handshake timeout) so that reference counting frees it.
    CPython's ``_SelectorSocketTransport`` keeps a bound method of itself (``_read_ready_cb``):
    a cycle only the cycle collector frees, and the control plane's GC policy freezes what
    survives its tick (``attestmesh.gcpolicy``), so each accepted connection left its aborted
    transport, the original socket object and their dicts (~0.6 KB) behind for good. The
    attribute is dropped once asyncio's own ``connection_lost`` call, queued by ``abort``
    before ours, has run; a Python without it loses nothing but the saving."""
    transport.abort()
    asyncio.get_running_loop().call_soon(_break_cycle, transport)


def _break_cycle(transport: asyncio.Transport) -> None:
    attrs = getattr(transport, "__dict__", None)
    if attrs is not None:
        attrs.pop("_read_ready_cb", None)


# -- TLS ---------------------------------------------------------------------------------------

# asyncio.sslproto.SSLProtocol reads max_size (a class attribute, 256 KiB) in __init__ to size
# the per-connection buffer it reads the socket into, in get_buffer, and as the chunk size of
# its copying read path. Shadowing it per instance before __init__ shrinks the buffer for this
# listener's connections only. Checked on the versions whose sslproto.py has that shape.
_LEAN_TLS = sys.version_info[:2] in ((3, 11), (3, 12), (3, 13)) and isinstance(
    vars(sslproto.SSLProtocol).get("max_size"), int
)


class _LeanSSLProtocol(sslproto.SSLProtocol):
    """asyncio's server-side TLS protocol with a small read buffer and slot accounting."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        guard: _Guard,
        listener: _Listener,
        source: str | None,
        handshake_timeout: float,
    ) -> None:
        limits = listener.limits
        assert listener.tls is not None
        if _LEAN_TLS:
            self.max_size = limits.tls_read_buffer  # type: ignore[misc]  # see _LEAN_TLS
        super().__init__(
            loop,
            guard,
            listener.tls,
            None,  # type: ignore[arg-type]  # no waiter: nobody awaits a server handshake
            server_side=True,
            ssl_handshake_timeout=handshake_timeout,  # type: ignore[arg-type]
            ssl_shutdown_timeout=limits.handshake_timeout,
        )
        self._am_listener = listener
        self._am_source = source
        self._am_deadline = loop.time() + handshake_timeout
        self._am_guard = guard

    def connection_lost(self, exc: BaseException | None) -> None:
        try:
            super().connection_lost(exc)
        finally:
            lst = self._am_listener
            lst.release(self._am_source)
            if not self._am_guard.established and lst.loop.time() >= self._am_deadline - 0.01:
                lst.report(CloseReason.HANDSHAKE_TIMEOUT)


class _TLSConnection(Protocol):
    """What ``SSLContext._wrap_socket`` returns (CPython's ``_ssl._SSLSocket``): OpenSSL's
    connection on a socket, without ``ssl.SSLSocket``'s Python object around it."""

    def do_handshake(self) -> None: ...

    def read(self, size: int, /) -> bytes: ...

    def write(self, data: bytes, /) -> int: ...

    def getpeercert(self, binary_form: bool = False, /) -> Any: ...

    def cipher(self) -> tuple[str, str, int] | None: ...

    def shutdown(self) -> object: ...

    def pending(self) -> int: ...


def _check_seam(ctx: _ssl.SSLContext) -> None:
    """``start_h2`` refuses to start unless ``ctx._wrap_socket`` makes a server-side
    connection (a Python whose private seam is missing or changed would otherwise look up
    and serve nobody)."""
    a, b = socket.socketpair()
    try:
        ok = getattr(_server_connection(ctx, a), "server_side", None) is True
    except Exception:
        ok = False
    finally:
        a.close()
        b.close()
    if not ok:
        raise RuntimeError(
            "unsupported Python: SSLContext._wrap_socket does not make a server-side TLS "
            "connection (attestmesh.listen.start_h2 needs it)"
        )


def _server_connection(ctx: _ssl.SSLContext, sock: socket.socket) -> _TLSConnection:
    """A server-side TLS connection on ``sock`` (non-blocking: the calls raise SSLWantRead/
    WriteError). CPython's ``SSLContext._wrap_socket`` (3.7+; what ``ssl.SSLSocket`` is made
    of) keeps a weak reference to ``sock``: the caller holds it. ``ssl.SSLSocket`` would add a
    Python object with a ``__dict__`` (~1 KB per connection) and five system calls."""
    wrap = ctx._wrap_socket  # type: ignore[attr-defined]  # checked by tests/component/test_listen.py
    return wrap(sock, True, None)  # type: ignore[no-any-return]


_NO_EXTRA: Mapping[str, Any] = MappingProxyType({})  # every _SocketTLS's (unused) _extra
_TLS_CHUNK = 16_384  # plaintext given to one SSL_write: what a retry after EAGAIN repeats
_READ_BUDGET = 262_144  # plaintext read in one readiness callback before yielding to the loop


class _SocketTLS(asyncio.Transport):
    """Server-side TLS on the socket itself (``start_h2``): OpenSSL reads and writes the file
    descriptor (a socket BIO), driven by the event loop's readiness callbacks. Per idle
    connection it holds the ``SSLSocket`` and nothing else of size: no asyncio socket
    transport, no memory BIOs (which keep the capacity of the largest flight or write they
    ever held), OpenSSL's record buffers released when empty (CPython sets
    SSL_MODE_RELEASE_BUFFERS), a plaintext backlog only while the peer does not read, and
    the peer certificate parsed when asked for. A silent socket costs no TLS state: the
    ``SSLSocket`` is made on its first readable event. Writes are sent together once the
    callbacks due have run (an answer to a read and the pushes it woke: one system call).
    Flow control: the application is paused above ``high`` bytes of backlog and resumed
    below ``low``."""

    __slots__ = (
        "_app",
        "_backlog",
        "_backlog_size",
        "_closing",
        "_corked",
        "_deadline",
        "_fd",
        "_high",
        "_listener",
        "_lost",
        "_low",
        "_paused",
        "_reading",
        "_ready",
        "_scheduled",
        "_sock",
        "_source",
        "_ssl",
        "_timer",
        "_writing",
    )

    def __init__(
        self,
        app: _Guard,
        listener: _Listener,
        source: str | None,
        sock: socket.socket,
    ) -> None:
        super().__init__(_NO_EXTRA)  # get_extra_info answers from the connection itself
        loop = listener.loop
        self._app = app
        self._listener = listener
        self._source = source
        self._sock: socket.socket | None = sock
        self._ssl: _TLSConnection | None = None
        self._fd = sock.fileno()
        self._deadline = loop.time() + listener.limits.handshake_timeout
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._deadline, self._expire)
        self._ready = False
        self._closing = False
        self._lost = False
        self._scheduled = False  # _flush_soon is due
        self._corked = False  # a read is being handled: its answers go out together after it
        self._paused = False  # the application was told to pause writing
        self._reading = True
        self._writing = False  # a writer callback is registered (backlog pending)
        self._backlog: list[bytes] = []
        self._backlog_size = 0
        self._high = 65_536
        self._low = 16_384
        loop.add_reader(self._fd, self._read_ready)

    # -- the event loop's side -------------------------------------------------------------

    def _expire(self) -> None:
        self._timer = None
        if not self._ready:
            self._abort(None)  # connection_lost reports the handshake timeout

    def _read_ready(self) -> None:
        tls = self._ssl
        if tls is None:
            sock, ctx = self._sock, self._listener.tls
            if sock is None or ctx is None:
                return
            try:
                tls = self._ssl = _server_connection(ctx, sock)
            except (_ssl.SSLError, OSError) as exc:
                log.debug("TLS setup failed: %s", exc)
                self._abort(exc)
                return
        if not self._ready:
            try:
                tls.do_handshake()
            except _ssl.SSLWantReadError:
                return
            except _ssl.SSLWantWriteError:
                self._await_writable()  # the socket cannot take the server's flight yet
                return
            except (_ssl.SSLError, OSError) as exc:
                log.debug("TLS handshake failed: %s", exc)
                self._abort(exc)
                return
            server = self._listener.server
            if server is not None and not server.sockets:  # closed (it never "serves")
                self._abort(None)  # accepted before the server closed: not served after
                return
            self._ready = True
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._corked = True  # until the read that completed the handshake is handled
            try:
                self._app.connection_made(self)
            except Exception as exc:
                self._corked = False
                self._app_failed(exc, "connection_made")
                return
            except BaseException:
                self._uncork()
                raise
        try:
            eof = self._read_app_data(tls)
        finally:
            self._uncork()
        if eof:
            self.close()

    def _read_app_data(self, tls: _TLSConnection) -> bool:
        """Read what is there and hand it to the application (corked); True at EOF."""
        if self._lost:
            return False  # aborted meanwhile: the socket is closed
        chunks: list[bytes] = []
        got = 0
        eof = False
        while got < _READ_BUDGET:
            try:
                chunk = tls.read(65_536)
            except _ssl.SSLWantReadError:
                break
            except _ssl.SSLWantWriteError:
                break  # a post-handshake message waits for the socket: reading resumes
            except _ssl.SSLEOFError:
                eof = True  # the TCP connection ended without close_notify
                break
            except (_ssl.SSLError, OSError) as exc:
                log.debug("TLS read failed: %s", exc)
                self._abort(exc)
                return False
            if not chunk:
                eof = True  # close_notify, or the TCP connection ended
                break
            chunks.append(chunk)
            got += len(chunk)
            if len(chunk) < _TLS_CHUNK and not tls.pending():
                # a record short of full size: most likely all there was, and asking again
                # costs a recv failing with EAGAIN and an SSLWantReadError (an ACK is one
                # short record); anything more keeps the socket readable (level-triggered)
                # and is read on the loop's next turn. A full-size record reads on.
                break
        if chunks and not self._closing:
            self._corked = True
            try:
                self._app.data_received(chunks[0] if len(chunks) == 1 else b"".join(chunks))
            except Exception as exc:
                self._app_failed(exc, "data_received")
                return False
        return eof

    def _uncork(self) -> None:
        """A read is handled: what the application wrote meanwhile (the handshake's
        ``connection_made`` included) goes out together in a callback queued now, after
        those the read queued itself: a push the read woke (``xds.adsconn``'s pushes run in
        one callback queued as they are woken) writes first and, not corked, flushes at once
        with everything before it, so a new stream's SETTINGS go out with its first
        response (one record and system call less per new stream)."""
        self._corked = False
        if self._backlog and not self._scheduled and not self._writing and not self._lost:
            self._scheduled = True
            self._listener.loop.call_soon(self._flush_soon)

    def _await_writable(self) -> None:
        if not self._writing:
            self._writing = True
            self._listener.loop.add_writer(self._fd, self._handshake_writable)

    def _handshake_writable(self) -> None:
        self._writing = False
        self._listener.loop.remove_writer(self._fd)
        self._read_ready()

    def _app_failed(self, exc: Exception, what: str) -> None:
        """The application raised: reported as asyncio's transports do (``_fatal_error``),
        and the connection ends (its slot released, ``connection_lost`` once)."""
        self._listener.loop.call_exception_handler(
            {
                "message": f"Fatal error: protocol.{what}() call failed.",
                "exception": exc,
                "transport": self,
                "protocol": self._app,
            }
        )
        self._abort(exc)

    def _shutdown_expired(self) -> None:
        """``close`` could not send what was left within the shutdown timeout (the peer
        reads nothing, though too little is left to pause the application and start the
        write timeout): the peer holds the slot no longer."""
        self._timer = None
        if not self._lost:
            self._listener.report(CloseReason.WRITE_TIMEOUT)
            self._abort(None)

    def _write_ready(self) -> None:
        self._flush()
        if self._closing and not self._backlog:
            self._finish()

    def _flush(self) -> None:
        """Hand the backlog to OpenSSL (one record per chunk) until the socket is full."""
        tls, backlog = self._ssl, self._backlog
        if tls is None or self._lost:
            return
        sent = 0
        try:
            while backlog:
                head = backlog[0]
                tls.write(head)  # all of it, or an exception (no partial writes)
                backlog.pop(0)
                sent += len(head)
        except (_ssl.SSLWantWriteError, _ssl.SSLWantReadError):
            pass
        except (_ssl.SSLError, OSError) as exc:
            log.debug("TLS write failed: %s", exc)
            self._backlog_size = 0
            backlog.clear()
            self._abort(exc)
            return
        self._backlog_size -= sent
        loop = self._listener.loop
        if backlog and not self._writing:
            self._writing = True
            loop.add_writer(self._fd, self._write_ready)
        elif not backlog and self._writing:
            self._writing = False
            loop.remove_writer(self._fd)
        if self._paused and self._backlog_size <= self._low:
            self._paused = False
            self._app.resume_writing()
        elif not self._paused and self._backlog_size > self._high:
            self._paused = True
            self._app.pause_writing()

    def _flush_soon(self) -> None:
        """What was written since the last flush, in as few records (and system calls) as
        the chunk size allows: what the application wrote while it handled one read goes out
        together (a push made outside a read is flushed by ``write`` at once)."""
        self._scheduled = False
        backlog = self._backlog
        if self._writing or self._lost or not backlog:
            return
        if len(backlog) > 1:
            joined = b"".join(backlog)
            backlog[:] = [joined[i : i + _TLS_CHUNK] for i in range(0, len(joined), _TLS_CHUNK)]
        self._flush()
        if self._closing and not backlog:
            self._finish()

    def _abort(self, exc: BaseException | None) -> None:
        """Close at once (nothing more sent); ``connection_lost`` follows soon."""
        self._closing = True
        if self._lost:
            return
        self._lost = True
        loop = self._listener.loop
        if self._reading:
            self._reading = False
            loop.remove_reader(self._fd)
        if self._writing:
            self._writing = False
            loop.remove_writer(self._fd)
        self._backlog.clear()
        self._backlog_size = 0
        if self._sock is not None:
            self._sock.close()
        loop.call_soon(self._connection_lost, exc)

    def _finish(self) -> None:
        """A graceful close once the backlog is sent: close_notify (not waiting for the
        peer's), then the socket."""
        tls = self._ssl
        if tls is not None and self._ready and not self._lost:
            with contextlib.suppress(_ssl.SSLError, OSError, ValueError):
                tls.shutdown()
        self._abort(None)

    def _connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ssl = self._sock = None
        lst = self._listener
        try:
            if self._ready:
                self._app.connection_lost(exc if isinstance(exc, Exception) else None)
        finally:
            lst.release(self._source)
            if not self._ready and lst.loop.time() >= self._deadline - 0.01:
                lst.report(CloseReason.HANDSHAKE_TIMEOUT)

    # -- transport side (the application calls these) --------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing or self._ssl is None or not data:
            return
        backlog = self._backlog
        if len(data) <= _TLS_CHUNK:
            backlog.append(bytes(data))
        else:
            view = memoryview(data)
            backlog.extend(bytes(view[i : i + _TLS_CHUNK]) for i in range(0, len(view), _TLS_CHUNK))
        self._backlog_size += len(data)
        if self._writing:
            pass  # the socket is full: _write_ready sends it
        elif self._corked:
            pass  # a read is being handled: _uncork queues the flush once it is
        elif not self._paused:
            # a push (not an answer to a read): out now, not after the callbacks queued
            # meanwhile (a quarantined node's refusal must not wait behind the patch of
            # everyone else's configuration, which the publisher queues right after it)
            self._flush_soon()
        elif not self._scheduled:
            self._scheduled = True
            self._listener.loop.call_soon(self._flush_soon)
        if not self._paused and self._backlog_size > self._high:
            self._paused = True
            self._app.pause_writing()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def can_write_eof(self) -> bool:
        return False

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self._reading and not self._lost:
            self._reading = False
            self._listener.loop.remove_reader(self._fd)
        if not self._backlog:
            self._finish()
            return
        # _flush_soon or _write_ready finishes once the backlog is sent, within the shutdown
        # timeout (handshake_timeout, as asyncio's SSLProtocol bounds its shutdown)
        if self._timer is None and not self._lost:
            loop, limit = self._listener.loop, self._listener.limits.handshake_timeout
            self._timer = loop.call_later(limit, self._shutdown_expired)

    def abort(self) -> None:
        self._abort(None)

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        tls = self._ssl
        if name == "peercert":
            return tls.getpeercert() if tls is not None and self._ready else default
        if name == "ssl_object":
            return tls
        if name == "sslcontext":
            return self._listener.tls
        if name == "cipher":
            return tls.cipher() if tls is not None else default
        if name == "peername":  # asked for seldom (aiohttp's request.remote): not kept
            sock = self._sock
            try:
                return default if sock is None else sock.getpeername()
            except OSError:
                return default
        if name == "socket":
            return self._sock
        return default

    def get_write_buffer_size(self) -> int:
        return self._backlog_size

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = 65_536 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low

    def is_reading(self) -> bool:
        return self._reading

    def pause_reading(self) -> None:
        if self._reading and not self._lost:
            self._reading = False
            self._listener.loop.remove_reader(self._fd)

    def resume_reading(self) -> None:
        if not self._reading and not self._closing:
            self._reading = True
            self._listener.loop.add_reader(self._fd, self._read_ready)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._app

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        raise NotImplementedError("the application protocol of a TLS connection is fixed")


# -- timeouts ----------------------------------------------------------------------------------


class _Guard(asyncio.Protocol):
    """Sits between the transport (TCP or TLS) and the application protocol; closes the
    connection when its current phase (per ``probe``) outlasts that phase's timeout."""

    __slots__ = (
        "_app",
        "_deadline_at",
        "_key",
        "_listener",
        "_paused_at",
        "_since",
        "_timer",
        "_transport",
        "_watched",
        "established",
        "owner",
        "received",
        "source",
    )

    def __init__(self, listener: _Listener, app: asyncio.Protocol) -> None:
        self._listener = listener
        self._app = app
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline_at = 0.0
        self._key: object = None
        self._since = 0.0
        self._paused_at = -1.0  # when writing paused (the peer stopped reading); -1: not paused
        self.established = False  # connection_made reached the application
        self.owner = False  # plain TCP: this protocol holds the admission slot
        self.source: str | None = None
        self.received = False  # bytes arrived while the application waited for a request
        # the application says when its phase changes without input (``listen_watch``):
        # nothing polls it while it is busy
        self._watched = False

    @property
    def app(self) -> asyncio.Protocol:
        return self._app

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.established = True
        self._since = self._listener.loop.time()
        self._app.connection_made(transport)
        watch = getattr(self._app, "listen_watch", None)
        if callable(watch):
            watch(self._observe)
            self._watched = True
        self._observe()

    def data_received(self, data: bytes) -> None:
        self.received = True
        self._app.data_received(data)
        self._observe()

    def eof_received(self) -> bool | None:
        return self._app.eof_received()

    def pause_writing(self) -> None:
        self._paused_at = self._listener.loop.time()
        self._app.pause_writing()
        self._observe()

    def resume_writing(self) -> None:
        self._paused_at = -1.0
        self._app.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        try:
            self._app.connection_lost(exc)
        finally:
            if self.owner:
                self.owner = False
                self._listener.release(self.source)

    def _timeout(self, phase: _Phase) -> float | None:
        lim = self._listener.limits
        if phase is _Phase.IDLE:
            return lim.idle_timeout
        if phase is _Phase.HEADER:
            return lim.header_timeout
        if phase is _Phase.BODY:
            return lim.body_timeout
        return None

    def _observe(self) -> None:
        if self._transport is None:
            return
        lst = self._listener
        phase, key = lst.probe(self._app, self.received)
        if phase is _Phase.BODY or phase is _Phase.BUSY:
            self.received = False
        now = lst.loop.time()
        if key != self._key:
            self._key = key
            self._since = now
        lim = lst.limits
        if self._paused_at >= 0 and now >= self._paused_at + lim.write_timeout:
            self._close(None)
            return
        timeout = self._timeout(phase)
        if timeout is None and self._watched:
            # nothing to enforce while busy, and the application says when that ends (a
            # request arriving is input, observed anyway): no timer per connection and poll,
            # and none left armed from an earlier phase (a stream's whole life otherwise holds
            # the idle timer its connection armed before the stream opened)
            if self._paused_at < 0:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                return
            due = self._paused_at + lim.write_timeout
        elif timeout is None:
            # nothing to enforce now; look again later (a body may still be arriving)
            due = self._since + lim.body_timeout
            if due <= now:
                due = now + lim.body_timeout
        else:
            due = self._since + timeout
            if now >= due:
                self._close(phase)
                return
        if self._paused_at >= 0:
            due = min(due, self._paused_at + lim.write_timeout)
        if self._timer is None or due < self._deadline_at:
            if self._timer is not None:
                self._timer.cancel()
            self._deadline_at = due
            self._timer = lst.loop.call_at(due, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._observe()

    def _close(self, phase: _Phase | None) -> None:
        transport = self._transport
        if transport is None:
            return
        self._listener.report(CloseReason.WRITE_TIMEOUT if phase is None else _PHASE_REASON[phase])
        transport.abort()


# -- aiohttp -----------------------------------------------------------------------------------

_AIOHTTP_STATE = ("_request_count", "_request_in_progress", "_current_request", "_messages")
_AIOHTTP_OK = all(a in getattr(RequestHandler, "__slots__", ()) for a in _AIOHTTP_STATE)


def _http1_phase(app: Any, received: bool) -> tuple[_Phase, object]:
    """aiohttp's RequestHandler: waiting for a request (idle, or header under way), or
    handling one (body still arriving, or the application working)."""
    if not _AIOHTTP_OK:  # unknown aiohttp: only silence is enforced
        return (_Phase.HEADER if received else _Phase.IDLE), received
    count = app._request_count
    if app._request_in_progress:
        req = app._current_request
        if req is not None and not req.content.is_eof():
            return _Phase.BODY, count  # same key as BUSY: the body's clock started with it
        return _Phase.BUSY, count
    if app._messages:
        return _Phase.BUSY, count
    if received:
        return _Phase.HEADER, (count, True)
    return _Phase.IDLE, (count, False)


class Site(web.BaseSite):
    """An aiohttp site on a hardened listener; ``runner.cleanup()`` stops it as any site."""

    __slots__ = ("_host", "_limits", "_listener", "_name", "_on_refused", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        tls: _ssl.SSLContext | None,
        limits: ListenLimits,
        name: str,
        on_refused: OnRefused | None,
    ) -> None:
        super().__init__(runner, ssl_context=tls, backlog=limits.backlog)
        self._host = host
        self._port = port
        self._listener: _Listener | None = None
        self._limits = limits
        self._name = name
        self._on_refused = on_refused

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self.port}"

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        return _bound_port(self._server)

    def stats(self) -> ListenerStats:
        assert self._listener is not None
        return self._listener.stats()

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        lst = self._listener = _Listener(
            self._name, self._limits, self._ssl_context, server, _http1_phase, self._on_refused
        )
        self._server = srv = await _serve_socket_tls(lst, self._host, self._port)
        lst.server = srv


def _bound_port(server: asyncio.AbstractServer | None) -> int:
    sockets = getattr(server, "sockets", None) or ()
    return int(sockets[0].getsockname()[1]) if sockets else 0


async def start_aiohttp(
    runner: web.BaseRunner,
    host: str,
    port: int,
    *,
    ssl: _ssl.SSLContext | None,
    limits: ListenLimits,
    name: str,
    on_refused: OnRefused | None = None,
) -> Site:
    """Serve a set-up aiohttp runner on ``host:port`` with ``limits``; returns the started
    site (``site.port`` is the bound port). ``runner.cleanup()`` stops it."""
    site = Site(runner, host, port, ssl, limits, name, on_refused)
    await site.start()
    return site


# -- grpclib -----------------------------------------------------------------------------------


class _Slot(list[Any]):
    """What h2's Settings needs of the deque it keeps per setting (``[0]``, ``append``,
    ``popleft``, ``len``) at a tenth of the size: a deque is 600+ bytes, two Settings per
    connection hold 13 of them (~10 KB per HTTP/2 connection)."""

    __slots__ = ()

    def popleft(self) -> Any:
        return self.pop(0)


def _h2_protocol_class() -> type[Any]:
    from grpclib.protocol import Connection, EventsProcessor, H2Protocol
    from h2.connection import H2Connection
    from h2.settings import SettingCodes, Settings

    class LeanSettings(Settings):
        """h2's Settings, each setting's queue of values in a ``_Slot``."""

        def __init__(self, client: bool, initial_values: dict[Any, int] | None = None) -> None:
            super().__init__(client=client, initial_values=initial_values)
            self._settings = {k: _Slot(v) for k, v in self._settings.items()}  # type: ignore[misc]

        def __setitem__(self, key: Any, value: int) -> None:
            if key not in self._settings:
                self._settings[key] = _Slot([None])  # type: ignore[assignment]
            super().__setitem__(key, value)

    class LimitedH2Protocol(H2Protocol):
        """grpclib's server protocol whose first SETTINGS frame carries the limits (grpclib
        sends h2's defaults: 100 streams, 64 KiB header lists, then its 4 MiB windows)."""

        limits: ListenLimits

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            lim = self.limits
            h2_conn = H2Connection(config=self.h2_config)
            h2_conn.remote_settings = LeanSettings(client=True)
            h2_conn.local_settings = LeanSettings(
                client=False,
                initial_values={
                    SettingCodes.MAX_CONCURRENT_STREAMS: lim.max_streams_per_connection,
                    SettingCodes.MAX_HEADER_LIST_SIZE: lim.max_header_list_size,
                    SettingCodes.INITIAL_WINDOW_SIZE: lim.http2_window,
                },
            )
            h2_conn.decoder.max_header_list_size = lim.max_header_list_size
            h2_conn.initiate_connection()
            conn_delta = lim.http2_window - 65_535
            if conn_delta:
                h2_conn.increment_flow_control_window(conn_delta)
            assert isinstance(transport, asyncio.Transport)
            self.connection = Connection(h2_conn, transport, config=self.config)
            self.connection.flush()
            self.connection.initialize()
            self.processor = EventsProcessor(self.handler, self.connection)

    return LimitedH2Protocol


def _h2_phase(app: Any, received: bool) -> tuple[_Phase, object]:
    """An HTTP/2 connection is idle while it has no open stream."""
    connection = getattr(app, "connection", None)
    h2_conn = getattr(connection, "_connection", None)
    if h2_conn is None:  # before connection_made, or after close
        return _Phase.IDLE, None
    busy = h2_conn.open_inbound_streams > 0
    return (_Phase.BUSY if busy else _Phase.IDLE), (h2_conn.highest_inbound_stream_id, busy)


class Listener:
    """A started hardened listener (what ``start_grpc`` returns)."""

    def __init__(self, server: asyncio.Server, listener: _Listener) -> None:
        self._server = server
        self._listener = listener

    @property
    def port(self) -> int:
        return _bound_port(self._server)

    def stats(self) -> ListenerStats:
        return self._listener.stats()


async def start_grpc(
    server: Any,
    host: str,
    port: int,
    *,
    ssl: _ssl.SSLContext | None,
    limits: ListenLimits,
    name: str = "xds",
    on_refused: OnRefused | None = None,
) -> Listener:
    """Start a ``grpclib.server.Server`` (instead of ``server.start``) on a hardened listener.
    ``server.close()`` and ``server.wait_closed()`` work as after ``server.start``."""
    for attr in ("_protocol_factory", "_server", "_server_closed_fut"):
        if not hasattr(server, attr):
            raise RuntimeError(f"unsupported grpclib version: Server has no {attr}")
    if server._server is not None:
        raise RuntimeError("Server is already started")
    limited = _h2_protocol_class()
    # grpclib rescans the set of every connection's handler each 10 new connections: O(N) per
    # connection, ~0.4 ms per new ADS stream at 10,000. Rescan when closed handlers may be a
    # quarter of the set instead (amortised O(1); at most ~25% of handlers linger closed).
    server.__gc_interval__ = 1 << 62

    def app_factory() -> asyncio.Protocol:
        if len(server._handlers) - lst.open > max(64, lst.open // 4):
            server.__gc_collect__()
        inner = server._protocol_factory()  # registers the connection's handler with the server
        proto = limited(inner.handler, inner.config, inner.h2_config)
        proto.limits = limits
        return proto  # type: ignore[no-any-return]

    loop = asyncio.get_running_loop()
    lst = _Listener(name, limits, ssl, app_factory, _h2_phase, on_refused)
    srv = await loop.create_server(lst, host, port, backlog=limits.backlog)
    server._server = srv
    server._server_closed_fut = loop.create_future()
    return Listener(srv, lst)


# -- our own HTTP/2 (xds.adsconn) -------------------------------------------------------------


class H2Service(Protocol):
    """What ``start_h2`` serves (``xds.adsconn.LeanAds``)."""

    def configure(
        self,
        *,
        max_streams: int,
        max_header_list_size: int,
        window: int,
        first_message_timeout: float,
    ) -> None: ...

    def protocol(self, report: Callable[[str], None] | None) -> asyncio.Protocol: ...

    def serving(self, server: asyncio.Server) -> None: ...


def _lean_h2_phase(app: Any, received: bool) -> tuple[_Phase, object]:
    """Idle while no stream is open (``listen_phase``: (busy, key)); a body under way while
    some stream holds part of a request (``listen_body``: since when, without a break)."""
    since = app.listen_body()
    if since is not None:
        return _Phase.BODY, ("body", since)
    busy, key = app.listen_phase()
    return (_Phase.BUSY if busy else _Phase.IDLE), key


async def start_h2(
    service: H2Service,
    host: str,
    port: int,
    *,
    ssl: _ssl.SSLContext | None,
    limits: ListenLimits,
    name: str = "xds",
    on_refused: OnRefused | None = None,
) -> Listener:
    """Serve ``service`` (its own HTTP/2, e.g. ``xds.adsconn.LeanAds``) on a hardened
    listener. The service's ``close()`` / ``wait_closed()`` stop it."""
    if ssl is not None:
        _check_seam(ssl)
    service.configure(
        max_streams=limits.max_streams_per_connection,
        max_header_list_size=limits.max_header_list_size,
        window=limits.http2_window,
        first_message_timeout=limits.header_timeout,
    )

    def report(reason: str) -> None:
        lst.report(_REASONS.get(reason, CloseReason.PROTOCOL_ERROR))

    lst = _Listener(name, limits, ssl, lambda: service.protocol(report), _lean_h2_phase, on_refused)
    srv = await _serve_socket_tls(lst, host, port)
    lst.server = srv
    service.serving(srv)
    return Listener(srv, lst)


async def _serve_socket_tls(lst: _Listener, host: str, port: int) -> asyncio.Server:
    """A server for ``lst`` whose TLS connections ``_SocketTLS`` serves, accepted by an
    ``_Acceptor`` (without the ``asyncio.Server._sockets`` seam: asyncio accepts and
    ``_Admission`` hands the socket over); plain connections take asyncio's path."""
    lst.socket_tls = True
    tls = lst.tls is not None
    srv = await lst.loop.create_server(
        lst, host, port, backlog=lst.limits.backlog, start_serving=not tls
    )
    sockets = getattr(srv, "_sockets", None)
    if tls and isinstance(sockets, list) and sockets:
        _Acceptor(lst, srv, sockets)
    elif tls:
        await srv.start_serving()  # unknown asyncio: its own accept path (_Admission hands over)
    return srv


_ACCEPT_RETRY_S = 1.0  # out of descriptors or memory: accept again after this (as asyncio does)


class _Acceptor:
    """``start_h2`` with TLS accepts on its server's listening sockets itself and gives each
    accepted socket straight to ``_SocketTLS``: asyncio's accept path would make a Task, a
    future and a socket transport per connection, and ``_Admission`` would dup the descriptor
    and abort that transport (~28 us of CPU per connection, measured accepting 3,000). The
    asyncio server (made with ``start_serving=False``) still owns the sockets: its ``close``
    removes these readers and closes them, and ``sockets`` is empty from then on."""

    __slots__ = ("_listener", "_server")

    def __init__(self, listener: _Listener, server: asyncio.Server, sockets: list[Any]) -> None:
        self._listener = listener
        self._server = server
        for sock in sockets:
            sock.listen(listener.limits.backlog)
            listener.loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        lst = self._listener
        for _ in range(lst.limits.backlog):  # at most a backlog per callback, as asyncio
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                log.warning("%s: accept failed (%s); accepting again in %s s", lst.name, exc,
                            _ACCEPT_RETRY_S)  # fmt: skip
                lst.loop.remove_reader(sock.fileno())
                lst.loop.call_later(_ACCEPT_RETRY_S, self._resume, sock)
                return
            _socket_tls(lst, conn, peer)

    def _resume(self, sock: socket.socket) -> None:
        if self._server.sockets and sock.fileno() >= 0:  # not closed meanwhile
            self._listener.loop.add_reader(sock.fileno(), self._accept, sock)


def _socket_tls(lst: _Listener, conn: socket.socket, peer: object) -> None:
    """An accepted socket: admitted (or closed at once), then served by ``_SocketTLS``."""
    conn.setblocking(False)
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio sets it
    source = _source_key(peer)
    refused = lst.admit(source)
    if refused is not None:
        conn.close()
        lst.report(refused)
        return
    try:
        guard = _Guard(lst, lst.app_factory())
        _SocketTLS(guard, lst, source, conn)  # the event loop holds it
    except BaseException:
        conn.close()  # now, not when the exception's traceback is dropped
        lst.release(source)
        raise


_REASONS = {
    "protocol_error": CloseReason.PROTOCOL_ERROR,
    "flood": CloseReason.FLOOD,
    "invalid_request": CloseReason.INVALID_REQUEST,
    "header_timeout": CloseReason.HEADER_TIMEOUT,
}


# -- command line ------------------------------------------------------------------------------

_FLAGS: dict[str, tuple[type, str]] = {
    "handshake_timeout": (float, "seconds from accept to a complete TLS handshake"),
    "header_timeout": (float, "seconds from a request's first byte to its complete header"),
    "body_timeout": (float, "seconds from a complete header to a complete body"),
    "idle_timeout": (float, "seconds a connection may hold nothing in flight"),
    "max_connections": (int, "open connections per port"),
    "max_connections_per_source": (int, "open connections per port and source address"),
    "connect_rate_per_source": (float, "new connections per second per port and source"),
    "connect_burst_per_source": (int, "new connections at once per port and source"),
    "max_streams_per_connection": (int, "concurrent HTTP/2 streams per xDS connection"),
    "write_timeout": (float, "seconds a peer may leave what is sent to it unread"),
    "tls_read_buffer": (int, "bytes read at once per TLS connection"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--handshake-timeout`` ... ``--tls-read-buffer``: override ``ListenLimits`` defaults."""
    g = parser.add_argument_group("connection limits (every listening port)")
    defaults = ListenLimits()
    for name, (kind, text) in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, type=kind, help=f"{text} (default {getattr(defaults, name)})")


def limits_from_args(args: argparse.Namespace) -> ListenLimits:
    """The ``ListenLimits`` the flags of ``add_arguments`` ask for; ValueError if invalid."""
    given = {n: v for n in _FLAGS if (v := getattr(args, n, None)) is not None}
    return ListenLimits(**given)
