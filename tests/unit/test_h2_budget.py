"""xds.h2conn's control-frame budget against the ways around it: a gRPC message gives one
frame back, not a whole new budget; a new stream costs one (given back by its request); an
empty CONTINUATION costs one. Honest churn (open, request, end) and keepalives stay free."""

from __future__ import annotations

import struct

import hpack
import pytest

from tests.unit.test_h2conn import (
    REQ_HEADERS,
    Recorder,
    connection_error,
    frame,
    fresh,
    grpc,
    opened,
    parse_frames,
)
from xds.h2conn import PREFACE, ErrorCode, H2Error, H2Limits, H2Server, encode_trailers

PING = frame(6, 0, 0, b"p" * 8)


def test_pings_between_tiny_messages_are_still_a_flood() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    opened(server)
    round_ = PING * 40 + frame(0, 0, 1, grpc(b""))  # 40 PINGs, then a 5-byte message
    assert connection_error(server, round_ * 100) is ErrorCode.ENHANCE_YOUR_CALM
    assert rec.kinds().count("message") < 10  # before: every message reset the whole budget


def test_a_message_per_control_frame_is_no_flood() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    opened(server)
    server.receive((PING + frame(0, 0, 1, grpc(b"ack"))) * 500)
    assert rec.kinds().count("message") == 500


class Refuser(Recorder):
    """Ends every stream at once with an error (as adsconn does for an unknown method)."""

    server: H2Server

    def on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], end: bool) -> None:
        super().on_headers(stream_id, headers, end)
        self.server.send_trailers(stream_id, encode_trailers(12, "unknown", headers=True))


def test_streams_opened_only_to_be_answered_with_an_error_are_budgeted() -> None:
    rec = Refuser()
    server = rec.server = H2Server(rec, H2Limits(control_budget=50))
    server.receive(PREFACE + frame(4, 0, 0))
    server.take_output()
    enc = hpack.Encoder()
    data = b"".join(frame(1, 0x5, sid, enc.encode(REQ_HEADERS)) for sid in range(1, 400, 2))
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM
    assert rec.kinds().count("headers") <= 51  # before: all 200 answered, nothing spent


def test_honest_stream_churn_is_no_flood() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    enc = hpack.Encoder()
    for sid in range(1, 1000, 2):  # 500 streams: open, one request, half-close
        server.receive(
            frame(1, 0x4, sid, enc.encode(REQ_HEADERS)) + frame(0, 0x1, sid, grpc(b"req"))
        )
        server.reset(sid, ErrorCode.NO_ERROR)
    assert rec.kinds().count("message") == 500


def test_empty_continuations_are_budgeted() -> None:
    server, _ = fresh(H2Limits(control_budget=50))
    block = hpack.Encoder().encode(REQ_HEADERS)
    data = frame(1, 0x0, 1, block) + frame(9, 0, 1) * 100 + frame(9, 0x4, 1)
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM


def test_a_few_empty_continuations_still_end_the_block() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    block = hpack.Encoder().encode(REQ_HEADERS)
    server.receive(frame(1, 0x0, 1, block) + frame(9, 0, 1) * 3 + frame(9, 0x4, 1))
    assert rec.kinds() == ["headers"]


def test_the_budget_never_grows_beyond_its_size() -> None:
    server, _ = fresh(H2Limits(control_budget=50))
    opened(server)
    server.receive(frame(0, 0, 1, grpc(b"m")) * 1000)  # 1000 messages bank nothing
    with pytest.raises(H2Error):
        server.receive(PING * 51)


def test_a_window_update_flood_is_refused() -> None:
    server, _ = fresh(H2Limits(control_budget=50))
    opened(server)
    one = struct.pack(">I", 1)
    data = frame(8, 0, 0, one) * 30 + frame(8, 0, 1, one) * 30  # connection, then stream
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM


def test_window_updates_for_data_received_are_no_flood() -> None:
    """A client answering every DATA frame with a stream and a connection WINDOW_UPDATE while
    the server sends 200 frames, with a budget of 20."""
    server, _ = fresh(H2Limits(control_budget=20))
    opened(server)
    server.send_headers(1)
    server.take_output()
    for _ in range(200):
        assert server.send_message(1, b"r" * 1000)
        sent = [f for f in parse_frames(server.take_output()) if f[0] == 0]
        assert len(sent) == 1 and len(sent[0][3]) == 1005
        update = struct.pack(">I", 1005)
        server.receive(frame(8, 0, 1, update) + frame(8, 0, 0, update))
    assert not server.goaway_sent
    assert server.pending(1) == 0


def test_a_message_dripped_in_one_byte_frames_is_a_flood() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    opened(server)
    body = grpc(b"m" * 200)
    data = b"".join(frame(0, 0, 1, body[i : i + 1]) for i in range(len(body)))
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM
    assert "message" not in rec.kinds()


def test_messages_in_a_few_frames_each_are_no_flood() -> None:
    server, rec = fresh(H2Limits(control_budget=50))
    opened(server)
    body = grpc(b"m" * 3000)  # 3 frames each: two of 1,100 bytes, then the end
    one = b"".join(frame(0, 0, 1, body[i : i + 1100]) for i in range(0, len(body), 1100))
    server.receive(one * 200)
    assert rec.kinds().count("message") == 200


def test_goaway_frames_are_budgeted() -> None:
    server, _ = fresh(H2Limits(control_budget=50))
    data = frame(7, 0, 0, struct.pack(">II", 0, 0)) * 60
    assert connection_error(server, data) is ErrorCode.ENHANCE_YOUR_CALM
