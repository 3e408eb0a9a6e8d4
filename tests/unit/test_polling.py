"""tests.polling: a wait ends as soon as its predicate holds, and fails the test when it never
does (a helper that waited forever, or passed without waiting, would hide a broken test)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.polling import until, until_awaited, until_blocking


async def test_until_returns_once_the_predicate_holds_and_times_out_otherwise() -> None:
    flag = {"set": False}
    asyncio.get_running_loop().call_later(0.05, flag.update, {"set": True})
    await until(lambda: flag["set"], within=2.0)
    assert flag["set"]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await until(lambda: False, within=0.1)
    assert 0.1 <= time.monotonic() - started < 1.0


async def test_until_awaited_awaits_the_predicate_and_a_hanging_one_times_out() -> None:
    calls = 0

    async def third_time() -> bool:
        nonlocal calls
        calls += 1
        return calls >= 3

    await until_awaited(third_time, within=2.0, every=0.001)
    assert calls == 3

    async def hangs() -> bool:
        await asyncio.sleep(10)
        return True

    with pytest.raises(TimeoutError):
        await until_awaited(hangs, within=0.1)


def test_until_blocking_waits_for_another_thread_and_fails_with_what_it_waited_for() -> None:
    done = threading.Event()
    threading.Timer(0.05, done.set).start()
    took = until_blocking(done.is_set, within=2.0, every=0.005)
    assert done.is_set() and 0.0 < took < 2.0
    with pytest.raises(AssertionError, match=r"timed out after 0\.05 s: the leader"):
        until_blocking(lambda: False, within=0.05, every=0.01, what="the leader")
