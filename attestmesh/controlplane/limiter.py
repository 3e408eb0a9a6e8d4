"""Attestations per workload, bounded: a token bucket each (in memory, itself bounded)."""

from __future__ import annotations

from datetime import datetime, timedelta

from certs.errors import AttestmeshError


class AttestationLimiter:
    """A token bucket per workload: at most ``burst`` attestations at once and one more per
    ``refill``. An agent renews at half its certificate's life and may retry a few times; a
    client looping on a valid token cannot make the control plane sign (and revoke, and
    publish CRLs) without bound. Bounded in memory: full buckets are forgotten."""

    def __init__(
        self, burst: int = 8, refill: timedelta = timedelta(seconds=60), limit: int = 100_000
    ) -> None:
        self._burst = burst
        self._limit = limit
        self._refill = refill
        self._buckets: dict[str, tuple[float, datetime]] = {}

    def take(self, name: str, now: datetime) -> None:
        tokens = self._tokens(name, now)
        if tokens < 1:
            wait = int((1 - tokens) * self._refill.total_seconds()) + 1
            raise AttestmeshError(
                "too_many_attestations", f"{name} attests too often; retry in {wait} s"
            )
        if len(self._buckets) >= self._limit:  # forget buckets that are full again
            self._buckets = {
                n: b for n, b in self._buckets.items() if self._tokens(n, now) < self._burst
            }
        self._buckets[name] = (tokens - 1, now)

    def _tokens(self, name: str, now: datetime) -> float:
        tokens, at = self._buckets.get(name, (float(self._burst), now))
        return min(float(self._burst), tokens + (now - at) / self._refill)

    def forget(self, name: str) -> None:
        self._buckets.pop(name, None)
