"""The lean ADS transport's timeouts cost nothing per busy connection: a connection with an open
stream holds no listener timer (10,000 streams re-arming one every body timeout cost the event
loop ~7 ms of CPU a second), and a stream ended by the server (a deadline) still leaves its
connection to the idle timeout, without the peer sending anything."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.integration.test_ads_lean import (
    SOTW,
    connect,
    healthy_stream,
    plane,
    sotw,
    still_served,
)


def _live_timers() -> int:
    loop = asyncio.get_running_loop()
    return sum(not h.cancelled() for h in loop._scheduled)  # type: ignore[attr-defined]


async def test_busy_connections_hold_no_timer(tmp_path: Path) -> None:
    async with plane(tmp_path, idle_timeout=0.3) as p:
        await healthy_stream(p)  # warm: whatever the first connection arms once
        await asyncio.sleep(0.5)
        before = _live_timers()
        clients = [await healthy_stream(p) for _ in range(12)]
        await asyncio.sleep(0.5)  # each connection's idle timer, armed before its stream, fired
        assert _live_timers() - before < 3  # not one (or more) per connection
        for c, sid in clients:
            assert not c.lost.is_set()  # busy: not idle
            await still_served(c, sid)


async def test_a_stream_the_server_ended_leaves_its_silent_connection_to_the_idle_timeout(
    tmp_path: Path,
) -> None:
    # The stream outlives the idle timer the connection armed before it opened; the body
    # timeout (how often a busy connection was polled) is far beyond the wait: the listener
    # learns of the end from the connection, not from a poll.
    async with plane(tmp_path, idle_timeout=0.4, body_timeout=60) as p:
        c = await connect(p)
        sid = c.call(SOTW, (b"grpc-timeout", b"1000m"))
        c.send(sid, sotw())
        await c.until(lambda: c.messages(sid))
        status = await c.until(lambda: c.status(sid), within=4)
        assert status[b"grpc-status"] == b"4"  # DEADLINE_EXCEEDED, ended by the server
        await asyncio.wait_for(c.lost.wait(), 3)
        assert p.refused == ["idle_timeout"]
