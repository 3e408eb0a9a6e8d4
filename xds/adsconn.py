"""The ADS port on a lean transport: :class:`xds.h2conn.H2Server` under an asyncio Protocol,
serving both RPCs of the AggregatedDiscoveryService with the sessions of :mod:`xds.server`.

Per connection: one ``H2Server`` (no HPACK encoder; a decoder made on the first HEADERS),
the peer identity read once from the client certificate. Per stream: a :class:`_Call` and,
after the first request, the session and the cache's watch, whose event is replaced by a
:class:`_Wake` that queues :meth:`AdsConnection.push` (no task per stream; the streams one
change wakes are pushed by one loop callback, :class:`_Pushes`). Requests are decoded by
:mod:`xds.adswire` in ``data_received`` and fed to the session there; an ACK costs a decode
and a session update. A push costs the session's encoding (streams sent the same change share
one response, see ``xds.server._numbered_response``) and one ``transport.write`` of the
framed bytes.

gRPC semantics kept from the grpclib server (and tested against a grpclib client): response
headers with the first message; trailers ``grpc-status`` (and ``grpc-message``) when the
stream ends; a trailers-only response for an error before any message; the client's
half-close ends the stream with OK; PERMISSION_DENIED for a foreign node (and the connection
closes soon after, see :data:`xds.server.REFUSED_CONNECTION_CLOSE_S`), INVALID_ARGUMENT for a
missing node id or an undecodable request, UNIMPLEMENTED for another method; ``grpc-timeout``
is honoured (DEADLINE_EXCEEDED). Backpressure: while a stream has data waiting for the peer's
window, or the transport has paused writing, its session is not asked for more.

Hostile input is reported through ``report(reason)`` (bounded reasons: ``protocol_error``,
``flood``, ``invalid_request``, ``header_timeout``) and ends the connection (connection errors:
GOAWAY with the code, then close) or the stream only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from cryptography import x509
from mypy_extensions import mypyc_attr

from xds import sync_status
from xds.adswire import WireError, decode_delta, decode_sotw
from xds.cache import SnapshotCache, Watch
from xds.h2conn import (
    GRPC_RESPONSE_HEADERS,
    ErrorCode,
    H2Error,
    H2Limits,
    H2Server,
    encode_headers,
    encode_trailers,
)
from xds.resources import ADS_SERVICE
from xds.server import (
    REFUSED_CONNECTION_CLOSE_S,
    AdsServer,
    AdsSession,
    DeltaSession,
    PeerIdentity,
)

log = logging.getLogger(__name__)

SOTW_PATH = f"/{ADS_SERVICE}/StreamAggregatedResources".encode()
DELTA_PATH = f"/{ADS_SERVICE}/DeltaAggregatedResources".encode()

# gRPC status codes used here
OK, DEADLINE_EXCEEDED, INVALID_ARGUMENT, PERMISSION_DENIED, UNIMPLEMENTED = 0, 4, 3, 7, 12
UNAVAILABLE = 14

Report = Callable[[str], None]
"""``report(reason)``: a hostile or broken input was refused (a bounded metric label)."""

_PATH_SHOWN = 96  # of an unknown method's path, or a refused node id, in a grpc-message

PUSH_SLICE_S = 0.004  # of pushes per turn of the loop (see _Pushes)
_CHECK_EVERY = 8  # pushes between two looks at the clock

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_grpc_timeout(value: bytes) -> float | None:
    """``grpc-timeout`` (up to 8 digits and a unit) in seconds; None if malformed."""
    if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
        return None
    unit = _TIMEOUT_UNITS.get(value[-1:])
    return None if unit is None else int(value[:-1]) * unit


def identity_of(der: bytes) -> PeerIdentity:
    """The URI SANs and serial of a verified client certificate (DER), what
    :func:`xds.server.peer_identity` reads from ``getpeercert()``'s dict, parsed by
    ``cryptography`` (~25 us for a mesh leaf; the dict, every field of the certificate
    decoded into Python objects, costs ~2.5x that). A certificate it cannot parse has no
    identity (nothing is authorized for it)."""
    try:
        cert = x509.load_der_x509_certificate(der)
        serial = cert.serial_number
        try:
            san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return PeerIdentity((), serial)
        uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
    except Exception:  # whatever cryptography refuses of what OpenSSL accepted: no identity
        return PeerIdentity((), None)
    return PeerIdentity(uris, serial)


class _Pushable(Protocol):
    """What :class:`_Pushes` pushes for: an :class:`AdsConnection`."""

    def push(self, call: _Call) -> None: ...


@mypyc_attr(allow_interpreted_subclasses=True)  # (make native: benchmarks time its turns)
class _Pushes:
    """The streams woken since the loop last ran their pushes, in the order they were woken:
    one ``call_soon`` for all of them (a change that wakes 5,000 streams schedules one
    callback, not 5,000 handles), run in that order on the next turn of the loop.

    One turn pushes for at most ``slice_s`` of ``clock`` (checked every ``_CHECK_EVERY``
    pushes); the rest go on the next turn, before any stream woken since: a change that wakes
    every stream of a 10,000-node mesh (~0.5 s of pushes) does not hold the loop for its whole
    length, so the attestation API, /healthz and ACKs are served between slices."""

    __slots__ = ("_clock", "_slice_s", "_woken")

    def __init__(
        self, slice_s: float = PUSH_SLICE_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self._woken: list[tuple[_Pushable, _Call]] = []
        self._slice_s = slice_s
        self._clock = clock

    def add(self, conn: _Pushable, call: _Call) -> None:
        woken = self._woken
        woken.append((conn, call))
        if len(woken) == 1:
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        woken, self._woken = self._woken, []
        clock = self._clock
        until = clock() + self._slice_s
        done = 0
        for conn, call in woken:
            try:
                conn.push(call)
            except Exception as exc:  # as the loop reports a failed callback; the rest go on
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "ADS push failed", "exception": exc, "protocol": conn}
                )
            done += 1
            if done % _CHECK_EVERY == 0 and done < len(woken) and clock() >= until:
                break
        if done < len(woken):  # the rest first on the next turn, then those woken meanwhile
            later = self._woken
            self._woken = woken[done:] + later
            if not later:  # (else their add already scheduled the next turn)
                asyncio.get_running_loop().call_soon(self._run)


class _Wake:
    """Stands in for a cache watch's ``asyncio.Event`` (``Watch.changed``): ``set`` queues the
    stream's push (:class:`_Pushes`, run on the next turn of the loop) instead of waking a
    task, so a stream needs no task (``set`` is all the cache calls)."""

    __slots__ = ("_call", "_conn", "_set")

    def __init__(self, conn: AdsConnection, call: _Call) -> None:
        self._conn = conn
        self._call = call
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._conn._server.pushes.add(self._conn, self._call)

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False


class _Call:
    __slots__ = (
        "deadline",
        "delta",
        "done",
        "node",
        "opened",
        "session",
        "sid",
        "started",
        "timer",
        "wake",
        "watch",
    )

    def __init__(self, sid: int, delta: bool) -> None:
        self.sid = sid
        self.delta = delta
        self.session: Any = None
        self.node = ""
        self.wake: _Wake | None = None
        self.watch: Watch | None = None
        self.timer: asyncio.TimerHandle | None = None  # the first request must come before it
        self.deadline: asyncio.TimerHandle | None = None  # grpc-timeout
        self.started = False  # response headers sent
        self.opened = False  # counted as an open stream (metrics, sync_status, watch)
        self.done = False


class LeanAds:
    """Serves ``ads`` (an :class:`xds.server.AdsServer`: cache, metrics, clock, authorize,
    versions) on connections made by :meth:`protocol`. ``close`` ends every connection."""

    def __init__(
        self,
        ads: AdsServer,
        limits: H2Limits | None = None,
        first_message_timeout: float = 10.0,
    ) -> None:
        self.ads = ads
        self.limits = limits or H2Limits()
        self.first_message_timeout = first_message_timeout
        self.connections: set[AdsConnection] = set()
        self.pushes = _Pushes()  # the woken streams' pushes, one callback per turn
        self._servers: list[asyncio.Server] = []
        self.clock = ads.clock  # monotonic seconds (the HTTP/2 control-frame budget)

    def configure(
        self,
        *,
        max_streams: int,
        max_header_list_size: int,
        window: int,
        first_message_timeout: float,
    ) -> None:
        """Set the limits new connections get (a hardened listener calls it)."""
        self.limits = H2Limits(
            max_streams=max_streams, max_header_list_size=max_header_list_size, window=window
        )
        self.first_message_timeout = first_message_timeout

    def protocol(self, report: Report | None = None) -> AdsConnection:
        return AdsConnection(self, report)

    def serving(self, server: asyncio.Server) -> None:
        """``server`` accepts this service's connections: ``close`` closes it too."""
        self._servers.append(server)

    async def start(self, host: str, port: int) -> None:
        """Listen on plain TCP with no listener limits (tests, the in-process harness)."""
        loop = asyncio.get_running_loop()
        self.serving(await loop.create_server(self.protocol, host, port))

    def close(self) -> None:
        """Stop listening; GOAWAY and UNAVAILABLE to every open stream, then close."""
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.shutdown()

    async def wait_closed(self) -> None:
        for _ in range(50):
            if not self.connections:
                break
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        for server in self._servers:
            await server.wait_closed()


class AdsConnection(asyncio.Protocol):
    """One HTTP/2 connection on the ADS port."""

    __slots__ = (
        "_blocked",
        "_calls",
        "_h2",
        "_paused",
        "_peer",
        "_report",
        "_server",
        "_transport",
        "_watch",
    )

    def __init__(self, server: LeanAds, report: Report | None) -> None:
        self._server = server
        self._report = report
        self._transport: asyncio.Transport | None = None
        self._h2: H2Server | None = None
        self._calls: dict[int, _Call] = {}
        self._peer: PeerIdentity | None = None
        self._paused = False
        self._blocked: set[_Call] | None = None  # calls waiting for window or resume_writing
        self._watch: Callable[[], None] | None = None  # the listener's (listen_watch)

    # -- what attestmesh.listen reads -------------------------------------------------------

    def listen_phase(self) -> tuple[bool, object]:
        """(a stream is open, a key that changes whenever a stream opens or the last closes)."""
        h2 = self._h2
        if h2 is None:
            return False, None
        busy = bool(h2.streams)
        return busy, (h2.highest_stream_id, busy)

    def listen_watch(self, changed: Callable[[], None]) -> None:
        """``changed()`` is called whenever ``listen_phase`` may change without input from the
        peer (a call ended here: a deadline, a refusal, shutdown), so the listener needs no
        timer per connection to notice that a busy connection went idle."""
        self._watch = changed

    def listen_body(self) -> float | None:
        """Since when some stream has held an incomplete request without a break (None: no
        stream does): a listener ends the connection once that outlasts its body timeout,
        or a peer could hold a message's worth of memory per connection for ever."""
        h2 = self._h2
        return None if h2 is None else h2.incomplete_since

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._h2 = H2Server(self, self._server.limits)
        self._server.connections.add(self)
        self._flush()

    def data_received(self, data: bytes) -> None:
        h2 = self._h2
        if h2 is None:
            return
        try:
            h2.receive(data, self._server.clock())
        except H2Error as exc:
            reason = "flood" if exc.code is ErrorCode.ENHANCE_YOUR_CALM else "protocol_error"
            log.info("xds: closing a connection: %s (%s)", exc, exc.code.name)
            self._count(reason)
            self._flush()
            self._end_all()
            if self._transport is not None:
                self._transport.close()
            return
        if self._blocked:
            self._wake_drained()  # a WINDOW_UPDATE or SETTINGS may have opened the window
        self._flush()

    def eof_received(self) -> bool:
        return False

    def pause_writing(self) -> None:
        # the peer does not read: read nothing more from it either, or what it sends that
        # is answered (PINGs, SETTINGS, refused streams) would pile up in the write buffer
        # until the write timeout
        self._paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()
        self._wake_drained()
        if self._watch is not None:  # trailers that waited for the transport may be sent
            self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._end_all()
        self._transport = None
        self._h2 = None

    def shutdown(self) -> None:
        """GOAWAY, end every stream with UNAVAILABLE, close."""
        h2, transport = self._h2, self._transport
        if h2 is None or transport is None:
            return
        for sid in list(self._calls):
            self._end(sid, UNAVAILABLE, "the control plane is shutting down")
        h2.goaway(ErrorCode.NO_ERROR)
        self._flush()
        transport.close()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    # -- helpers -----------------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        if self._report is not None:
            try:
                self._report(reason)
            except Exception:
                log.exception("report callback failed")

    def _flush(self) -> None:
        h2, transport = self._h2, self._transport
        if h2 is None or transport is None:
            return
        out = h2.take_output()
        if out:
            transport.write(out)

    def _peer_identity(self) -> PeerIdentity:
        if self._peer is None:
            transport = self._transport
            tls = None if transport is None else transport.get_extra_info("ssl_object")
            der = None if tls is None else tls.getpeercert(True)
            self._peer = identity_of(der) if isinstance(der, bytes) else PeerIdentity((), None)
        return self._peer

    def _trailers_only(self, sid: int, status: int, message: str) -> None:
        h2 = self._h2
        if h2 is not None:
            h2.send_trailers(sid, encode_trailers(status, message, headers=True))

    def _end(self, sid: int, status: int, message: str = "") -> None:
        """End a call with a gRPC status (trailers after anything still queued)."""
        call = self._calls.pop(sid, None)
        h2 = self._h2
        if h2 is not None and sid in h2.streams:
            headers = call is None or not call.started
            h2.send_trailers(sid, encode_trailers(status, message, headers=headers))
        if call is not None:
            self._stop(call)
        if self._watch is not None:
            self._watch()

    def _stop(self, call: _Call) -> None:
        """The call is over: timers off, the watch left, the stream uncounted (once)."""
        if call.done:
            return
        call.done = True
        for timer in (call.timer, call.deadline):
            if timer is not None:
                timer.cancel()
        call.timer = call.deadline = None
        if self._blocked:
            self._blocked.discard(call)
        if call.opened:
            call.opened = False
            ads = self._server.ads
            ads.metrics.xds_stream(-1)
            sync_status.closed(ads.cache, call.node, call.session)
            if call.watch is not None:
                ads.cache.remove_watch(call.watch)
                call.watch = None

    def _end_all(self) -> None:
        calls, self._calls = self._calls, {}
        for call in calls.values():
            self._stop(call)

    def _wake_drained(self) -> None:
        blocked = self._blocked
        if not blocked or self._paused:
            return
        h2 = self._h2
        for call in list(blocked):
            if h2 is None or not h2.pending(call.sid):
                blocked.discard(call)
                if call.wake is not None:
                    call.wake.set()  # push again: what was held back is still due

    # -- H2Handler ---------------------------------------------------------------------------

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        method = path = content_type = timeout = None
        for name, value in headers:
            if name == b":method":
                method = value
            elif name == b":path":
                path = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                timeout = value
        h2 = self._h2
        assert h2 is not None
        if (
            method != b"POST"
            or content_type is None
            or not content_type.startswith(b"application/grpc")
        ):
            self._count("invalid_request")
            status = b"415" if method == b"POST" else b"405"
            h2.send_trailers(stream_id, encode_headers([(b":status", status)]))
            return
        if path == SOTW_PATH:
            call = _Call(stream_id, delta=False)
        elif path == DELTA_PATH:
            call = _Call(stream_id, delta=True)
        else:
            # the path is the peer's: a few bytes of HPACK can name a 4 KB one, so no echo
            # of it grows the answer beyond what a real method name needs
            shown = path if path is None or len(path) <= _PATH_SHOWN else path[:_PATH_SHOWN]
            more = "..." if path is not None and len(path) > _PATH_SHOWN else ""
            self._trailers_only(stream_id, UNIMPLEMENTED, f"method not found: {shown!r}{more}")
            return
        self._calls[stream_id] = call
        loop = asyncio.get_running_loop()
        seconds = parse_grpc_timeout(timeout) if timeout is not None else None
        if timeout is not None and seconds is None:
            self._calls.pop(stream_id)
            self._count("invalid_request")
            self._trailers_only(stream_id, INVALID_ARGUMENT, "malformed grpc-timeout")
            return
        if seconds is not None:
            call.deadline = loop.call_later(seconds, self._deadline, stream_id, "deadline exceeded")
        call.timer = loop.call_later(
            self._server.first_message_timeout, self._deadline, stream_id, ""
        )

    def _deadline(self, sid: int, message: str) -> None:
        call = self._calls.get(sid)
        if call is None:
            return
        if not message:
            call.timer = None  # the first-message timer: a stream opened and left silent
            self._count("header_timeout")
            message = "no request within the first-message timeout"
        self._end(sid, DEADLINE_EXCEEDED, message)
        self._flush()

    def on_message(self, stream_id: int, message: bytes) -> None:
        call = self._calls.get(stream_id)
        if call is None:
            return
        try:
            req: Any = decode_delta(message) if call.delta else decode_sotw(message)
        except WireError as exc:
            self._count("invalid_request")
            self._end(stream_id, INVALID_ARGUMENT, f"undecodable request: {exc}")
            return
        if call.session is not None:
            if call.session.on_request(req) and call.wake is not None:
                call.wake.set()
            return
        self._first(stream_id, call, req)

    def _first(self, sid: int, call: _Call, req: Any) -> None:
        ads = self._server.ads
        node = req.node.id if req.node is not None else ""
        if not node:
            self._end(sid, INVALID_ARGUMENT, "node.id is required")
            return
        authorize = ads.authorize
        if authorize is not None and not authorize(node, self._peer_identity()):
            shown = node if len(node) <= _PATH_SHOWN else node[:_PATH_SHOWN] + "..."
            self._end(
                sid, PERMISSION_DENIED, f"the client certificate does not identify node {shown!r}"
            )
            transport = self._transport
            if transport is not None:
                asyncio.get_running_loop().call_later(REFUSED_CONNECTION_CLOSE_S, transport.close)
            return
        if call.timer is not None:  # the first request came: ADS streams are long-lived
            call.timer.cancel()
            call.timer = None
        call.node = node
        call.session = (
            DeltaSession(node, ads.metrics, ads.clock, ads.versions)
            if call.delta
            else AdsSession(node, ads.metrics, ads.clock)
        )
        call.session.on_request(req)
        cache: SnapshotCache = ads.cache
        watch = call.watch = cache.add_watch(node)
        call.opened = True
        ads.metrics.xds_stream(+1)
        sync_status.opened(cache, node, call.session)
        call.wake = _Wake(self, call)
        initially = watch.changed.is_set()
        watch.changed = call.wake  # type: ignore[assignment]  # see _Wake
        if initially:
            call.wake.set()

    def on_end(self, stream_id: int) -> None:
        # the client half-closed: nothing more will be asked; the stream ends (as grpclib's
        # handler returns when its request iterator ends)
        if stream_id in self._calls:
            self._end(stream_id, OK)

    def on_reset(self, stream_id: int, code: int) -> None:
        call = self._calls.pop(stream_id, None)
        if call is not None:
            self._stop(call)

    # -- the push side -----------------------------------------------------------------------

    def push(self, call: _Call) -> None:
        """Send what the stream's session makes due for the node's current snapshot (called
        soon after the watch is set). Stops while the peer's window or the transport is
        full; what was not taken stays due in the session, and is pushed once drained."""
        wake = call.wake
        if wake is None or call.done:
            return
        wake.clear()
        h2 = self._h2
        if h2 is None or self._calls.get(call.sid) is not call:
            return
        # the stream's client is re-checked on every push (what xds.server.still_allowed_for
        # does, without a closure per stream): the connection's one peer identity
        authorize = self._server.ads.authorize
        if authorize is not None and not authorize(call.node, self._peer_identity()):
            self._send_final(call, h2)
            self._end(
                call.sid,
                PERMISSION_DENIED,
                f"the client certificate no longer identifies node {call.node!r}",
            )
            self._flush()
            transport = self._transport
            if transport is not None:
                asyncio.get_running_loop().call_later(REFUSED_CONNECTION_CLOSE_S, transport.close)
            return
        if self._paused or h2.pending(call.sid):
            self._hold(call)
            return
        snapshot = self._server.ads.cache.get(call.node)
        if snapshot is None:
            return
        sid = call.sid
        for message in call.session.responses(snapshot):
            if not call.started:
                call.started = True
                h2.send_headers(sid, GRPC_RESPONSE_HEADERS)
            if not h2.send_message(sid, message):
                break
            if h2.pending(sid):
                self._hold(call)  # the rest stays due in the session
                break
        self._flush()

    def _send_final(self, call: _Call, h2: H2Server) -> None:
        """What the node's configuration is now, once, before its revoked stream ends: after a
        quarantine it admits nobody inbound and routes nowhere, so an honest Envoy refuses at
        once instead of keeping its last configuration until every caller has been told (the
        callers' and destinations' updates stay what protects the mesh). Best effort: nothing
        beyond the peer's window or a paused transport."""
        snapshot = self._server.ads.cache.get(call.node)
        if snapshot is None or self._paused or h2.pending(call.sid):
            return
        for message in call.session.responses(snapshot):
            if not call.started:
                call.started = True
                h2.send_headers(call.sid, GRPC_RESPONSE_HEADERS)
            if not h2.send_message(call.sid, message) or h2.pending(call.sid):
                return

    def _hold(self, call: _Call) -> None:
        if self._blocked is None:
            self._blocked = set()
        self._blocked.add(call)
