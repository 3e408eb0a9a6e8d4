"""xds.adsconn under a peer that stops reading: the connection stops reading too (what the
peer sends and is answered would otherwise pile up in the write buffer until the write
timeout), and reads again once the peer drains; frames sent meanwhile are processed then."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.unit.test_h2conn import frame, parse_frames
from xds.adsconn import LeanAds
from xds.cache import SnapshotCache
from xds.h2conn import PREFACE
from xds.server import AdsServer


class Socketish(asyncio.Transport):
    """What an asyncio socket transport does that the connection uses: bytes written are
    kept, reading can be paused and resumed."""

    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.reading = True
        self.closing = False

    def write(self, data: Any) -> None:
        self.written += data

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_reading(self) -> bool:
        return self.reading

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def test_a_peer_that_stops_reading_is_not_read_from_until_it_drains() -> None:
    lean = LeanAds(AdsServer(SnapshotCache()))
    conn = lean.protocol()
    transport = Socketish()
    conn.connection_made(transport)
    conn.data_received(PREFACE + frame(4, 0, 0))
    conn.pause_writing()  # the socket's buffer passed its high-water mark
    assert not transport.is_reading()
    conn.resume_writing()
    assert transport.is_reading()
    conn.data_received(frame(6, 0, 0, b"12345678"))
    pongs = [f for f in parse_frames(bytes(transport.written)) if f[0] == 6]
    assert pongs == [(6, 1, 0, b"12345678")]  # the connection still serves after resuming
    conn.connection_lost(None)


async def test_resuming_a_closing_transport_does_not_read_again() -> None:
    lean = LeanAds(AdsServer(SnapshotCache()))
    conn = lean.protocol()
    transport = Socketish()
    conn.connection_made(transport)
    conn.pause_writing()
    transport.close()
    conn.resume_writing()
    assert not transport.is_reading()
    conn.connection_lost(None)
