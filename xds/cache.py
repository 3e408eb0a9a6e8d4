"""Snapshot cache: the latest snapshot per node, and watches that wake the streams serving it.

A watch is a latest-value slot plus an ``asyncio.Event``: ``set_snapshot`` never awaits, never
blocks on a slow consumer, and a consumer that wakes late simply reads the newest snapshot
(intermediate ones are skipped, which xDS allows). The cache knows no gRPC.

Snapshots may be built on demand: with a ``source``, ``get`` builds a node's snapshot the first
time it is asked for (a node with no stream costs nothing), and ``invalidate`` drops what a change
made stale, rebuilding at once only the nodes a stream is watching. Streams are woken in the
order ``set_snapshot``/``update``/``invalidate`` are called: a publisher decides who hears first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from xds.build import Snapshot


class Watch:
    """One stream's interest in one node. ``changed`` is set whenever a new snapshot lands."""

    __slots__ = ("changed", "node")

    def __init__(self, node: str) -> None:
        self.node = node
        self.changed = asyncio.Event()


Source = Callable[[str], Snapshot | None]
"""Builds a node's current snapshot (None: no such node)."""


class SnapshotCache:
    def __init__(self, source: Source | None = None) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._watches: dict[str, list[Watch]] = {}  # (a list: one watch per node, mostly)
        self._source = source
        self._settle: Callable[[str], None] | None = None
        self.built = 0  # snapshots built through the source (tests and benchmarks read it)

    def set_source(self, source: Source | None) -> None:
        self._source = source

    def set_settle(self, settle: Callable[[str], None] | None) -> None:
        """``settle(node)`` runs before ``get`` reads a node's snapshot: a publisher that
        patches held snapshots a chunk at a time brings the one asked for up to date first,
        so a reader never gets a snapshot older than the state last published."""
        self._settle = settle

    def set_snapshot(self, node: str, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` as ``node``'s configuration and wake its streams."""
        self._check(node, snapshot)
        self._snapshots[node] = snapshot
        for watch in self._watches.get(node, ()):
            watch.changed.set()

    def invalidate(self, nodes: Iterable[str]) -> None:
        """What these nodes' snapshots were built from changed: drop them; a node with open
        streams is rebuilt now and its streams woken, the others when next asked for."""
        for node in nodes:
            self._snapshots.pop(node, None)
            if node in self._watches:
                self._rebuild(node)

    def update(
        self,
        nodes: Iterable[str],
        patch: Callable[[str, Snapshot], Snapshot],
        wake_all: bool = False,
    ) -> None:
        """Apply ``patch`` to the held snapshots of ``nodes`` (nodes without one are built from
        the current state when asked for) and wake the streams of those that changed (with
        ``wake_all``, of every one held: a layer they read may have changed)."""
        watches = self._watches
        for node in nodes:
            current = self._snapshots.get(node)
            if current is None:
                continue
            new = patch(node, current)
            if new is not current:
                self._snapshots[node] = new
            elif not wake_all:
                continue
            for watch in watches.get(node, ()):
                watch.changed.set()

    def has(self, node: str) -> bool:
        """A snapshot of ``node`` is held."""
        return node in self._snapshots

    def held_among(self, nodes: set[str]) -> set[str]:
        """Those of ``nodes`` whose snapshot is held."""
        return nodes & self._snapshots.keys()

    def held(self) -> Iterable[str]:
        """Nodes whose snapshot is held (a live view: do not change the cache while iterating)."""
        return self._snapshots.keys()

    def invalidate_all(self) -> None:
        self._snapshots.clear()
        for node in list(self._watches):
            self._rebuild(node)

    def _rebuild(self, node: str) -> None:
        snapshot = self._build(node)
        if snapshot is not None:
            self.set_snapshot(node, snapshot)

    def _build(self, node: str) -> Snapshot | None:
        if self._source is None:
            return None
        snapshot = self._source(node)
        if snapshot is not None:
            self.built += 1
        return snapshot

    @staticmethod
    def _check(node: str, snapshot: Snapshot) -> None:
        if not snapshot.consistent():
            missing = sorted(f"{t.short}:{n}" for t, n in snapshot.missing())
            raise ValueError(f"inconsistent snapshot for {node}: missing {missing}")

    def set_snapshots(self, snapshots: Mapping[str, Snapshot]) -> None:
        for node, snapshot in snapshots.items():
            self.set_snapshot(node, snapshot)

    def clear_snapshot(self, node: str) -> None:
        """Forget a node (deregistered). Its open streams keep their last configuration."""
        self._snapshots.pop(node, None)

    def get(self, node: str) -> Snapshot | None:
        if self._settle is not None:
            self._settle(node)
        snapshot = self._snapshots.get(node)
        if snapshot is None:
            snapshot = self._build(node)
            if snapshot is not None:
                self._check(node, snapshot)
                self._snapshots[node] = snapshot
        return snapshot

    def nodes(self) -> frozenset[str]:
        """Nodes whose snapshot is built and held."""
        return frozenset(self._snapshots)

    def watching(self, node: str) -> int:
        return len(self._watches.get(node, ()))

    @contextmanager
    def watch(self, node: str) -> Iterator[Watch]:
        """Register a watch for ``node`` for the duration of the block (see :meth:`add_watch`)."""
        w = self.add_watch(node)
        try:
            yield w
        finally:
            self.remove_watch(w)

    def add_watch(self, node: str) -> Watch:
        """Register a watch for ``node`` until :meth:`remove_watch` (set once if a snapshot is
        already there, so the stream answers at once). What a stream held for its whole life
        does without a context manager: no generator and its frame kept per stream."""
        w = Watch(node)
        watches = self._watches.get(node)
        if watches is None:
            self._watches[node] = [w]
        else:
            watches.append(w)
        if node in self._snapshots or self._source is not None:
            w.changed.set()
        return w

    def remove_watch(self, w: Watch) -> None:
        """Forget ``w`` (again: nothing)."""
        watches = self._watches.get(w.node)
        if watches is not None and w in watches:
            watches.remove(w)
            if not watches:
                del self._watches[w.node]


__all__ = ["SnapshotCache", "Watch"]
