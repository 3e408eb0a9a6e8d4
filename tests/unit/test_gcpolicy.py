"""attestmesh.gcpolicy: survivors are frozen every tick; a full collection comes only for
connection churn or for resident memory grown past what the open connections explain, and
never closer together than the spacing."""

from __future__ import annotations

import asyncio
import gc

import pytest

from attestmesh.gcpolicy import (
    Collector,
    GcAction,
    GcLimits,
    GcPolicy,
    GcSample,
    decide,
    resident_bytes,
)

L = GcLimits(growth=2.0, floor=100, churn_ratio=0.5, churn_floor=10, conn_smoothing=1,
             min_spacing_s=60.0, duty=20.0)  # fmt: skip
FULL, FREEZE = GcAction.FULL, GcAction.FREEZE


def test_growth_beyond_what_connections_explain_calls_for_a_full_collection() -> None:
    base = GcSample(size=1_000, open_connections=9, closed_connections=0)
    assert decide(GcSample(2_000, 9, 0), base, L) is FREEZE
    assert decide(GcSample(2_001, 9, 0), base, L) is FULL
    # ten times the connections (9+1 -> 99+1): ten times the objects is a grown mesh, no leak
    assert decide(GcSample(19_000, 99, 0), base, L) is FREEZE
    assert decide(GcSample(20_001, 99, 0), base, L) is FULL
    # fewer connections than at the base do not lower the expectation
    assert decide(GcSample(2_000, 0, 0), base, L) is FREEZE
    # a small base counts as the floor
    assert decide(GcSample(200, 0, 0), GcSample(10, 0, 0), L) is FREEZE
    assert decide(GcSample(201, 0, 0), GcSample(10, 0, 0), L) is FULL


def test_connection_churn_calls_for_a_full_collection() -> None:
    base = GcSample(size=1_000, open_connections=100, closed_connections=500)
    assert decide(GcSample(1_000, 100, 550), base, L) is FREEZE  # 50 closed <= 0.5 x 100
    assert decide(GcSample(1_000, 100, 551), base, L) is FULL
    # the churn floor: a few closes among few connections are not worth a collection
    small = GcSample(size=1_000, open_connections=2, closed_connections=0)
    assert decide(GcSample(1_000, 2, 10), small, L) is FREEZE
    assert decide(GcSample(1_000, 2, 11), small, L) is FULL


def test_full_collections_are_spaced_by_time_and_by_their_own_cost() -> None:
    base = GcSample(size=1_000, open_connections=100, closed_connections=0)
    due = GcSample(1_000, 100, 10_000)  # churn far past the limit
    assert decide(due, base, L, since_full_s=59.9, last_full_s=0.1) is FREEZE
    assert decide(due, base, L, since_full_s=60.0, last_full_s=0.1) is FULL
    # a collection that took 5 s waits 20 x 5 = 100 s before the next
    assert decide(due, base, L, since_full_s=99.0, last_full_s=5.0) is FREEZE
    assert decide(due, base, L, since_full_s=100.0, last_full_s=5.0) is FULL


@pytest.mark.parametrize(
    "bad",
    [
        {"growth": 1.0}, {"growth": 0.5}, {"churn_ratio": 0.0}, {"floor": -1},
        {"churn_floor": -1}, {"conn_smoothing": 0}, {"min_spacing_s": -1.0}, {"duty": -1.0},
    ],
)  # fmt: skip
def test_limits_refuse_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GcLimits(**bad)  # type: ignore[arg-type]


class FakeProcess:
    """Tracked objects as counters: ``alive`` live ones, ``garbage`` cyclic garbage a full
    collection frees; connections open and closed."""

    def __init__(self, alive: int) -> None:
        self.alive, self.frozen, self.garbage = alive, 0, 0
        self.open, self.closed = 0, 0
        self.now = 0.0
        self.calls: list[str] = []

    def collector(self) -> Collector:
        # resident memory follows the tracked objects, garbage included
        return Collector(self.freeze, self.unfreeze, self.collect, lambda: self.alive)

    def freeze(self) -> None:
        self.calls.append("freeze")
        self.frozen = self.alive

    def unfreeze(self) -> None:
        self.calls.append("unfreeze")
        self.frozen = 0

    def collect(self) -> int:
        self.calls.append("collect")
        self.now += 2.0  # a full collection takes 2 s here
        freed, self.garbage = self.garbage, 0
        self.alive -= freed
        return freed

    def policy(self) -> GcPolicy:
        return GcPolicy(
            check_s=0.5, limits=L, collector=self.collector(),
            connections=lambda: (self.open, self.closed), clock=lambda: self.now,
        )  # fmt: skip


def test_policy_freezes_a_growing_mesh_and_collects_after_churn() -> None:
    p = FakeProcess(alive=1_000)
    policy = p.policy()
    policy.start()
    assert p.calls == ["freeze"] and p.frozen == 1_000
    for _ in range(5):  # the mesh grows: streams connect, 100 objects each
        p.open += 20
        p.alive += 2_000
        p.now += 1.0
        assert policy.tick() is FREEZE
    assert p.frozen == 11_000 and "collect" not in p.calls
    p.open -= 60  # 60 streams close (> 0.5 x 40 open): their objects are cyclic garbage
    p.closed += 60
    p.garbage = 6_000
    p.now += 1.0
    p.calls.clear()
    assert policy.tick() is FULL
    assert p.calls == ["unfreeze", "collect", "freeze"]
    assert p.frozen == p.alive == 5_000 and policy.full_collections == 1
    assert policy.last_full_s == 2.0
    # more churn at once: the spacing (60 s) holds the next collection back
    p.closed += 1_000
    p.now += 1.0
    assert policy.tick() is FREEZE
    p.now += 60.0
    assert policy.tick() is FULL


def test_memory_is_read_only_every_check_interval() -> None:
    """Between checks a tick only freezes."""
    p = FakeProcess(alive=1_000)
    counted = 0

    def size() -> int:
        nonlocal counted
        counted += 1
        return p.alive

    policy = GcPolicy(
        check_s=30.0, limits=L, collector=Collector(p.freeze, p.unfreeze, p.collect, size),
        connections=lambda: (0, p.closed), clock=lambda: p.now,
    )  # fmt: skip
    policy.start()
    assert counted == 1
    p.now = 100.0
    policy.tick()  # checks (the first tick after start)
    assert counted == 2
    p.closed = 100_000  # churn far past the limit, but the next check is 30 s away
    for _ in range(29):
        p.now += 1.0
        assert policy.tick() is FREEZE
    assert counted == 2
    p.now += 1.0
    assert policy.tick() is FULL


def test_run_starts_then_ticks_until_stopped() -> None:
    p = FakeProcess(alive=10)

    async def main() -> None:
        stop = asyncio.Event()
        policy = GcPolicy(interval_s=0.01, limits=L, collector=p.collector(),
                          connections=lambda: (0, 0))  # fmt: skip
        task = asyncio.create_task(policy.run(stop))
        while p.calls.count("freeze") < 3:
            await asyncio.sleep(0.005)
        stop.set()
        await asyncio.wait_for(task, 1)

    asyncio.run(main())
    assert p.calls[0] == "freeze" and "collect" not in p.calls


def test_defaults_drive_the_gc_module_and_the_listeners_totals() -> None:
    from attestmesh import listen

    c = Collector()
    assert (c.freeze, c.unfreeze, c.collect, c.size) == (
        gc.freeze, gc.unfreeze, gc.collect, resident_bytes,
    )  # fmt: skip
    assert resident_bytes() > 1 << 20  # this test process, read from /proc
    assert GcPolicy()._connections is listen.connection_totals
