"""Snapshot cache: the latest snapshot per node, and watches that wake the streams serving it.

A watch is a latest-value slot plus an ``asyncio.Event``: ``set_snapshot`` never awaits, never
blocks on a slow consumer, and a consumer that wakes late simply reads the newest snapshot
(intermediate ones are skipped, which state-of-the-world xDS allows). The cache knows no gRPC.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from xds.build import Snapshot


class Watch:
    """One stream's interest in one node. ``changed`` is set whenever a new snapshot lands."""

    __slots__ = ("changed", "node")

    def __init__(self, node: str) -> None:
        self.node = node
        self.changed = asyncio.Event()


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._watches: dict[str, set[Watch]] = {}

    def set_snapshot(self, node: str, snapshot: Snapshot) -> None:
        """Publish ``snapshot`` as ``node``'s configuration and wake its streams."""
        if not snapshot.consistent():
            missing = sorted(f"{t.short}:{n}" for t, n in snapshot.missing())
            raise ValueError(f"inconsistent snapshot for {node}: missing {missing}")
        self._snapshots[node] = snapshot
        for watch in self._watches.get(node, ()):
            watch.changed.set()

    def set_snapshots(self, snapshots: Mapping[str, Snapshot]) -> None:
        for node, snapshot in snapshots.items():
            self.set_snapshot(node, snapshot)

    def clear_snapshot(self, node: str) -> None:
        """Forget a node (deregistered). Its open streams keep their last configuration."""
        self._snapshots.pop(node, None)

    def get(self, node: str) -> Snapshot | None:
        return self._snapshots.get(node)

    def nodes(self) -> frozenset[str]:
        return frozenset(self._snapshots)

    def watching(self, node: str) -> int:
        return len(self._watches.get(node, ()))

    @contextmanager
    def watch(self, node: str) -> Iterator[Watch]:
        """Register a watch for ``node`` for the duration of the block (set once if a snapshot
        is already there, so the stream answers at once)."""
        w = Watch(node)
        self._watches.setdefault(node, set()).add(w)
        if node in self._snapshots:
            w.changed.set()
        try:
            yield w
        finally:
            watches = self._watches.get(node)
            if watches is not None:
                watches.discard(w)
                if not watches:
                    del self._watches[node]


__all__ = ["SnapshotCache", "Watch"]
