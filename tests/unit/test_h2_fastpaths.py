"""H2Server's fast paths (frames read from the received bytes when nothing is held back; a
DATA frame that is exactly one gRPC message handed on without buffering) give what the
general path gives: the same events, the same output and the same errors, however the bytes
are cut into reads and however the messages are cut into DATA frames."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.test_h2conn import frame, fresh, grpc, opened
from xds.h2conn import H2Error, H2Limits, H2Server

_MESSAGES = st.lists(
    st.tuples(
        st.sampled_from([1, 3]),  # stream
        st.binary(max_size=60),  # message
        st.lists(st.integers(1, 70), max_size=3),  # where it is cut into DATA frames
        st.booleans(),  # a stray byte of a compressed flag instead of 0
    ),
    max_size=12,
)


def _wire(messages: list[tuple[int, bytes, list[int], bool]]) -> bytes:
    out = bytearray()
    for sid, message, cuts, compressed in messages:
        body = grpc(message)
        if compressed:
            body = b"\x01" + body[1:]
        pos = 0
        for cut in sorted(set(cuts)):
            if pos < cut < len(body):
                out += frame(0, 0, sid, body[pos:cut])
                pos = cut
        out += frame(0, 0, sid, body[pos:])
    return bytes(out)


def _run(data: bytes, reads: list[int], limits: H2Limits) -> tuple[list[Any], bytes, Any]:
    server, rec = fresh(limits)
    opened(server, 1)
    opened(server, 3)
    error = None
    pos = 0
    sizes = [*reads, len(data)]
    try:
        for size in sizes:
            chunk = data[pos : pos + max(1, size)]
            pos += len(chunk)
            if chunk:
                server.receive(chunk)
        if pos < len(data):
            server.receive(data[pos:])
    except H2Error as exc:
        error = exc.code
    return rec.events, server.take_output(), error


def _one_read_at_a_time(data: bytes, limits: H2Limits) -> tuple[list[Any], bytes, Any]:
    """The general path throughout: one byte per read holds every frame back."""
    return _run(data, [1] * len(data), limits)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MESSAGES, st.lists(st.integers(1, 200), max_size=8), st.sampled_from([40, 64, 1 << 20]))
def test_fast_paths_equal_the_general_path(
    messages: list[tuple[int, bytes, list[int], bool]], reads: list[int], max_message: int
) -> None:
    limits = H2Limits(max_message=max_message)
    data = _wire(messages)
    assert _run(data, reads, limits) == _one_read_at_a_time(data, limits)


def test_a_whole_message_per_frame_is_handed_on() -> None:
    server, rec = fresh()
    opened(server)
    server.receive(frame(0, 0, 1, grpc(b"ack-1")) + frame(0, 0, 1, grpc(b"ack-2")))
    assert [e for e in rec.events if e[0] == "message"] == [
        ("message", 1, b"ack-1"),
        ("message", 1, b"ack-2"),
    ]
    assert isinstance(server, H2Server) and server.incomplete_since is None
