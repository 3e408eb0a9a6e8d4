"""benchmarks.scale_floor.push_floor: a real server process writes to real mTLS connections
from a client process and reads their answers; it reports its own CPU and the wall time."""

from __future__ import annotations

from benchmarks.scale_floor import push_floor


def test_the_floor_of_a_fan_out_is_measured_through_real_connections() -> None:
    cpu, wall = push_floor(20, payload=3000, ack=150, rounds=3, timeout=120)
    # every round wrote to and read from 20 connections: some CPU, and no round can be
    # shorter in wall time than the server's own CPU in it (one thread)
    assert cpu > 0
    assert wall > 0
    assert cpu <= wall * 1.5  # medians of different rounds: the same order, not exactly
