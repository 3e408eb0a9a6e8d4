"""xds.h2conn bounds what a connection holds of incomplete gRPC messages by one message over
all its streams (the receive windows are given back as bytes arrive, so they bound nothing):
16 streams each holding 4 MiB minus a byte would otherwise be 64 MiB per connection, for as
long as the streams live. The stream that would pass the bound is reset; the others and the
connection go on, and what a closed stream held is given back."""

from __future__ import annotations

import struct

import hpack
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.test_h2conn import REQ_HEADERS, frame, fresh, grpc
from xds.h2conn import ErrorCode, H2Limits, H2Server


def _partial(sid: int, size: int, body: int) -> bytes:
    """DATA starting a gRPC message of ``size`` bytes, of which ``body`` are sent."""
    return frame(0, 0, sid, b"\x00" + struct.pack(">I", size) + b"m" * body)


def _open(server: H2Server, enc: hpack.Encoder, sid: int) -> None:
    server.receive(frame(1, 0x4, sid, enc.encode(REQ_HEADERS)))


def _held(server: H2Server) -> int:
    return sum(len(s.buf) for s in server.streams.values() if s.buf)


def test_a_second_stream_beyond_one_message_of_incomplete_data_is_reset() -> None:
    server, rec = fresh(H2Limits(max_message=1000))
    enc = hpack.Encoder()
    for sid in (1, 3):
        _open(server, enc, sid)
    server.receive(_partial(1, 1000, 900))
    server.receive(_partial(3, 1000, 200))  # before: held too (so on, for every stream)
    assert ("reset", 3, ErrorCode.ENHANCE_YOUR_CALM) in rec.events
    assert _held(server) == 905
    server.receive(frame(0, 0, 1, b"m" * 100))  # stream 1 completes its message
    assert ("message", 1, b"m" * 1000) in rec.events
    assert _held(server) == 0


def test_what_a_reset_stream_held_is_given_back() -> None:
    server, rec = fresh(H2Limits(max_message=1000))
    enc = hpack.Encoder()
    _open(server, enc, 1)
    server.receive(_partial(1, 1000, 900))
    server.receive(frame(3, 0, 1, struct.pack(">I", 8)))  # the client resets stream 1
    _open(server, enc, 3)
    server.receive(_partial(3, 1000, 900))
    assert server.streams[3].buf is not None and len(server.streams[3].buf) == 905
    assert not [e for e in rec.events if e[0] == "reset" and e[1] == 3]


def test_what_a_stream_ended_by_the_server_held_is_given_back() -> None:
    server, _ = fresh(H2Limits(max_message=1000))
    enc = hpack.Encoder()
    _open(server, enc, 1)
    server.receive(_partial(1, 1000, 900))
    server.send_trailers(1, b"")  # the application ends the stream
    _open(server, enc, 3)
    server.receive(_partial(3, 1000, 900))
    assert 3 in server.streams and _held(server) == 905


_ops = st.lists(
    st.tuples(
        st.sampled_from(["data", "done", "rst", "end"]),
        st.integers(0, 3),  # which of 4 streams
        st.integers(0, 700),  # bytes
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_incomplete_data_held_never_passes_one_message(ops: list[tuple[str, int, int]]) -> None:
    server, _ = fresh(H2Limits(max_message=1000, control_budget=10_000))
    enc = hpack.Encoder()
    sids = [1, 3, 5, 7]
    for sid in sids:
        _open(server, enc, sid)
    for op, i, n in ops:
        sid = sids[i]
        if sid not in server.streams:
            continue
        if op == "data":
            server.receive(_partial(sid, 1000, min(n, 995)))
        elif op == "done":
            server.receive(frame(0, 0, sid, grpc(b"x" * min(n, 995))))
        elif op == "rst":
            server.receive(frame(3, 0, sid, struct.pack(">I", 8)))
        else:
            server.send_trailers(sid, b"")
        assert _held(server) <= 1005  # one message and its prefix
    server.close_all()
    fresh_sid = 9
    _open(server, enc, fresh_sid)
    server.receive(_partial(fresh_sid, 1000, 995))  # nothing leaked: a whole message fits
    assert fresh_sid in server.streams
