"""xds.h2conn's stream states against a client that breaks them: HEADERS after its own
END_STREAM is a stream error (the application hears the end once, then a reset), not a
second end."""

from __future__ import annotations

import hpack

from tests.unit.test_h2conn import REQ_HEADERS, frame, fresh, parse_frames
from xds.h2conn import ErrorCode


def test_headers_after_the_clients_end_stream_reset_the_stream() -> None:
    server, rec = fresh()
    enc = hpack.Encoder()
    server.receive(frame(1, 0x5, 1, enc.encode(REQ_HEADERS)))  # opened and half-closed
    server.take_output()
    server.receive(frame(1, 0x5, 1, enc.encode([("x-trailer", "1")])))  # "trailers" again
    assert rec.kinds() == ["headers", "end", "reset"]  # before: "end" twice
    assert rec.events[-1] == ("reset", 1, ErrorCode.STREAM_CLOSED)
    assert [f[0] for f in parse_frames(server.take_output())] == [3]
    assert 1 not in server.streams
    server.receive(frame(1, 0x5, 3, enc.encode(REQ_HEADERS)))  # the connection goes on
    assert rec.kinds()[-2:] == ["headers", "end"]
