"""Waiting in tests for something another task, thread or process makes true: poll a
predicate until it holds, or fail the test when ``within`` seconds have passed.

Three shapes, one behaviour: ``until`` (a plain predicate, polled from a coroutine: the loop runs
meanwhile), ``until_awaited`` (a coroutine predicate: a metrics scrape, an Envoy's stats) and
``until_blocking`` (from a test without a loop: the other side runs on its own threads; returns
how long it took). A timeout raises ``TimeoutError`` (the async ones) or fails an assertion
naming what was awaited.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def until(check: Callable[[], object], within: float = 5.0, every: float = 0.01) -> None:
    """Poll ``check()`` every ``every`` s until it is true (``TimeoutError`` after ``within``)."""
    async with asyncio.timeout(within):
        while not check():
            await asyncio.sleep(every)


async def until_awaited(
    check: Callable[[], Awaitable[object]], within: float = 5.0, every: float = 0.01
) -> None:
    """Poll ``await check()`` every ``every`` s until it is true (``TimeoutError`` after
    ``within``: a check that hangs counts against it too)."""
    async with asyncio.timeout(within):
        while not await check():
            await asyncio.sleep(every)


def until_blocking(
    check: Callable[[], object], within: float = 10.0, every: float = 0.02, what: str = ""
) -> float:
    """Poll ``check()`` every ``every`` s, sleeping this thread, until it is true; the seconds
    it took. Fails the test after ``within``."""
    start = time.monotonic()
    while not check():
        elapsed = time.monotonic() - start
        assert elapsed < within, f"timed out after {within} s{': ' + what if what else ''}"
        time.sleep(every)
    return time.monotonic() - start


__all__ = ["until", "until_awaited", "until_blocking"]
