"""A persistent (immutable, structurally shared) mapping. Pure.

``PMap`` is a read-only ``Mapping`` whose ``set``/``delete``/``update`` return a new map and
leave the old one unchanged, sharing everything they did not touch: the keys are spread over
about sqrt(n) buckets (small dicts, never changed once the map holds them), so a one-key change
copies one bucket and the tuple of buckets, O(sqrt(n)) pointers (~2 us at 10,000 keys) instead
of the whole mapping (~0.2 ms). A reader holding a map never sees it change.

Iteration order is by bucket, not by insertion. The bucket count grows by doubling when the
buckets grow past it (amortised O(1) per insertion); deletions never shrink it.
"""

from __future__ import annotations

import builtins
from collections.abc import Hashable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from typing import TypeVar, cast, overload

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
D = TypeVar("D")

_EMPTY: dict[object, object] = {}  # the shared empty bucket: never written to


def _bucket_count(n: int) -> int:
    """A power of two about sqrt(n) (at least 4), so a bucket holds about as many keys as
    there are buckets: one change copies O(sqrt(n)) pointers."""
    nb = 4
    while nb * nb < n:
        nb *= 2
    return nb


class PMap(Mapping[K, V]):
    """An immutable mapping; ``set``, ``delete`` and ``update`` return new maps."""

    __slots__ = ("_buckets", "_len", "_mask")

    _buckets: tuple[dict[K, V], ...]
    _len: int
    _mask: int

    def __init__(self, items: Mapping[K, V] | Iterable[tuple[K, V]] = ()) -> None:
        if isinstance(items, PMap):
            self._buckets, self._len, self._mask = items._buckets, items._len, items._mask
            return
        source = dict(items)
        self._fill(source, _bucket_count(len(source)))

    def _fill(self, source: Mapping[K, V], nb: int) -> None:
        mask = nb - 1
        buckets: list[dict[K, V]] = [{} for _ in range(nb)]
        for k, v in source.items():
            buckets[hash(k) & mask][k] = v
        empty = cast("dict[K, V]", _EMPTY)
        self._buckets = tuple(b if b else empty for b in buckets)
        self._len = len(source)
        self._mask = mask

    @classmethod
    def _of(cls, buckets: tuple[dict[K, V], ...], length: int, mask: int) -> PMap[K, V]:
        new = cls.__new__(cls)
        new._buckets, new._len, new._mask = buckets, length, mask
        return new

    # -- Mapping ------------------------------------------------------------------------------
    def __getitem__(self, key: K) -> V:
        return self._buckets[hash(key) & self._mask][key]

    @overload
    def get(self, key: K, /) -> V | None: ...
    @overload
    def get(self, key: K, default: V | D, /) -> V | D: ...
    def get(self, key: K, default: object = None, /) -> object:
        return self._buckets[hash(key) & self._mask].get(key, default)

    def __contains__(self, key: object) -> bool:
        try:
            return key in self._buckets[hash(key) & self._mask]
        except TypeError:  # unhashable: in no mapping
            return False

    def __iter__(self) -> Iterator[K]:
        for bucket in self._buckets:
            yield from bucket

    def __len__(self) -> int:
        return self._len

    def items(self) -> ItemsView[K, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def __repr__(self) -> str:
        return f"PMap({dict(self.items())!r})"

    def __reduce__(self) -> tuple[type[PMap[K, V]], tuple[dict[K, V]]]:
        return (type(self), (dict(self.items()),))

    # -- persistent updates -------------------------------------------------------------------
    def set(self, key: K, value: V) -> PMap[K, V]:
        """A map with ``key`` bound to ``value`` (self if it already is, by identity)."""
        i = hash(key) & self._mask
        bucket = self._buckets[i]
        had = key in bucket
        if had and bucket[key] is value:
            return self
        if not had and self._len + 1 > 2 * len(self._buckets) ** 2:
            return self.update({key: value})  # grows the bucket count
        copy = dict(bucket)
        copy[key] = value
        buckets = list(self._buckets)
        buckets[i] = copy
        return self._of(tuple(buckets), self._len + (not had), self._mask)

    def delete(self, key: K) -> PMap[K, V]:
        """A map without ``key`` (self if it has none)."""
        i = hash(key) & self._mask
        bucket = self._buckets[i]
        if key not in bucket:
            return self
        copy = {k: v for k, v in bucket.items() if k != key}
        buckets = list(self._buckets)
        buckets[i] = copy if copy else cast("dict[K, V]", _EMPTY)
        return self._of(tuple(buckets), self._len - 1, self._mask)

    def update(self, values: Mapping[K, V], deletes: Iterable[K] = ()) -> PMap[K, V]:
        """A map with every binding of ``values`` set and every key of ``deletes`` removed
        (each bucket they touch is copied once; a key in both ends up set)."""
        gone = {k for k in deletes if k in self and k not in values}
        if not values and not gone:
            return self
        length = self._len + sum(k not in self for k in values) - len(gone)
        if length > 2 * len(self._buckets) ** 2:  # grow: rebuild with about sqrt(n) buckets
            merged = dict(self.items())
            for k in gone:
                merged.pop(k, None)
            merged.update(values)
            new = self._of((), 0, 0)
            new._fill(merged, _bucket_count(len(merged)))
            return new
        mask = self._mask
        buckets = list(self._buckets)
        copied: builtins.set[int] = builtins.set()
        for k in gone:
            i = hash(k) & mask
            if i not in copied:
                buckets[i] = dict(buckets[i])
                copied.add(i)
            del buckets[i][k]
        for k, v in values.items():
            i = hash(k) & mask
            if i not in copied:
                buckets[i] = dict(buckets[i])
                copied.add(i)
            buckets[i][k] = v
        empty = cast("dict[K, V]", _EMPTY)
        for i in copied:
            if not buckets[i]:
                buckets[i] = empty
        return self._of(tuple(buckets), length, mask)

    def changed_keys(self, other: Mapping[K, V]) -> builtins.set[K]:
        """Keys bound differently (by identity) in ``self`` and ``other``, or in only one of
        them. Against a map derived from this one, buckets both share are skipped."""
        if isinstance(other, PMap) and other._mask == self._mask:
            out: builtins.set[K] = builtins.set()
            for mine, theirs in zip(self._buckets, other._buckets, strict=True):
                if mine is theirs:
                    continue
                out |= {k for k, v in mine.items() if theirs.get(k, _EMPTY) is not v}
                out |= {k for k in theirs if k not in mine}
            return out
        out = {k for k, v in self.items() if other.get(k, _EMPTY) is not v}
        out |= {k for k in other if k not in self}
        return out


class _Items(ItemsView[K, V]):
    """Items straight from the buckets (no lookup per key)."""

    __slots__ = ()
    _mapping: PMap[K, V]

    def __iter__(self) -> Iterator[tuple[K, V]]:
        for bucket in self._mapping._buckets:
            yield from bucket.items()


class _Values(ValuesView[V]):
    __slots__ = ()
    _mapping: PMap[object, V]

    def __iter__(self) -> Iterator[V]:
        for bucket in self._mapping._buckets:
            yield from bucket.values()


__all__ = ["PMap"]
