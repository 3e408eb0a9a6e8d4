"""xds.h2conn, the lean HTTP/2 server core: against h2's client (interop), hand-made frames
(hostile input), and hypothesis (flow control never exceeded; the frame parser never fails
other than with H2Error)."""

from __future__ import annotations

import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xds.h2conn import (
    GRPC_RESPONSE_HEADERS,
    PREFACE,
    ErrorCode,
    H2Error,
    H2Limits,
    H2Server,
    encode_trailers,
)

REQ_HEADERS = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/svc/Method"),
    (":authority", "cp"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        self.events.append(("headers", stream_id, dict(headers), end))

    def on_message(self, stream_id: int, message: bytes) -> None:
        self.events.append(("message", stream_id, message))

    def on_end(self, stream_id: int) -> None:
        self.events.append(("end", stream_id))

    def on_reset(self, stream_id: int, code: int) -> None:
        self.events.append(("reset", stream_id, code))

    def kinds(self) -> list[str]:
        return [e[0] for e in self.events]


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return bytes((n >> 16, n >> 8 & 0xFF, n & 0xFF, kind, flags)) + struct.pack(">I", sid) + payload


def grpc(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


def parse_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, i = [], 0
    while i < len(data):
        n = data[i] << 16 | data[i + 1] << 8 | data[i + 2]
        out.append(
            (
                data[i + 3],
                data[i + 4],
                struct.unpack(">I", data[i + 5 : i + 9])[0],
                data[i + 9 : i + 9 + n],
            )
        )
        i += 9 + n
    return out


class Pair:
    """An h2 client talking to an H2Server through memory."""

    def __init__(self, limits: H2Limits | None = None, **client_settings: int) -> None:
        self.rec = Recorder()
        self.server = H2Server(self.rec, limits or H2Limits())
        self.client = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.client.initiate_connection()
        if client_settings:
            self.client.update_settings(
                {getattr(h2.settings.SettingCodes, k): v for k, v in client_settings.items()}
            )
        self.client_events: list[Any] = []
        self.pump()

    def pump(self) -> None:
        for _ in range(20):
            a = self.client.data_to_send()
            if a:
                self.server.receive(a)
            b = self.server.take_output()
            if b:
                self.client_events += self.client.receive_data(b)
            if not a and not b:
                return

    def open(self, body: bytes = b"", end: bool = False) -> int:
        sid = self.client.get_next_available_stream_id()
        self.client.send_headers(sid, REQ_HEADERS, end_stream=end and not body)
        for i in range(0, len(body), 16_384):
            chunk = body[i : i + 16_384]
            self.client.send_data(sid, chunk, end_stream=end and i + 16_384 >= len(body))
            self.pump()
        self.pump()
        return sid

    def received(self, sid: int) -> bytes:
        return b"".join(
            e.data
            for e in self.client_events
            if isinstance(e, h2.events.DataReceived) and e.stream_id == sid
        )


def test_a_grpc_call_round_trip_with_h2s_client() -> None:
    p = Pair()
    sid = p.open(grpc(b"hello") + grpc(b"") + grpc(b"x" * 40_000))
    assert p.rec.events[0][:2] == ("headers", sid)
    assert p.rec.events[0][2][b":path"] == b"/svc/Method"
    assert [e for e in p.rec.events if e[0] == "message"] == [
        ("message", sid, b"hello"),
        ("message", sid, b""),
        ("message", sid, b"x" * 40_000),
    ]
    p.server.send_headers(sid, GRPC_RESPONSE_HEADERS)
    assert p.server.send_message(sid, b"answer")
    p.server.send_trailers(sid, encode_trailers(0))
    p.pump()
    assert p.received(sid) == grpc(b"answer")
    responses = [e for e in p.client_events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(responses[0].headers)[b":status"] == b"200"
    trailers = [e for e in p.client_events if isinstance(e, h2.events.TrailersReceived)]
    assert dict(trailers[0].headers)[b"grpc-status"] == b"0"
    assert sid not in p.server.streams


def test_our_settings_carry_the_limits_and_the_peers_are_acked() -> None:
    p = Pair(H2Limits(max_streams=3, max_header_list_size=4096, window=1 << 20))
    remote = p.client.remote_settings
    assert remote.max_concurrent_streams == 3
    assert remote.max_header_list_size == 4096
    assert remote.initial_window_size == 1 << 20
    assert p.client.outbound_flow_control_window == 1 << 20
    assert any(isinstance(e, h2.events.SettingsAcknowledged) for e in p.client_events)


def test_never_sends_beyond_the_peers_window_and_resumes_on_window_update() -> None:
    p = Pair(INITIAL_WINDOW_SIZE=100)
    sid = p.open(grpc(b"req"))
    p.server.send_headers(sid)
    p.server.send_message(sid, b"y" * 1000)
    p.pump()
    assert len(p.received(sid)) == 100
    assert p.server.pending(sid) == 1005 - 100
    p.server.send_trailers(sid, encode_trailers(0))  # waits behind the data
    p.pump()
    assert not any(isinstance(e, h2.events.TrailersReceived) for e in p.client_events)
    p.client.increment_flow_control_window(2000, stream_id=sid)
    p.pump()
    assert p.received(sid) == grpc(b"y" * 1000)
    assert any(isinstance(e, h2.events.TrailersReceived) for e in p.client_events)


def test_messages_larger_than_the_peers_frame_size_are_split() -> None:
    p = Pair(MAX_FRAME_SIZE=16_384)
    sid = p.open(grpc(b"req"))
    p.client.increment_flow_control_window(1 << 20, stream_id=sid)
    p.client.increment_flow_control_window(1 << 20)
    p.pump()
    p.server.send_headers(sid)
    p.server.send_message(sid, b"z" * 50_000)
    out = p.server.take_output()
    sizes = [len(f[3]) for f in parse_frames(out) if f[0] == 0]
    assert max(sizes) <= 16_384 and sum(sizes) == 50_005
    p.client_events += p.client.receive_data(out)
    assert p.received(sid) == grpc(b"z" * 50_000)


def test_ping_is_answered_and_settings_change_the_window_of_open_streams() -> None:
    p = Pair(INITIAL_WINDOW_SIZE=10)
    sid = p.open(grpc(b"req"))
    p.server.send_headers(sid)
    p.server.send_message(sid, b"a" * 50)
    p.client.ping(b"12345678")
    p.client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    p.pump()
    acks = [e for e in p.client_events if isinstance(e, h2.events.PingAckReceived)]
    assert acks and acks[0].ping_data == b"12345678"
    assert p.received(sid) == grpc(b"a" * 50)


def test_concurrent_streams_beyond_the_limit_are_refused() -> None:
    p = Pair(H2Limits(max_streams=1))
    p.open(grpc(b"1"))
    # h2 itself would not open a second stream past the limit: send the frame by hand
    block = hpack.Encoder().encode(REQ_HEADERS)
    p.server.receive(frame(1, 0x4, 3, block))
    frames = parse_frames(p.server.take_output())
    assert (3, 0, 3, struct.pack(">I", ErrorCode.REFUSED_STREAM)) in frames
    assert [e[1] for e in p.rec.events if e[0] == "headers"] == [1]


def fresh(limits: H2Limits | None = None) -> tuple[H2Server, Recorder]:
    rec = Recorder()
    server = H2Server(rec, limits or H2Limits())
    server.receive(PREFACE + frame(4, 0, 0))
    server.take_output()
    return server, rec


def opened(server: H2Server, sid: int = 1) -> None:
    server.receive(frame(1, 0x4, sid, hpack.Encoder().encode(REQ_HEADERS)))


def connection_error(server: H2Server, data: bytes) -> ErrorCode:
    with pytest.raises(H2Error) as info:
        server.receive(data)
    goaway = [f for f in parse_frames(server.take_output()) if f[0] == 7]
    assert goaway, "a connection error sends GOAWAY"
    assert struct.unpack(">I", goaway[0][3][4:8])[0] == info.value.code
    return info.value.code


def test_a_bad_preface_is_a_protocol_error() -> None:
    server = H2Server(Recorder(), H2Limits())
    assert connection_error(server, b"GET / HTTP/1.1\r\n\r\n") is ErrorCode.PROTOCOL_ERROR


def test_the_first_frame_must_be_settings() -> None:
    server = H2Server(Recorder(), H2Limits())
    assert connection_error(server, PREFACE + frame(6, 0, 0, b"x" * 8)) is ErrorCode.PROTOCOL_ERROR


def test_an_oversized_frame_is_a_frame_size_error_before_it_is_buffered() -> None:
    server, _ = fresh()
    header_only = bytes((0x01, 0x00, 0x00, 0, 0)) + struct.pack(">I", 1)  # 65536 bytes announced
    assert connection_error(server, header_only) is ErrorCode.FRAME_SIZE_ERROR


def test_received_data_is_handed_on_and_the_windows_replenished() -> None:
    server, rec = fresh()
    opened(server)
    body = grpc(b"q" * 100_000)
    for i in range(0, len(body), 16_384):
        server.receive(frame(0, 0, 1, body[i : i + 16_384]))
    assert ("message", 1, b"q" * 100_000) in rec.events
    updates = [f for f in parse_frames(server.take_output()) if f[0] == 8]
    granted = {0: 0, 1: 0}
    for _, _, sid, payload in updates:
        granted[sid] += struct.unpack(">I", payload)[0]
    # what was consumed is granted again (the peer never waits on us), never more
    assert 0 < granted[0] <= len(body) and 0 < granted[1] <= len(body)
    assert len(body) - granted[0] < 65_535 // 2


def test_header_flood_through_continuations_is_refused() -> None:
    server, _ = fresh(H2Limits(max_header_list_size=1024))
    data = frame(1, 0, 1, b"\x00" * 100) + frame(9, 0, 1, b"\x00" * 1000)
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM


def test_a_decoded_header_list_beyond_the_limit_is_refused() -> None:
    server, _ = fresh(H2Limits(max_header_list_size=1024))
    enc = hpack.Encoder()
    first = enc.encode([*REQ_HEADERS, ("x-big", "v" * 400)])
    server.receive(frame(1, 0x5, 1, first))
    # the same header again costs 1 byte on the wire (indexed) but counts in full decoded
    again = enc.encode([*REQ_HEADERS, *([("x-big", "v" * 400)] * 4)])
    assert len(again) < 1024
    assert connection_error(server, frame(1, 0x5, 3, again)) is ErrorCode.ENHANCE_YOUR_CALM


def test_continuation_must_follow_headers_on_the_same_stream() -> None:
    server, _ = fresh()
    assert connection_error(server, frame(9, 0x4, 1, b"")) is ErrorCode.PROTOCOL_ERROR
    server, _ = fresh()
    data = frame(1, 0, 1, b"\x82") + frame(6, 0, 0, b"x" * 8)
    assert connection_error(server, data) is ErrorCode.PROTOCOL_ERROR


def test_ping_and_settings_floods_are_refused() -> None:
    server, _ = fresh(H2Limits(control_budget=50))
    assert connection_error(server, frame(6, 0, 0, b"p" * 8) * 60) is ErrorCode.ENHANCE_YOUR_CALM
    server, _ = fresh(H2Limits(control_budget=50))
    assert connection_error(server, frame(4, 0, 0) * 60) is ErrorCode.ENHANCE_YOUR_CALM


def test_keepalive_pings_spread_over_time_are_no_flood() -> None:
    server, _ = fresh(H2Limits(control_budget=50, budget_seconds=10.0))
    opened(server)
    for i in range(500):  # 500 pings, one a second: no gRPC message all along
        server.receive(frame(6, 0, 0, b"p" * 8), now=float(i))
    assert sum(1 for f in parse_frames(server.take_output()) if f[0] == 6) == 500
    with pytest.raises(H2Error):  # but 51 within the window are
        server.receive(frame(6, 0, 0, b"p" * 8) * 51, now=1000.0)


def test_rapid_reset_is_refused() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    enc = hpack.Encoder()
    data = b"".join(
        frame(1, 0x4, sid, enc.encode(REQ_HEADERS)) + frame(3, 0, sid, struct.pack(">I", 8))
        for sid in range(1, 200, 2)
    )
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM
    assert rec.kinds().count("reset") <= 51


def test_a_grpc_message_beyond_the_limit_resets_the_stream_only() -> None:
    server, rec = fresh(H2Limits(max_message=1000))
    opened(server)
    server.receive(frame(0, 0, 1, b"\x00" + struct.pack(">I", 1001)))
    assert ("reset", 1, ErrorCode.ENHANCE_YOUR_CALM) in rec.events
    assert (3, 0, 1, struct.pack(">I", ErrorCode.ENHANCE_YOUR_CALM)) in parse_frames(
        server.take_output()
    )
    opened(server, 3)  # the connection serves on
    assert ("headers", 3) in [e[:2] for e in rec.events]


def test_compressed_messages_and_truncated_messages_reset_the_stream() -> None:
    server, rec = fresh()
    opened(server)
    server.receive(frame(0, 0, 1, b"\x01\x00\x00\x00\x01x"))
    assert ("reset", 1, ErrorCode.PROTOCOL_ERROR) in rec.events
    opened(server, 3)
    server.receive(frame(0, 0x1, 3, b"\x00\x00\x00\x00\x09abc"))
    assert ("reset", 3, ErrorCode.PROTOCOL_ERROR) in rec.events


def test_window_overflow_and_zero_increment() -> None:
    server, rec = fresh()
    opened(server)
    server.receive(frame(8, 0, 1, struct.pack(">I", 0)))
    assert ("reset", 1, ErrorCode.PROTOCOL_ERROR) in rec.events
    server, _ = fresh()
    code = connection_error(server, frame(8, 0, 0, struct.pack(">I", 2**31 - 1)))
    assert code is ErrorCode.FLOW_CONTROL_ERROR
    server, _ = fresh()
    assert (
        connection_error(server, frame(8, 0, 0, struct.pack(">I", 0))) is ErrorCode.PROTOCOL_ERROR
    )


def test_streams_must_be_odd_and_increasing() -> None:
    server, _ = fresh()
    enc = hpack.Encoder()
    assert (
        connection_error(server, frame(1, 0x4, 2, enc.encode(REQ_HEADERS)))
        is ErrorCode.PROTOCOL_ERROR
    )
    server, _ = fresh()
    opened(server, 5)
    assert (
        connection_error(server, frame(1, 0x4, 3, enc.encode(REQ_HEADERS)))
        is ErrorCode.STREAM_CLOSED
    )


def test_push_promise_from_a_client_and_bad_settings_are_errors() -> None:
    server, _ = fresh()
    assert (
        connection_error(server, frame(5, 0x4, 1, b"\x00\x00\x00\x02")) is ErrorCode.PROTOCOL_ERROR
    )
    server, _ = fresh()
    assert (
        connection_error(server, frame(4, 0, 0, b"\x00\x05\x00\x00\x00\x01"))
        is ErrorCode.PROTOCOL_ERROR
    )
    server, _ = fresh()
    bad = frame(4, 0, 0, b"\x00\x04\x80\x00\x00\x00")
    assert connection_error(server, bad) is ErrorCode.FLOW_CONTROL_ERROR


# -- hypothesis ----------------------------------------------------------------------------------

_frames = st.lists(
    st.tuples(
        st.integers(0, 12),  # type (including unknown ones)
        st.integers(0, 255),  # flags
        st.sampled_from([0, 1, 2, 3, 5, 2**31 - 1]),
        st.binary(max_size=64),
    ),
    max_size=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_frames, st.binary(max_size=40))
def test_fuzzed_frames_only_ever_raise_h2error(
    frames: list[tuple[int, int, int, bytes]], tail: bytes
) -> None:
    server, rec = fresh(H2Limits(control_budget=20))
    opened(server)
    data = b"".join(frame(k, f, s, p) for k, f, s, p in frames) + tail
    try:
        for i in range(0, len(data), 7):  # in small pieces: the parser resumes mid-frame
            server.receive(data[i : i + 7])
            if server.streams:
                for sid in list(server.streams):
                    server.send_message(sid, b"r" * 20)
    except H2Error as exc:
        assert isinstance(exc.code, ErrorCode)
        assert server.goaway_sent
    server.take_output()
    for e in rec.events:
        assert e[0] in {"headers", "message", "end", "reset"}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 5000),
    st.lists(
        st.one_of(
            st.tuples(st.just("msg"), st.integers(0, 3000)),
            st.tuples(st.just("conn"), st.integers(1, 4000)),
            st.tuples(st.just("stream"), st.integers(1, 4000)),
            st.tuples(st.just("init"), st.integers(0, 6000)),
        ),
        max_size=25,
    ),
)
def test_data_sent_never_exceeds_the_windows_granted(
    initial: int, ops: list[tuple[str, int]]
) -> None:
    server, _ = fresh()
    server.receive(frame(4, 0, 0, struct.pack(">HI", 4, initial)))
    opened(server)
    server.take_output()
    conn_granted, stream_granted, init = 65_535, initial, initial
    sent = queued = 0
    for op, n in ops:
        if op == "msg":
            server.send_message(1, b"m" * n)
            queued += n + 5
        elif op == "conn":
            server.receive(frame(8, 0, 0, struct.pack(">I", n)))
            conn_granted += n
        elif op == "stream":
            server.receive(frame(8, 0, 1, struct.pack(">I", n)))
            stream_granted += n
        else:
            server.receive(frame(4, 0, 0, struct.pack(">HI", 4, n)))
            stream_granted += n - init
            init = n
        before = sent
        for kind, _, sid, payload in parse_frames(server.take_output()):
            if kind == 0:
                assert sid == 1
                sent += len(payload)
                assert len(payload) <= 16_384
        if sent > before:  # what went out fit the windows granted at that moment
            assert sent <= conn_granted
            assert sent <= stream_granted
        assert sent + server.pending(1) == queued, "nothing lost, nothing duplicated"
        if server.pending(1):  # held back only when a window is exhausted
            assert sent >= min(conn_granted, stream_granted)


def test_no_hpack_table_is_kept_once_the_client_acknowledged_a_table_size_of_0() -> None:
    p = Pair()
    assert p.client.remote_settings.header_table_size == 0
    # (h2 saw our SETTINGS before its first HEADERS: each block starts with a size update)
    for n in range(3):
        sid = p.open(grpc(b"m%d" % n))
        assert ("message", sid, b"m%d" % n) in p.rec.events
        assert p.server._decoder is None  # nothing kept between header blocks
    assert [e[2][b":path"] for e in p.rec.events if e[0] == "headers"] == [b"/svc/Method"] * 3


def test_the_table_a_request_filled_before_the_ack_is_dropped_with_the_ack() -> None:
    """As Envoy does: the first HEADERS right after the preface, before our SETTINGS arrived
    (the client may use the default 4,096-byte table), then the SETTINGS ACK."""
    server, rec = fresh()
    enc = hpack.Encoder()
    server.receive(frame(1, 0x4, 1, enc.encode(REQ_HEADERS)))
    assert server._decoder is not None and list(server._decoder.header_table.dynamic_entries)
    server.receive(frame(4, 0x1, 0))
    assert server._decoder is None
    enc.header_table_size = 0  # what a client does on our SETTINGS: a size update comes first
    server.receive(frame(1, 0x4, 3, enc.encode(REQ_HEADERS)))
    assert [e[1] for e in rec.events if e[0] == "headers"] == [1, 3]
    assert server._decoder is None


def test_after_the_ack_the_table_can_neither_be_referenced_nor_grown() -> None:
    enc = hpack.Encoder()
    first = enc.encode(REQ_HEADERS)  # indexes entries in the peer's table (default size)
    for block in (
        enc.encode(REQ_HEADERS),  # references those entries: they were dropped
        b"\x3f\xe1\x1f" + hpack.Encoder().encode(REQ_HEADERS),  # a size update to 4096
    ):
        server, _ = fresh()
        server.receive(frame(1, 0x4, 1, first))
        server.receive(frame(4, 0x1, 0))  # the client's SETTINGS ACK
        assert connection_error(server, frame(1, 0x4, 3, block)) is ErrorCode.COMPRESSION_ERROR
