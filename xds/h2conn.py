"""A minimal, strict HTTP/2 server connection for gRPC bidirectional streams (no I/O).

Feed it the bytes the peer sent (:meth:`H2Server.receive`); it calls the :class:`H2Handler`
for each stream event and queues the bytes to send, which the adapter takes with
:meth:`H2Server.take_output`. What it implements (RFC 9113), and nothing more:

- the client preface, then SETTINGS (ours first, with the limits) and SETTINGS ACK;
- HEADERS (+PADDED, +PRIORITY) and CONTINUATION, decoded with ``hpack`` (bounded header list);
  our own headers and trailers are hand-encoded literals that never use the dynamic table, so
  the connection holds no HPACK encoder; our SETTINGS_HEADER_TABLE_SIZE is 0, so once the
  client has acknowledged them its next header block starts by emptying its table (RFC 7541
  4.2): the decoder (and the table the first request filled) is dropped then, and one with no
  table is made for each later header block and dropped after it (an idle connection holds
  none);
- DATA with gRPC's 5-byte message framing (reassembled across frames, bounded size, no
  compression), END_STREAM;
- flow control both ways: never more than the peer's connection and stream windows is sent
  (the rest waits per stream for WINDOW_UPDATE or a larger SETTINGS_INITIAL_WINDOW_SIZE);
  a peer that sends beyond our window is a FLOW_CONTROL_ERROR; what we receive is handed on at
  once, so the window is replenished once half of it is consumed;
- PING (answered), RST_STREAM, GOAWAY (received: no new stream; sent on a connection error),
  PRIORITY (ignored), unknown frame types (ignored), PUSH_PROMISE from a client (an error).

A connection error (:class:`H2Error`) queues GOAWAY with its code; the adapter sends it and
closes the connection. A stream error resets only that stream. Frames that cost the server
work but carry no application data (PING, SETTINGS, PRIORITY, RST_STREAM, GOAWAY, empty
CONTINUATION, DATA empty or under 1 KiB that completes no message, unknown types, refused
streams, WINDOW_UPDATE) and every new stream are
budgeted: more than ``control_budget`` of them within ``budget_seconds`` (by the clock the
caller passes to ``receive``) is a flood (ENHANCE_YOUR_CALM). Each gRPC message received
gives one back (so a stream that opens and sends its request costs nothing, and churn of
streams that do is no flood), never more than ``control_budget``: a message does not buy a
whole new budget, so PINGs between tiny messages, or streams opened only to be refused (each
answered with a response), stay bounded. Each DATA frame sent gives two back (the
WINDOW_UPDATEs an honest client sends for what it receives). A quiet stream's keepalive
PINGs never are a flood.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import hpack
import hpack.exceptions
from mypy_extensions import mypyc_attr

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY = range(8)
WINDOW_UPDATE, CONTINUATION = 8, 9
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME = 16_384
MAX_FRAME = 2**24 - 1

_TINY = 1_024  # a DATA frame shorter than this that completes no gRPC message is budgeted
_HDR = struct.Struct(">I")  # 32-bit fields (the 24-bit length is read with 1 byte shifted in)
_SETTING = struct.Struct(">HI")


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0
    PROTOCOL_ERROR = 1
    INTERNAL_ERROR = 2
    FLOW_CONTROL_ERROR = 3
    SETTINGS_TIMEOUT = 4
    STREAM_CLOSED = 5
    FRAME_SIZE_ERROR = 6
    REFUSED_STREAM = 7
    CANCEL = 8
    COMPRESSION_ERROR = 9
    CONNECT_ERROR = 10
    ENHANCE_YOUR_CALM = 11
    INADEQUATE_SECURITY = 12
    HTTP_1_1_REQUIRED = 13


class H2Error(Exception):
    """A connection error: GOAWAY with ``code``, then the connection closes."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class H2Limits:
    max_streams: int = 16  # SETTINGS_MAX_CONCURRENT_STREAMS
    max_header_list_size: int = 16_384  # SETTINGS_MAX_HEADER_LIST_SIZE, and the header block cap
    window: int = DEFAULT_WINDOW  # our initial stream and connection receive windows
    max_message: int = 4 * 1024 * 1024  # largest gRPC message a client may send (and what
    # all streams of a connection may hold of incomplete ones together)
    control_budget: int = 1_000  # non-data frames allowed per budget_seconds, or between
    budget_seconds: float = 10.0  # two received gRPC messages

    def __post_init__(self) -> None:
        if not (DEFAULT_WINDOW <= self.window <= MAX_WINDOW):
            raise ValueError("H2Limits.window must be in [65535, 2**31-1]")
        if min(self.max_streams, self.max_header_list_size, self.max_message) <= 0:
            raise ValueError("H2Limits: limits must be positive")
        if self.control_budget <= 0:
            raise ValueError("H2Limits: control_budget must be positive")


class H2Handler(Protocol):
    """What the application hears from :class:`H2Server`."""

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        """A new stream's request headers (``end``: the client sent no body)."""

    def on_message(self, stream_id: int, message: bytes) -> None:
        """One complete gRPC message (its 5-byte prefix removed)."""

    def on_end(self, stream_id: int) -> None:
        """The client half-closed the stream (it sends nothing more)."""

    def on_reset(self, stream_id: int, code: int) -> None:
        """The stream is gone (reset by the peer, or by us for a stream error, or the
        connection failed): send nothing more on it."""


class _Stream:
    __slots__ = (
        "buf",
        "closed_local",
        "closed_remote",
        "pending",
        "pending_bytes",
        "recv_consumed",
        "recv_window",
        "send_window",
        "trailers",
    )

    def __init__(self, send_window: int, recv_window: int) -> None:
        self.send_window = send_window
        self.recv_window = recv_window
        self.recv_consumed = 0
        self.buf: bytearray | None = None  # gRPC message bytes received, not yet complete
        self.pending: deque[bytes] | None = None  # DATA payload waiting for window
        self.pending_bytes = 0
        self.trailers: bytes | None = None  # header block to send once pending is out
        self.closed_remote = False
        self.closed_local = False


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, (n >> 8) & 0xFF, n & 0xFF, kind, flags)) + _HDR.pack(stream_id) + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


def encode_headers(headers: Sequence[tuple[bytes, bytes]]) -> bytes:
    """A header block of literals (``:status 200`` as static index 8): needs no encoder state."""
    out = []
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(b"\x88")
        else:
            out.append(_literal(name, value))
    return b"".join(out)


GRPC_RESPONSE_HEADERS = encode_headers(
    [(b":status", b"200"), (b"content-type", b"application/grpc")]
)


@mypyc_attr(native_class=False)  # (make native, xds.native: a native class cannot subclass list)
class _Entries(list[tuple[bytes, bytes]]):
    """The HPACK decoder's dynamic table (hpack's ``HeaderTable.dynamic_entries``: indexing,
    ``appendleft``, ``pop``, ``clear``, iteration) as a list: a deque costs 760 bytes per
    connection however few headers the table holds, a list 56 plus its entries. At most
    4,096 / 32 = 128 entries (the default table size: this server never raises it), so the
    copy in ``appendleft`` stays small."""

    __slots__ = ()

    def appendleft(self, entry: tuple[bytes, bytes]) -> None:
        self.insert(0, entry)


class H2Server:
    """One server-side HTTP/2 connection."""

    __slots__ = (
        "_budget",
        "_budget_since",
        "_buf",
        "_buffered",
        "_buffered_since",
        "_cont",
        "_decoder",
        "_goaway_sent",
        "_handler",
        "_highest",
        "_limits",
        "_now",
        "_out",
        "_preface",
        "_recv_consumed",
        "_recv_window",
        "_send_frame",
        "_send_window",
        "_settings_seen",
        "_stream_init_window",
        "_table_zero",
        "goaway_received",
        "streams",
    )

    def __init__(self, handler: H2Handler, limits: H2Limits) -> None:
        self._handler = handler
        self._limits = limits
        self._buf = bytearray()
        self._buffered = 0  # bytes of incomplete gRPC messages held over all streams
        self._buffered_since = 0.0  # since when (by receive's clock) _buffered has been > 0
        self._now = 0.0
        self._preface = True  # still expecting the client preface
        self._settings_seen = False
        self._out: list[bytes] = []
        self._decoder: hpack.Decoder | None = None
        self._table_zero = False  # the client acknowledged our HEADER_TABLE_SIZE of 0
        self._cont: tuple[int, bool, bytearray] | None = None  # (stream, end_stream, block)
        self._highest = 0
        self._send_window = DEFAULT_WINDOW  # connection
        self._stream_init_window = DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self._send_frame = DEFAULT_FRAME  # the peer's SETTINGS_MAX_FRAME_SIZE
        self._recv_window = limits.window
        self._recv_consumed = 0
        self._budget = limits.control_budget
        self._budget_since = 0.0
        self._goaway_sent = False
        self.goaway_received = False
        self.streams: dict[int, _Stream] = {}
        settings = (
            _SETTING.pack(S_HEADER_TABLE_SIZE, 0)
            + _SETTING.pack(S_MAX_CONCURRENT_STREAMS, limits.max_streams)
            + _SETTING.pack(S_MAX_HEADER_LIST_SIZE, limits.max_header_list_size)
            + _SETTING.pack(S_ENABLE_PUSH, 0)
        )
        if limits.window != DEFAULT_WINDOW:
            settings += _SETTING.pack(S_INITIAL_WINDOW_SIZE, limits.window)
        self._out.append(_frame(SETTINGS, 0, 0, settings))
        if limits.window != DEFAULT_WINDOW:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _HDR.pack(limits.window - DEFAULT_WINDOW)))

    # -- output ------------------------------------------------------------------------------

    def take_output(self) -> bytes:
        """The bytes queued to send since the last call (b"" if none)."""
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        return data

    @property
    def highest_stream_id(self) -> int:
        return self._highest

    @property
    def incomplete_since(self) -> float | None:
        """Since when (by ``receive``'s clock) some stream has held part of a gRPC message
        without a break; None if none does (a listener's body timeout runs from it)."""
        return self._buffered_since if self._buffered > 0 else None

    @property
    def goaway_sent(self) -> bool:
        return self._goaway_sent

    def goaway(self, code: ErrorCode, message: str = "") -> None:
        """Queue GOAWAY (once): no stream above the highest seen will be processed."""
        if self._goaway_sent:
            return
        self._goaway_sent = True
        payload = _HDR.pack(self._highest) + _HDR.pack(int(code)) + message.encode()[:256]
        self._out.append(_frame(GOAWAY, 0, 0, payload))

    def send_headers(self, stream_id: int, block: bytes = GRPC_RESPONSE_HEADERS) -> None:
        """Response headers (an encoded block, e.g. :data:`GRPC_RESPONSE_HEADERS`)."""
        st = self.streams.get(stream_id)
        if st is None or st.closed_local:
            return
        self._header_frames(stream_id, block, 0)

    def _header_frames(self, stream_id: int, block: bytes, flags: int) -> None:
        size = self._send_frame
        if len(block) <= size:
            self._out.append(_frame(HEADERS, flags | END_HEADERS, stream_id, block))
            return
        self._out.append(_frame(HEADERS, flags, stream_id, block[:size]))
        rest = block[size:]
        while rest:
            chunk, rest = rest[:size], rest[size:]
            self._out.append(_frame(CONTINUATION, 0 if rest else END_HEADERS, stream_id, chunk))

    def send_message(self, stream_id: int, message: bytes) -> bool:
        """Queue one gRPC message (prefixed here). False if the stream is gone."""
        st = self.streams.get(stream_id)
        if st is None or st.closed_local or st.trailers is not None:
            return False
        n = len(message)
        prefix = bytes((0, n >> 24 & 0xFF, n >> 16 & 0xFF, n >> 8 & 0xFF, n & 0xFF))
        total = n + 5
        if (
            not st.pending
            and total <= self._send_frame
            and total <= self._send_window
            and total <= st.send_window
        ):  # the common case: one DATA frame, the message bytes not copied here
            self._out.append(
                bytes((total >> 16, total >> 8 & 0xFF, total & 0xFF, DATA, 0))
                + _HDR.pack(stream_id)
                + prefix
            )
            self._out.append(message)
            self._send_window -= total
            self._refund_updates()
            st.send_window -= total
            return True
        data = prefix + message
        if st.pending:
            st.pending.append(data)
            st.pending_bytes += len(data)
            return True
        rest = self._send_data(st, stream_id, data)
        if rest:
            st.pending = deque((rest,))
            st.pending_bytes = len(rest)
        return True

    def _send_data(self, st: _Stream, stream_id: int, data: bytes) -> bytes:
        """Send as much of ``data`` as the windows allow; return what is left."""
        out = self._out
        while data:
            n = min(len(data), self._send_window, st.send_window, self._send_frame)
            if n <= 0:
                return data
            out.append(bytes((n >> 16, n >> 8 & 0xFF, n & 0xFF, DATA, 0)) + _HDR.pack(stream_id))
            if n < len(data):
                out.append(data[:n])
                data = data[n:]
            else:
                out.append(data)
                data = b""
            self._send_window -= n
            self._refund_updates()
            st.send_window -= n
        return data

    def pending(self, stream_id: int) -> int:
        """Bytes of the stream waiting for flow-control window."""
        st = self.streams.get(stream_id)
        return 0 if st is None else st.pending_bytes

    def send_trailers(self, stream_id: int, block: bytes) -> None:
        """End the stream with trailers (after any data still waiting for window)."""
        st = self.streams.get(stream_id)
        if st is None or st.closed_local or st.trailers is not None:
            return
        if st.pending:
            st.trailers = block
            return
        self._finish(stream_id, st, block)

    def _finish(self, stream_id: int, st: _Stream, block: bytes) -> None:
        self._header_frames(stream_id, block, END_STREAM)
        st.closed_local = True
        if st.closed_remote:
            self._drop(stream_id)
        else:
            # the client may still send: it is told nothing more is read by RST_STREAM(NO_ERROR)
            self._out.append(_frame(RST_STREAM, 0, stream_id, _HDR.pack(ErrorCode.NO_ERROR)))
            self._drop(stream_id)

    def reset(self, stream_id: int, code: ErrorCode) -> None:
        """Reset a stream (a stream error): RST_STREAM, and the handler hears ``on_reset``."""
        if stream_id in self.streams:
            self._out.append(_frame(RST_STREAM, 0, stream_id, _HDR.pack(int(code))))
            self._drop(stream_id)
            self._handler.on_reset(stream_id, int(code))

    def _drop(self, stream_id: int) -> None:
        st = self.streams.pop(stream_id, None)
        if st is not None and st.buf:
            self._buffered -= len(st.buf)

    def _flush_pending(self) -> None:
        for sid, st in list(self.streams.items()):
            if self._send_window <= 0:
                return
            q = st.pending
            if not q:
                continue
            while q:
                head = q[0]
                rest = self._send_data(st, sid, head)
                st.pending_bytes -= len(head) - len(rest)
                if rest:
                    q[0] = rest
                    break
                q.popleft()
            if not q:
                st.pending = None
                st.pending_bytes = 0
                if st.trailers is not None:
                    self._finish(sid, st, st.trailers)

    def close_all(self) -> None:
        """The connection is gone: every open stream hears ``on_reset`` (CANCEL)."""
        streams, self.streams = self.streams, {}
        self._buffered = 0
        for sid in streams:
            self._handler.on_reset(sid, int(ErrorCode.CANCEL))

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes, now: float = 0.0) -> None:
        """Process bytes from the peer (``now``: a monotonic clock, for the control-frame
        budget). Raises :class:`H2Error` on a connection error (GOAWAY is then queued: send
        it and close)."""
        self._now = now
        if now - self._budget_since >= self._limits.budget_seconds:
            self._budget_since = now
            self._budget = self._limits.control_budget
        try:
            self._receive(data)
        except H2Error as exc:
            self.goaway(exc.code, str(exc))
            raise

    def _receive(self, data: bytes) -> None:
        buf = self._buf
        src: bytes | bytearray
        if buf or self._preface:
            buf += data
            src = buf
        else:  # nothing held back (the common case): frames are read from ``data`` itself
            src = bytes(data)
        if self._preface:
            n = min(len(buf), len(PREFACE))
            if buf[:n] != PREFACE[:n]:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "bad connection preface")
            if len(buf) < len(PREFACE):
                return
            del buf[: len(PREFACE)]
            self._preface = False
        pos = 0
        end = len(src)
        max_in = DEFAULT_FRAME  # we never advertise a larger SETTINGS_MAX_FRAME_SIZE
        try:
            while end - pos >= 9:
                length = src[pos] << 16 | src[pos + 1] << 8 | src[pos + 2]
                if length > max_in:
                    raise H2Error(ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes")
                if end - pos < 9 + length:
                    break
                kind, flags = src[pos + 3], src[pos + 4]
                sid = _HDR.unpack_from(src, pos + 5)[0] & 0x7FFFFFFF
                payload = bytes(src[pos + 9 : pos + 9 + length])  # a copy only of a bytearray
                pos += 9 + length
                self._frame_in(kind, flags, sid, payload)
        finally:
            if src is buf:
                if pos:
                    del buf[:pos]
            elif pos < end:
                buf += memoryview(src)[pos:]  # the start of a frame: held for the next read

    def _refund_updates(self) -> None:
        """A DATA frame sent earns the peer the two WINDOW_UPDATEs (stream, connection) an
        honest client may send for it; only window updates nothing was sent for add up."""
        budget = self._budget + 2
        self._budget = min(budget, self._limits.control_budget)

    def _spend(self) -> None:
        self._budget -= 1
        if self._budget < 0:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, "too many control frames")

    def _frame_in(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if not self._settings_seen and kind != SETTINGS:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "the first frame must be SETTINGS")
        if self._cont is not None and kind != CONTINUATION:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "expected CONTINUATION")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == SETTINGS:
            self._spend()
            self._settings(flags, sid, payload)
        elif kind == PING:
            self._spend()
            if sid != 0:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PING payload is not 8 bytes")
            if not flags & ACK:
                self._out.append(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._spend()
            if sid == 0:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM payload is not 4 bytes")
            if sid > self._highest:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "RST_STREAM on an idle stream")
            if sid in self.streams:
                self._drop(sid)
                self._handler.on_reset(sid, _HDR.unpack(payload)[0])
        elif kind == PRIORITY:
            self._spend()
            if sid == 0:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PRIORITY payload is not 5 bytes")
        elif kind == GOAWAY:
            self._spend()
            if sid != 0:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
            if len(payload) < 8:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "GOAWAY payload too short")
            self.goaway_received = True
        elif kind == PUSH_PROMISE:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        else:
            self._spend()  # unknown frame types are ignored (RFC 9113 5.5), but budgeted

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            # ours (one SETTINGS frame, ever) are in force: every later header block starts
            # with a table size update to 0, so nothing in the table is referenced again
            self._table_zero = True
            self._decoder = None  # (never mid-block: CONTINUATION must follow HEADERS)
            return
        if len(payload) % 6:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6")
        self._settings_seen = True
        for i in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == S_ENABLE_PUSH and value > 1:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "ENABLE_PUSH must be 0 or 1")
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE too large")
                delta = value - self._stream_init_window
                self._stream_init_window = value
                for st in self.streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
            elif key == S_MAX_FRAME_SIZE:
                if not (DEFAULT_FRAME <= value <= MAX_FRAME):
                    raise H2Error(ErrorCode.PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
                self._send_frame = value
            # HEADER_TABLE_SIZE: our encoding never uses the dynamic table; the rest concern a
            # server that initiates streams or a client's own limits
        self._out.append(_frame(SETTINGS, ACK, 0))
        self._flush_pending()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE payload is not 4 bytes")
        inc = _HDR.unpack(payload)[0] & 0x7FFFFFFF
        self._spend()  # given back by the DATA frames we send (see _refund_updates)
        if sid == 0:
            if inc == 0:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += inc
            if self._send_window > MAX_WINDOW:
                raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow")
            self._flush_pending()
            return
        if sid > self._highest:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE on an idle stream")
        st = self.streams.get(sid)
        if st is None:
            return  # a closed stream: allowed, ignored
        if inc == 0:
            self.reset(sid, ErrorCode.PROTOCOL_ERROR)
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            self.reset(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        if st.pending:
            self._flush_pending()

    def _strip_padding(self, flags: int, payload: bytes) -> bytes:
        if flags & PADDED:
            if not payload:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "PADDED frame without a pad length")
            pad = payload[0]
            if pad >= len(payload):
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
            return payload[1 : len(payload) - pad]
        return payload

    def _headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        block = self._strip_padding(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise H2Error(ErrorCode.FRAME_SIZE_ERROR, "HEADERS priority too short")
            block = block[5:]
        end_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(sid, end_stream, block)
        else:
            self._cont = (sid, end_stream, bytearray(block))
            self._check_block(self._cont[2])

    def _continuation(self, flags: int, sid: int, payload: bytes) -> None:
        cont = self._cont
        if cont is None or cont[0] != sid:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "CONTINUATION without HEADERS")
        if not payload and not flags & END_HEADERS:
            self._spend()  # an empty CONTINUATION carries nothing: a flood of them is work only
        cont[2].extend(payload)
        self._check_block(cont[2])
        if flags & END_HEADERS:
            self._cont = None
            self._header_block(sid, cont[1], bytes(cont[2]))

    def _check_block(self, block: bytearray) -> None:
        if len(block) > self._limits.max_header_list_size:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, "header block too large")

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        if self._decoder is None:
            self._decoder = hpack.Decoder(max_header_list_size=self._limits.max_header_list_size)
            self._decoder.header_table.dynamic_entries = _Entries()  # type: ignore[assignment]
            if self._table_zero:  # a size update above 0 is the peer's error
                self._decoder.max_allowed_table_size = 0
                self._decoder.header_table_size = 0
        try:
            headers: list[tuple[bytes, bytes]] = list(self._decoder.decode(block, raw=True))
            if self._table_zero:
                self._decoder = None  # it holds nothing the next block needs
            return headers
        except hpack.exceptions.OversizedHeaderListError as exc:
            raise H2Error(ErrorCode.ENHANCE_YOUR_CALM, "header list too large") from exc
        except (hpack.exceptions.HPACKError, ValueError, IndexError) as exc:
            raise H2Error(ErrorCode.COMPRESSION_ERROR, f"bad header block: {exc}") from exc

    def _header_block(self, sid: int, end_stream: bool, block: bytes) -> None:
        headers = self._decode(block)  # always: the decoder's table must follow the peer's
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client
            if st.closed_remote:  # it has already ended its side (RFC 9113 5.1)
                self.reset(sid, ErrorCode.STREAM_CLOSED)
                return
            if not end_stream:
                raise H2Error(ErrorCode.PROTOCOL_ERROR, "a second HEADERS without END_STREAM")
            self._remote_end(sid, st)
            return
        if sid <= self._highest:
            raise H2Error(ErrorCode.STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        self._highest = sid
        if self._goaway_sent or len(self.streams) >= self._limits.max_streams:
            self._spend()
            self._out.append(_frame(RST_STREAM, 0, sid, _HDR.pack(ErrorCode.REFUSED_STREAM)))
            return
        self._spend()  # given back by the stream's first message
        st = _Stream(self._stream_init_window, self._limits.window)
        self.streams[sid] = st
        self._handler.on_headers(sid, headers, end_stream)
        if end_stream and sid in self.streams:
            self._remote_end(sid, st)

    def _remote_end(self, sid: int, st: _Stream) -> None:
        if st.buf:
            self.reset(sid, ErrorCode.PROTOCOL_ERROR)  # a truncated gRPC message
            return
        st.closed_remote = True
        self._handler.on_end(sid)

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self._recv_window -= length
        if self._recv_window < 0:
            raise H2Error(ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._consumed(length)
        if sid > self._highest:
            raise H2Error(ErrorCode.PROTOCOL_ERROR, "DATA on an idle stream")
        st = self.streams.get(sid)
        if st is None or st.closed_remote:
            self._spend()
            if st is not None:
                self.reset(sid, ErrorCode.STREAM_CLOSED)
            return  # a stream we closed or reset: dropped (RFC 9113 5.1)
        st.recv_window -= length
        if st.recv_window < 0:
            self.reset(sid, ErrorCode.FLOW_CONTROL_ERROR)
            return
        st.recv_consumed += length
        if st.recv_consumed >= self._limits.window // 2 and not flags & END_STREAM:
            self._out.append(_frame(WINDOW_UPDATE, 0, sid, _HDR.pack(st.recv_consumed)))
            st.recv_window += st.recv_consumed
            st.recv_consumed = 0
        data = self._strip_padding(flags, payload)
        if not data and not flags & END_STREAM:
            self._spend()
        if data:
            completed = self._messages(sid, st, data)
            sliver = not completed and len(data) < _TINY and not flags & END_STREAM
            if sliver and sid in self.streams:
                self._spend()  # a sliver of a message: 1-byte DATA frames are work only
        if flags & END_STREAM and sid in self.streams:
            self._remote_end(sid, st)

    def _consumed(self, length: int) -> None:
        self._recv_consumed += length
        if self._recv_consumed >= self._limits.window // 2:
            self._out.append(_frame(WINDOW_UPDATE, 0, 0, _HDR.pack(self._recv_consumed)))
            self._recv_window += self._recv_consumed
            self._recv_consumed = 0

    def _messages(self, sid: int, st: _Stream, data: bytes) -> bool:
        """Add ``data`` to the stream's message; True if it completed one (or more)."""
        limits = self._limits
        if st.buf is None and len(data) >= 5 and data[0] == 0:
            # the common case (an ACK): exactly one whole message in one frame, nothing held
            # before it; what the general path below does, without buffering it
            n = _HDR.unpack_from(data, 1)[0]
            if (
                n + 5 == len(data)
                and n <= limits.max_message
                and self._buffered + len(data) <= limits.max_message + 5
            ):
                if self._budget < limits.control_budget:
                    self._budget += 1
                self._handler.on_message(sid, data[5:])
                return True
        if self._buffered + len(data) > self._limits.max_message + 5:
            # the windows are given back as bytes arrive, so they bound nothing here: what
            # all streams hold of incomplete messages is bounded by one message instead
            self.reset(sid, ErrorCode.ENHANCE_YOUR_CALM)
            return False
        buf = st.buf
        if not self._buffered:
            self._buffered_since = self._now
        self._buffered += len(data)
        if buf is None:
            buf = st.buf = bytearray(data)
        else:
            buf += data
        limit = self._limits.max_message
        done = False
        while len(buf) >= 5:
            if buf[0] != 0:
                self.reset(sid, ErrorCode.PROTOCOL_ERROR)  # compressed: we offered none
                return done
            n = _HDR.unpack_from(buf, 1)[0]
            if n > limit:
                self.reset(sid, ErrorCode.ENHANCE_YOUR_CALM)  # message too large
                return done
            if len(buf) < 5 + n:
                break
            message = bytes(buf[5 : 5 + n])
            del buf[: 5 + n]
            self._buffered -= 5 + n
            if self._budget < self._limits.control_budget:
                self._budget += 1
            done = True
            self._handler.on_message(sid, message)
            if sid not in self.streams:
                return done
        if not buf:
            st.buf = None
        return done


def encode_trailers(status: int, message: str = "", *, headers: bool = False) -> bytes:
    """gRPC trailers (``grpc-status``, ``grpc-message`` percent-encoded); ``headers``: a
    trailers-only response (``:status 200`` and the content type come first)."""
    fields: list[tuple[bytes, bytes]] = []
    if headers:
        fields += [(b":status", b"200"), (b"content-type", b"application/grpc")]
    fields.append((b"grpc-status", str(status).encode()))
    if message:
        fields.append((b"grpc-message", _percent(message)))
    return encode_headers(fields)


def _percent(text: str) -> bytes:
    out = bytearray()
    for b in text.encode():
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


__all__ = [
    "GRPC_RESPONSE_HEADERS",
    "PREFACE",
    "ErrorCode",
    "H2Error",
    "H2Handler",
    "H2Limits",
    "H2Server",
    "encode_headers",
    "encode_trailers",
]
