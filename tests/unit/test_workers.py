"""attestmesh.controlplane.workers: the event loop's worker threads."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from attestmesh.controlplane.workers import WorkerThreads


def _worker_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}_")]


async def test_runs_off_the_loop_and_returns_results_and_errors() -> None:
    workers = WorkerThreads(2, "t-results")
    loop_thread = threading.get_ident()
    try:
        assert await workers.run(threading.get_ident) != loop_thread
        assert await workers.run(pow, 2, 10) == 1024
        with pytest.raises(ZeroDivisionError):
            await workers.run(divmod, 1, 0)
        with pytest.raises(RuntimeError, match="StopIteration"):  # a future refuses it as is
            await workers.run(next, iter(()))
        assert len(_worker_threads("t-results")) == 1  # one call at a time: one thread
    finally:
        workers.close()


async def test_threads_start_as_calls_wait_up_to_the_count() -> None:
    """Calls that block their threads: another thread starts whenever a call finds an earlier
    one still waiting, up to the count; the loop runs meanwhile, and the rest wait their turn."""
    workers = WorkerThreads(3, "t-block")
    release = threading.Event()
    try:
        blocked = []
        for _ in range(6):
            blocked.append(workers.run(release.wait, 10))
            await asyncio.sleep(0.02)  # the loop is free; a started thread takes the call
        assert len(_worker_threads("t-block")) == 3
        third = workers.run(pow, 3, 2)
        await asyncio.sleep(0.05)
        assert not third.done() and not any(f.done() for f in blocked)
        release.set()
        assert await asyncio.gather(*blocked, third) == [True] * 6 + [9]
        assert len(_worker_threads("t-block")) == 3
    finally:
        release.set()
        workers.close()


async def test_a_cancelled_caller_leaves_the_workers_serving() -> None:
    workers = WorkerThreads(1, "t-cancel")
    release = threading.Event()
    try:
        slow = asyncio.ensure_future(workers.run(release.wait, 10))
        await asyncio.sleep(0.01)
        slow.cancel()
        release.set()
        assert await workers.run(pow, 2, 3) == 8  # the cancelled one's result went nowhere
        assert slow.cancelled()
    finally:
        workers.close()


async def test_close_ends_the_threads_after_what_is_queued() -> None:
    workers = WorkerThreads(2, "t-close")
    pending = [workers.run(pow, 2, k) for k in range(20)]
    workers.close()
    assert await asyncio.gather(*pending) == [2**k for k in range(20)]
    for t in _worker_threads("t-close"):
        t.join(5)
    assert not _worker_threads("t-close")
    with pytest.raises(RuntimeError, match="closed"):
        workers.run(pow, 2, 2)


async def test_threads_start_on_first_use_and_end_when_it_is_collected() -> None:
    workers = WorkerThreads(3, "t-gc")
    assert not _worker_threads("t-gc")  # none until something runs
    assert await asyncio.gather(*(workers.run(pow, 2, k) for k in range(50))) == [
        2**k for k in range(50)
    ]
    threads = _worker_threads("t-gc")
    assert 1 <= len(threads) <= 3
    del workers
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_at_least_one_thread() -> None:
    with pytest.raises(ValueError):
        WorkerThreads(0, "t-none")
