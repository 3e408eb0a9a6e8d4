"""xds.adsconn's woken streams are pushed on the next turn of the loop, in the order they
were woken, all of them even when one push fails (reported to the loop's handler); one turn
pushes for a bounded slice of time, and the loop serves other callbacks between slices."""

from __future__ import annotations

import asyncio
from typing import Any

from xds.adsconn import _Call, _Pushes


class _Conn:
    def __init__(self, log: list[str], fail: bool = False, tick: list[float] | None = None) -> None:
        self.log = log
        self.fail = fail
        self.tick = tick

    def push(self, call: _Call) -> None:
        self.log.append(call.node)
        if self.tick is not None:
            self.tick[0] += 1.0  # each push takes one second of the fake clock
        if self.fail:
            raise RuntimeError(f"push of {call.node} failed")


def _named(name: str) -> _Call:
    # (a real call: the compiled module checks the type; its node names it here)
    call = _Call(1, True)
    call.node = name
    return call


async def test_pushes_run_next_turn_in_wake_order() -> None:
    log: list[str] = []
    pushes = _Pushes()
    a, b = _Conn(log), _Conn(log)
    for conn, call in ((a, "a1"), (b, "b1"), (a, "a2")):
        pushes.add(conn, _named(call))
    assert log == []  # not during the change that woke them
    await asyncio.sleep(0)
    assert log == ["a1", "b1", "a2"]
    pushes.add(b, _named("b2"))  # a later wake: its own turn
    await asyncio.sleep(0)
    assert log == ["a1", "b1", "a2", "b2"]


async def test_a_failing_push_does_not_hold_back_the_others() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        log: list[str] = []
        pushes = _Pushes()
        pushes.add(_Conn(log, fail=True), _named("bad"))
        pushes.add(_Conn(log), _named("good"))
        await asyncio.sleep(0)
        assert log == ["bad", "good"]
        assert [str(ctx["exception"]) for ctx in reported] == ["push of bad failed"]
    finally:
        loop.set_exception_handler(None)


async def test_a_turn_pushes_one_slice_and_the_loop_runs_between_slices() -> None:
    clock = [0.0]
    log: list[str] = []
    # a slice of 20 s, the clock looked at every 8 pushes: 24 pushes per turn (8, 16: in time)
    pushes = _Pushes(slice_s=20.0, clock=lambda: clock[0])
    conn = _Conn(log, tick=clock)
    for i in range(60):
        pushes.add(conn, _named(f"p{i}"))
    loop = asyncio.get_running_loop()
    loop.call_soon(log.append, "other")  # a callback that was ready before the pushes ran
    await asyncio.sleep(0)
    assert log == [f"p{i}" for i in range(24)] + ["other"]
    pushes.add(conn, _named("late"))  # woken while 36 wait: after them
    for _ in range(3):
        await asyncio.sleep(0)
    assert log == [f"p{i}" for i in range(24)] + ["other"] + [f"p{i}" for i in range(24, 60)] + [
        "late"
    ]


async def test_the_rest_of_a_slice_waits_for_the_next_turn() -> None:
    clock = [0.0]
    log: list[str] = []
    pushes = _Pushes(slice_s=0.5, clock=lambda: clock[0])
    conn = _Conn(log, tick=clock)
    for i in range(20):
        pushes.add(conn, _named(f"p{i}"))
    await asyncio.sleep(0)
    assert len(log) == 8  # over its slice at the first look at the clock
    await asyncio.sleep(0)
    assert len(log) == 16
    await asyncio.sleep(0)
    assert log == [f"p{i}" for i in range(20)]
    await asyncio.sleep(0)
    assert len(log) == 20  # nothing pushed twice
