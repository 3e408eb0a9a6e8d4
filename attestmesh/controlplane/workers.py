"""Workers for the event loop's CPU-bound calls: threads (``WorkerThreads``: CRLs, and
verification and signing when no worker process can take them) and worker processes
(``WorkerProcesses``: attestations' verification and signing, ``certs.offload``).

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
import collections
import logging
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from certs import offload
from certs.ca import Leaf
from certs.errors import AttestmeshError
from certs.policy import Admitted

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


class OffloadUnavailable(Exception):
    """No worker process could take the job (none ready): the caller runs it itself."""


class WorkerLost(AttestmeshError):
    """The worker process holding the job died, or did not answer within ``JOB_TIMEOUT`` (it
    was killed): the request fails with a retry (HTTP 503); it is not run again here, where
    evidence that crashes or hangs a parser would take the control plane down with it."""

    def __init__(self, detail: str) -> None:
        super().__init__("attest_worker_failed", detail)


MAX_RESTART_DELAY = 60.0  # seconds, between attempts to start a worker that keeps failing
_HEADER = struct.Struct("!i")  # multiprocessing.connection's frame: a signed 32-bit length
_MAX_ANSWER = 1 << 24  # a leaf and its claims are a few KB


class _Worker(asyncio.Protocol):
    """The control plane's end of one worker process's pipe, on the event loop: a job is one
    frame written (the transport buffers, the loop never waits for the worker), its answer
    one frame read; a worker answers in order, so the futures wait in a queue."""

    def __init__(self, pool: WorkerProcesses, process: subprocess.Popen[bytes]) -> None:
        self.pool, self.process = pool, process
        self.transport: asyncio.Transport | None = None
        self.ready = False
        # the jobs sent, in order, each with the workload it is for and when it is overdue
        self.waiting: collections.deque[tuple[asyncio.Future[tuple[Admitted, Leaf]], str, float]]
        self.waiting = collections.deque()
        self._jobs = offload.JobEncoder()  # (what this worker was sent: by number after)
        self._buf = bytearray()
        self._watch: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def submit(self, job: offload.Job, timeout: float) -> asyncio.Future[tuple[Admitted, Leaf]]:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Admitted, Leaf]] = loop.create_future()
        frame = self._jobs.encode(job)
        self.transport.write(_HEADER.pack(len(frame)) + frame)
        due = loop.time() + timeout
        self.waiting.append((fut, job.req.workload, due))
        if self._watch is None:
            self._watch = loop.call_at(due, self._overdue)
        return fut

    def _overdue(self) -> None:
        """The watchdog (one timer per worker, not one per job): the oldest job still waiting
        is overdue, or the timer is set again for when it will be. A worker answers in order,
        so the oldest is the one it holds: a worker that holds one that long hangs, and is
        killed (its other jobs fail with it)."""
        self._watch = None
        if not self.waiting:
            return
        fut, workload, due = self.waiting[0]
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self._watch = loop.call_at(due, self._overdue)
            return
        log.error(
            "attestation worker process %s held a job of %s for %.0f s: killing it",
            self.process.pid, workload, self.pool.JOB_TIMEOUT,
        )  # fmt: skip
        self.waiting.popleft()
        if not fut.done():
            fut.set_exception(WorkerLost("the worker process verifying it did not answer; retry"))
        self.process.kill()
        if self.transport is not None:
            self.transport.abort()  # (its other jobs fail with WorkerLost)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        while len(buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buf)
            if not 0 <= size <= _MAX_ANSWER:
                self._fail(f"a frame of {size} bytes")
                return
            if len(buf) < _HEADER.size + size:
                return
            frame = bytes(buf[_HEADER.size : _HEADER.size + size])
            del buf[: _HEADER.size + size]
            self._answer(frame)

    def _answer(self, frame: bytes) -> None:
        if not self.ready:
            if frame != offload.READY:
                self._fail("no READY")
                return
            self.ready = True
            self.pool._worker_ready(self)
            return
        if not self.waiting:
            self._fail("an answer to no job")
            return
        fut = self.waiting.popleft()[0]
        try:
            answer = offload.decode_answer(frame)
        except Exception as exc:
            if not fut.done():
                fut.set_exception(WorkerLost("the worker process's answer was unreadable"))
            self._fail(f"an answer that does not decode: {exc!r}")
            return
        if fut.done():  # (cancelled: the caller went away)
            return
        if isinstance(answer, BaseException):  # its refusal, raised as on a thread
            fut.set_exception(answer)
        else:
            fut.set_result(answer)

    def _fail(self, why: str) -> None:
        log.error("attestation worker process %s: %s", self.process.pid, why)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        while self.waiting:
            fut = self.waiting.popleft()[0]
            if not fut.done():
                fut.set_exception(WorkerLost("the worker process verifying it ended; retry"))
        self.pool._worker_lost(self)


class WorkerProcesses:
    """Attestations' verification and signing in ``count`` worker processes
    (``certs.offload.serve``), so that the control plane's process keeps its one GIL for the
    event loop (HTTP, ADS, persistence): verification and signing on threads beside it cost
    the loop its turn again and again.

    Each process is a fresh interpreter (``python -m certs.offload``: it imports that module
    and what it needs, nothing of this process's; never a fork of a process whose threads may
    hold locks) that builds its verifiers from ``recipe``, and talks to the event loop over a
    socket pair: a job is written without waiting, its answer read when it comes; no thread of
    this process takes part. ``start`` starts them on a thread (an interpreter takes a moment
    to start); until a process has said it is ready, and when none is, ``run`` raises
    ``OffloadUnavailable`` and the caller verifies on its threads. A process that dies, or
    holds a job longer than ``JOB_TIMEOUT`` (then it is killed), fails its jobs with
    ``WorkerLost`` (never run again in this process: a crash or a hang in a parser stays in the
    worker) and is replaced; each ends when its socket closes (this process stopped or died)."""

    RESTART_DELAY = 1.0  # seconds before a dead worker's replacement starts
    # a job takes ~0.3 ms (sim) to tens of ms (a TDX quote and its collateral); one that takes
    # this long (queueing included) holds a hung worker, which is killed
    JOB_TIMEOUT = 10.0

    def __init__(self, count: int, recipe: offload.VerifierRecipe) -> None:
        if count < 1:
            raise ValueError("at least one worker process")
        self.count = count
        self._recipe = recipe
        self._workers: list[_Worker] = []  # connected (ready or not yet)
        self._ready: list[_Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.restarts = 0
        self._failing = 0  # workers lost in a row before one said it was ready

    @property
    def ready(self) -> bool:
        return bool(self._ready)

    def start(self, count: int | None = None) -> None:
        """Start ``count`` (default: all) processes, on a thread; call on the event loop."""
        if self._closed:
            return
        self._loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._spawn, args=(count or self.count,), name="attest-procs", daemon=True
        ).start()

    def _spawn(self, count: int) -> None:
        loop = self._loop
        assert loop is not None
        # the first frame a worker reads: where to import from (as this process does: a
        # recipe's function may live outside the installed packages), and the recipe
        hello = pickle.dumps((list(sys.path), self._recipe), protocol=pickle.HIGHEST_PROTOCOL)
        for _ in range(count):
            ours, theirs = socket.socketpair()
            try:
                with theirs:
                    process = subprocess.Popen(
                        [sys.executable, "-m", "certs.offload", str(theirs.fileno())],
                        pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                    )  # fmt: skip
                ours.sendall(_HEADER.pack(len(hello)) + hello)
            except Exception as exc:
                ours.close()
                log.warning("an attestation worker process did not start: %s", exc)
                return
            try:
                loop.call_soon_threadsafe(self._connect, process, ours)
            except RuntimeError:  # the loop closed meanwhile
                ours.close()
                process.kill()
                process.wait()
                return

    def _connect(self, process: subprocess.Popen[bytes], sock: socket.socket) -> None:
        if self._closed:
            sock.close()
            process.kill()
            process.wait()
            return
        worker = _Worker(self, process)
        self._workers.append(worker)
        task = asyncio.ensure_future(
            asyncio.get_running_loop().connect_accepted_socket(lambda: worker, sock)
        )
        task.add_done_callback(_log_failure)

    def _worker_ready(self, worker: _Worker) -> None:
        self._failing = 0
        self._ready.append(worker)
        log.info("attestation worker process %s ready", worker.process.pid)

    def _worker_lost(self, worker: _Worker) -> None:
        for group in (self._workers, self._ready):
            if worker in group:
                group.remove(worker)
        if self._closed:
            return  # (aclose reaps it)
        task = asyncio.ensure_future(asyncio.to_thread(_reap, [worker.process]))
        task.add_done_callback(_log_failure)
        self.restarts += 1
        if not worker.ready:  # it never started: back off (a bad recipe fails every time)
            self._failing += 1
        delay = self.restart_delay()
        log.error(
            "attestation worker process %s ended: starting another in %.1f s",
            worker.process.pid, delay,
        )  # fmt: skip
        assert self._loop is not None
        self._loop.call_later(delay, self.start, 1)

    def restart_delay(self) -> float:
        """Seconds before the next replacement starts: doubling with each worker in a row that
        died before it was ready, up to ``MAX_RESTART_DELAY``."""
        return min(MAX_RESTART_DELAY, self.RESTART_DELAY * float(2 ** min(self._failing, 16)))

    async def run(self, job: offload.Job) -> tuple[Admitted, Leaf]:
        """``certs.offload.run_job(job)`` in a worker process: its result, or the refusal it
        raised; ``OffloadUnavailable`` if no process could take it, ``WorkerLost`` if the one
        that took it died or hung with it."""
        if not self._ready:
            raise OffloadUnavailable("no worker process ready")
        worker = min(self._ready, key=lambda w: len(w.waiting))
        # the caller going away cancels the future: its answer, when it comes, is dropped
        return await worker.submit(job, self.JOB_TIMEOUT)

    async def aclose(self) -> None:
        """Stop every process: each sees its pipe close and exits (killed after 5 s)."""
        self._closed = True
        workers, self._workers, self._ready = self._workers, [], []
        for worker in workers:
            if worker.transport is not None:
                worker.transport.close()
        await asyncio.to_thread(_reap, [w.process for w in workers])


def _reap(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("attestation worker process: %s", task.exception())


__all__ = ["OffloadUnavailable", "WorkerLost", "WorkerProcesses", "WorkerThreads"]
