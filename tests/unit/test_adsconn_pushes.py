"""xds.adsconn's woken streams are pushed on the next turn of the loop, in the order they
were woken, all of them even when one push fails (reported to the loop's handler)."""

from __future__ import annotations

import asyncio
from typing import Any

from xds.adsconn import _Pushes


class _Conn:
    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log = log
        self.fail = fail

    def push(self, call: Any) -> None:
        self.log.append(call)
        if self.fail:
            raise RuntimeError(f"push of {call} failed")


async def test_pushes_run_next_turn_in_wake_order() -> None:
    log: list[str] = []
    pushes = _Pushes()
    a, b = _Conn(log), _Conn(log)
    for conn, call in ((a, "a1"), (b, "b1"), (a, "a2")):
        pushes.add(conn, call)  # type: ignore[arg-type]
    assert log == []  # not during the change that woke them
    await asyncio.sleep(0)
    assert log == ["a1", "b1", "a2"]
    pushes.add(b, "b2")  # type: ignore[arg-type]  # a later wake: its own turn
    await asyncio.sleep(0)
    assert log == ["a1", "b1", "a2", "b2"]


async def test_a_failing_push_does_not_hold_back_the_others() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        log: list[str] = []
        pushes = _Pushes()
        pushes.add(_Conn(log, fail=True), "bad")  # type: ignore[arg-type]
        pushes.add(_Conn(log), "good")  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert log == ["bad", "good"]
        assert [str(ctx["exception"]) for ctx in reported] == ["push of bad failed"]
    finally:
        loop.set_exception_handler(None)
