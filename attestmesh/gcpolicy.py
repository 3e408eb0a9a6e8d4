"""The control plane's garbage-collector policy: long-lived objects are kept out of the cycle
collector's scans, so a full collection never stops the event loop for a time that grows with
the mesh.

CPython's cycle collector traverses every tracked object on a full (generation 2) collection,
with the event loop stopped. The control plane's objects are overwhelmingly long-lived: the mesh
state, the snapshots, and each ADS stream's connection (TLS, HTTP/2 and gRPC state, ~300 tracked
objects per stream). Measured by ``benchmarks/bench_scale.py`` before this policy: at 1,000
streams ~420,000 tracked objects and full collections of 0.3-1.2 s that collected nothing, one of
them inside a quarantine (0.3 s of its 0.36 s CPU, and the decision waited for it).

The policy:

- everything alive once the control plane is up is frozen (``gc.freeze``: moved to the permanent
  generation, which collections do not scan);
- every ``interval_s`` the objects that survived since are frozen too, so automatic collections
  only ever scan what was allocated since the last tick;
- frozen objects that later become *cyclic* garbage (acyclic ones are still freed at once by
  reference counting) are reclaimed by one full collection (unfreeze, collect, freeze) when
  either (a) the connections closed since the last one exceed ``churn_ratio`` x the open ones
  (a closed connection's TLS/HTTP/2/gRPC objects are the cyclic garbage a server makes), or
  (b) the process's resident memory exceeds ``growth`` x what it was after the last full
  collection, scaled by how much the number of open connections grew since (a mesh that grows
  is not a leak; memory that grows without connections is). Resident memory is read from
  /proc (O(1)); counting the frozen objects (``gc.get_freeze_count``) walks all of them -- at
  10,000 streams ~4 million, 0.1-0.3 s with the loop stopped -- and is never done. Such
  pauses come in proportion to churn, not to mesh size x time, and memory held by garbage
  stays bounded. Full collections are spaced by at least ``min_spacing_s`` and ``duty`` x the
  last one's duration apart, so churn an unauthenticated peer can cause (connections opened
  and dropped) stalls the loop for at most 1/``duty`` of the time.

Start-up: :func:`hold_collections` (for the start-up to call before it loads the registrations
file, the store and the protobuf classes) turns automatic collection off until
:meth:`GcPolicy.start` freezes what is alive and turns it back on (:func:`release_collections`,
also for a start-up that fails). Start-up allocates millions of objects that stay alive (or die
acyclic, freed by reference counting); each full collection triggered on the way scans all of
them again. Measured at N=10,000 (``attestmesh controlplane`` until /healthz): 8 full
collections, 1.7 s of ~10 s CPU, 6 of them while the workloads file was parsed; a collection at
the end would free ~11,000 objects, frozen with the rest (reclaimed by a full collection, as
above).

The decision is pure (:func:`decide`); :class:`GcPolicy` applies it through injected collector
functions (the ``gc`` module's by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class GcAction(enum.Enum):
    FREEZE = "freeze"  # freeze the survivors since the last tick
    FULL = "full"  # unfreeze, collect everything once, freeze what is left


@dataclass(frozen=True, slots=True)
class GcLimits:
    growth: float = 2.0  # resident memory / expected resident memory that calls for a collection
    floor: int = 512 << 20  # expected resident bytes counted as at least this
    churn_ratio: float = 0.5  # connections closed since the last collection / open now
    churn_floor: int = 2_000  # ... counted as at least this many
    conn_smoothing: int = 1_000  # added to connection counts when scaling the expectation
    min_spacing_s: float = 60.0  # between the end of a full collection and the next
    duty: float = 20.0  # ... and at least this many times the last one's duration

    def __post_init__(self) -> None:
        if self.growth <= 1.0:
            raise ValueError(f"growth must be > 1, got {self.growth}")
        if self.churn_ratio <= 0 or self.floor < 0 or self.churn_floor < 0:
            raise ValueError("churn_ratio must be > 0, floor and churn_floor >= 0")
        if self.conn_smoothing < 1:
            raise ValueError("conn_smoothing must be >= 1")
        if self.min_spacing_s < 0 or self.duty < 0:
            raise ValueError("min_spacing_s and duty must be >= 0")


@dataclass(frozen=True, slots=True)
class GcSample:
    """What the policy looks at: resident memory and the connections, now and as they
    were right after the last full collection (the base)."""

    size: int  # resident memory, bytes
    open_connections: int
    closed_connections: int  # ever closed, process-wide (monotonic)


def decide(
    now: GcSample,
    base: GcSample,
    limits: GcLimits,
    since_full_s: float = float("inf"),
    last_full_s: float = 0.0,
) -> GcAction:
    """A full collection is due once the connections closed since ``base`` exceed
    ``churn_ratio`` x the open ones, or resident memory exceeds ``growth`` x what ``base``
    had, scaled by the growth in open connections -- and the last one ended
    ``since_full_s`` ago, past the spacing (it took ``last_full_s``); otherwise freeze the
    survivors."""
    if since_full_s < max(limits.min_spacing_s, limits.duty * last_full_s):
        return GcAction.FREEZE
    closed = now.closed_connections - base.closed_connections
    if closed > max(limits.churn_floor, limits.churn_ratio * now.open_connections):
        return GcAction.FULL
    k = limits.conn_smoothing
    scale = max(1.0, (now.open_connections + k) / (base.open_connections + k))
    expected = max(limits.floor, base.size * scale)
    return GcAction.FULL if now.size > limits.growth * expected else GcAction.FREEZE


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``; 0 where there is no /proc)."""
    try:
        return int(Path("/proc/self/statm").read_bytes().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_held = False  # automatic collection is off because hold_collections turned it off


def hold_collections() -> None:
    """Turn automatic collection off for start-up, until :func:`release_collections` (which
    :meth:`GcPolicy.start` calls). Does nothing when collection is already off (whoever turned it
    off keeps it so); idempotent."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release_collections() -> None:
    """Turn automatic collection back on if :func:`hold_collections` turned it off;
    idempotent (safe in a ``finally``)."""
    global _held
    if _held:
        _held = False
        gc.enable()


@dataclass(frozen=True, slots=True)
class Collector:
    """The collector functions the policy drives (``gc``'s by default; tests pass fakes)."""

    freeze: Callable[[], None] = gc.freeze
    unfreeze: Callable[[], None] = gc.unfreeze
    collect: Callable[[], int] = gc.collect
    size: Callable[[], int] = resident_bytes


class GcPolicy:
    """``connections()``: (open now, ever closed) over the process's listeners (by default
    :func:`attestmesh.listen.connection_totals`)."""

    def __init__(
        self,
        interval_s: float = 1.0,
        check_s: float = 30.0,
        limits: GcLimits | None = None,
        collector: Collector | None = None,
        connections: Callable[[], tuple[int, int]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.interval_s = interval_s
        # decide every ``check_s`` (full collections are minutes apart anyway)
        self.check_s = check_s
        self._checked = -float("inf")
        self.limits = limits or GcLimits()
        self._gc = collector or Collector()
        if connections is None:
            from attestmesh.listen import connection_totals

            connections = connection_totals
        self._connections = connections
        self._clock = clock
        self._base = GcSample(0, 0, 0)
        self._full_ended = -float("inf")
        self.full_collections = 0
        self.last_full_s = 0.0

    def _sample(self) -> GcSample:
        open_now, closed = self._connections()
        return GcSample(self._gc.size(), open_now, closed)

    def start(self) -> None:
        """Freeze everything alive now (call once the process is up: state loaded, served),
        then end a start-up :func:`hold_collections`."""
        self._gc.freeze()
        release_collections()
        self._base = self._sample()

    def tick(self) -> GcAction:
        t0 = self._clock()
        if t0 - self._checked < self.check_s:
            self._gc.freeze()
            return GcAction.FREEZE
        self._checked = t0
        action = decide(
            self._sample(), self._base, self.limits, t0 - self._full_ended, self.last_full_s
        )
        if action is GcAction.FULL:
            self._gc.unfreeze()
            collected = self._gc.collect()
            self._gc.freeze()
            self._base = self._sample()
            self.full_collections += 1
            self._full_ended = self._clock()
            self.last_full_s = self._full_ended - t0
            log.info(
                "full garbage collection: %d collected, %d MB resident after, %.3f s",
                collected,
                self._base.size >> 20,
                self.last_full_s,
            )
        else:
            self._gc.freeze()
        return action

    async def run(self, stop: asyncio.Event) -> None:
        """``start``, then ``tick`` every ``interval_s`` until ``stop`` is set."""
        self.start()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            if not stop.is_set():
                self.tick()


__all__ = [
    "Collector",
    "GcAction",
    "GcLimits",
    "GcPolicy",
    "GcSample",
    "decide",
    "hold_collections",
    "release_collections",
]
