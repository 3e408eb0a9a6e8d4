"""Worker threads for the event loop's blocking calls (verification, signing, CRLs).

``WorkerThreads.run(fn, *args)`` puts the call on a ``queue.SimpleQueue`` (one C call that never
waits for a worker) and returns an asyncio future; a worker resolves it with one
``call_soon_threadsafe``. ``concurrent.futures.ThreadPoolExecutor`` (what ``run_in_executor``
uses) does more on the loop for each call: a ``concurrent.futures.Future`` chained to an asyncio
one, a ``_WorkItem``, two module locks, and its idle ``Semaphore``, whose ``Condition`` lock its
workers take after every job: the loop thread can block on that lock and give the GIL to a
worker, then wait for it back. The pattern is ``xds.store.GroupCommitStore``'s.

Threads start as calls need them, up to ``count`` (one on the first call, another whenever a
call finds an earlier one still waiting), as ``ThreadPoolExecutor`` starts them: one client at a
time keeps one warm thread. They end when the ``WorkerThreads`` is collected or ``close``d
(what was queued before runs first); they hold no reference to it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_Job = tuple[
    asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[object, ...]
]


class WorkerThreads:
    def __init__(self, count: int, name: str) -> None:
        if count < 1:
            raise ValueError("at least one worker thread")
        self._count, self._name = count, name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads = 0  # started so far: one more whenever a call finds another waiting
        self._closed = False
        self._lock = threading.Lock()  # orders close() against the threads' start
        weakref.finalize(self, _stop, self._queue, count)  # (more stops than threads: harmless)

    def run(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """``fn(*args)`` on a worker thread; call on the event loop's thread."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")
        if self._threads < self._count and (not self._threads or self._queue.qsize() > 0):
            self._spawn()  # none yet, or a call still waits: every thread is busy
        fut: asyncio.Future[_T] = loop.create_future()
        self._queue.put((loop, fut, fn, args))
        return fut

    def close(self) -> None:
        """No more calls; the threads end once what is queued has run."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = self._threads
        _stop(self._queue, threads)

    def _spawn(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name} is closed")
            name = f"{self._name}_{self._threads}"
            self._threads += 1
        threading.Thread(target=_work, args=(self._queue,), name=name, daemon=True).start()


def _stop(q: queue.SimpleQueue[_Job | None], count: int) -> None:
    for _ in range(count):
        q.put(None)


def _work(q: queue.SimpleQueue[_Job | None]) -> None:
    while (job := q.get()) is not None:
        loop, fut, fn, args = job
        try:
            result = fn(*args)
        except BaseException as exc:  # the caller's to handle, as an executor's future would
            _deliver(loop, _fail, fut, exc)
        else:
            _deliver(loop, _settle, fut, result)
        del job, loop, fut, fn, args


def _deliver(
    loop: asyncio.AbstractEventLoop,
    how: Callable[[asyncio.Future[Any], Any], None],
    fut: asyncio.Future[Any],
    value: object,
) -> None:
    try:
        loop.call_soon_threadsafe(how, fut, value)
    except RuntimeError:  # the loop is closed: nobody waits for it any more
        log.debug("a worker's result arrived after its event loop closed")


def _settle(fut: asyncio.Future[Any], result: object) -> None:
    if not fut.done():  # (cancelled: the caller went away)
        fut.set_result(result)


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if isinstance(exc, StopIteration):  # a future refuses it (it would end a coroutine)
        exc = RuntimeError(f"a worker's call raised {exc!r}")
    if not fut.done():
        fut.set_exception(exc)


__all__ = ["WorkerThreads"]
