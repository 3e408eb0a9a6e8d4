"""GroupCommitStore with a real event loop, a real writer thread and real SQLite files: writes
are grouped, acknowledged only once durable, applied in order, all-or-nothing per group,
drained on close, and a killed writer leaves only whole batches."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator
from contextlib import closing
from datetime import timedelta
from pathlib import Path

import pytest

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.state import Event, EventKind, IssuedCert, MeshState, Status, WorkloadState, register
from xds.store import Batch, GroupCommitStore, SqliteStore, StoreError, workload_from_doc

REPO = Path(__file__).resolve().parents[2]
H = timedelta(hours=1)


def wl(name: str, serial: int = 1) -> WorkloadState:
    return WorkloadState(
        registration(name), Status.ATTESTED, record(), NOW + H, (IssuedCert(serial, NOW + H),)
    )


def attestation(name: str, serial: int = 1, reason: str = "") -> Batch:
    return Batch(
        upserts={name: wl(name, serial)}, events=(Event(EventKind.ATTESTED, name, NOW, reason),)
    )


def row(db: Path, name: str) -> WorkloadState | None:
    """Read a workload through a fresh connection: what is on disk, not what a store holds."""
    with closing(sqlite3.connect(db)) as conn:
        found = conn.execute("SELECT doc FROM workloads WHERE name = ?", (name,)).fetchone()
    return None if found is None else workload_from_doc(json.loads(found[0]))


def names_on_disk(db: Path) -> set[str]:
    with closing(sqlite3.connect(db)) as conn:
        return {n for (n,) in conn.execute("SELECT name FROM workloads")}


class Gate:
    """Holds the writer thread inside its transaction: a temporary trigger on the writer's own
    connection calls ``gate()`` when an event with reason 'gate' is inserted."""

    def __init__(self, store: SqliteStore) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        store._db.create_function("gate", 0, self._wait)
        store._db.execute(
            "CREATE TEMP TRIGGER hold AFTER INSERT ON main.events "
            "WHEN NEW.reason = 'gate' BEGIN SELECT gate(); END"
        )

    def _wait(self) -> None:
        self.entered.set()
        self.release.wait(10)

    async def close_on(self, store: GroupCommitStore) -> asyncio.Future[None] | None:
        """Write the gate batch and wait until the writer is held inside its transaction."""
        fut = store.write(attestation("gate-keeper", reason="gate"))
        await asyncio.to_thread(self.entered.wait, 10)
        assert self.entered.is_set()
        return fut


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state.sqlite3"


@pytest.fixture
def inner(db: Path) -> SqliteStore:
    return SqliteStore(db)


@pytest.fixture
async def store(inner: SqliteStore) -> AsyncIterator[GroupCommitStore]:
    s = GroupCommitStore(inner)
    yield s
    s.close()


async def test_concurrent_writes_share_commits(store: GroupCommitStore, db: Path) -> None:
    async def client(k: int) -> None:
        for i in range(5):
            fut = store.write(attestation(f"w-{k}", i))
            assert fut is not None
            await fut

    await asyncio.gather(*(client(k) for k in range(100)))
    s = store.stats()
    assert s.batches == 500 and s.failed_commits == 0 and s.queued == 0
    assert s.commits < s.batches / 2  # many batches per fsync
    assert s.max_group > 1
    assert all(row(db, f"w-{k}") == wl(f"w-{k}", 4) for k in range(100))
    assert len(store.events("w-7")) == 5


async def test_everything_waiting_is_one_commit(
    store: GroupCommitStore, inner: SqliteStore
) -> None:
    gate = Gate(inner)
    first = await gate.close_on(store)
    waiting = [store.write(attestation(f"w-{k}")) for k in range(50)]
    assert store.stats().queued == 50
    gate.release.set()
    await asyncio.gather(first, *waiting)  # type: ignore[arg-type]
    s = store.stats()
    assert (s.commits, s.batches, s.max_group) == (2, 51, 50)


async def test_a_future_resolves_only_once_its_batch_is_durable(
    store: GroupCommitStore, db: Path
) -> None:
    seen: dict[str, WorkloadState | None] = {}

    def on_done(name: str) -> object:
        return lambda _fut: seen.__setitem__(name, row(db, name))

    futures = []
    for k in range(40):
        fut = store.write(attestation(f"w-{k}", k))
        assert fut is not None
        fut.add_done_callback(on_done(f"w-{k}"))
        futures.append(fut)
    await asyncio.gather(*futures)
    await asyncio.sleep(0)  # done callbacks run one loop iteration after the future resolves
    assert seen == {f"w-{k}": wl(f"w-{k}", k) for k in range(40)}


async def test_the_later_write_of_a_row_wins_within_a_group(
    store: GroupCommitStore, inner: SqliteStore, db: Path
) -> None:
    gate = Gate(inner)
    first = await gate.close_on(store)
    writes = [
        store.write(attestation("a", 1)),
        store.write(attestation("a", 2)),  # same row, later: wins
        store.write(Batch(upserts={"b": wl("b")})),
        store.write(Batch(deletes=frozenset({"b"}))),  # upsert then delete: deleted
        store.write(Batch(deletes=frozenset({"c"}))),
        store.write(Batch(upserts={"c": wl("c", 3)})),  # delete then upsert: present
    ]
    gate.release.set()
    await asyncio.gather(first, *writes)  # type: ignore[arg-type]
    assert store.stats().max_group == 6
    assert row(db, "a") == wl("a", 2)
    assert row(db, "b") is None
    assert row(db, "c") == wl("c", 3)
    assert [e.at for e in store.events("a")] == [NOW, NOW]  # both events, in order


async def test_a_failed_commit_fails_its_whole_group_and_writes_nothing(
    store: GroupCommitStore, inner: SqliteStore, db: Path
) -> None:
    inner._db.execute(
        "CREATE TEMP TRIGGER boom BEFORE INSERT ON main.events "
        "WHEN NEW.reason = 'boom' BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
    )
    gate = Gate(inner)
    first = await gate.close_on(store)
    group = [
        store.write(attestation("a")),
        store.write(attestation("b", reason="boom")),  # its event fails the transaction
        store.write(Batch(upserts={"c": wl("c")}, deletes=frozenset({"gate-keeper"}))),
    ]
    gate.release.set()
    await first  # type: ignore[misc]
    outcomes = await asyncio.gather(*group, return_exceptions=True)  # type: ignore[arg-type]
    assert all(isinstance(o, StoreError) for o in outcomes), outcomes
    assert {o.reason for o in outcomes if isinstance(o, StoreError)} == {"store_commit_failed"}
    assert "injected failure" in str(outcomes[0])
    assert names_on_disk(db) == {"gate-keeper"}  # nothing of a, b or c; the delete undone
    assert [e.workload for e in store.events()] == ["gate-keeper"]
    assert store.stats().failed_commits == 1
    # The writer carries on.
    later = store.write(attestation("d"))
    assert later is not None
    await later
    assert names_on_disk(db) == {"gate-keeper", "d"}


async def test_a_batch_that_cannot_be_encoded_fails_alone(
    store: GroupCommitStore, inner: SqliteStore, db: Path
) -> None:
    gate = Gate(inner)
    first = await gate.close_on(store)
    bad = Batch(events=(Event(EventKind.AUDIT, "x", None),))  # type: ignore[arg-type]
    group = [store.write(attestation("a")), store.write(bad), store.write(attestation("c"))]
    gate.release.set()
    await first  # type: ignore[misc]
    ok_a, failed, ok_c = await asyncio.gather(*group, return_exceptions=True)  # type: ignore[arg-type]
    assert ok_a is None and ok_c is None
    assert isinstance(failed, StoreError) and failed.reason == "store_batch_invalid"
    assert names_on_disk(db) == {"gate-keeper", "a", "c"}


async def test_the_loop_runs_and_reads_answer_while_a_commit_is_pending(
    store: GroupCommitStore, inner: SqliteStore, db: Path
) -> None:
    first = store.write(attestation("a"))
    assert first is not None
    await first
    gate = Gate(inner)
    held = await gate.close_on(store)  # the writer sits inside an open write transaction
    try:
        started = time.perf_counter()
        fut = store.write(attestation("b"))
        assert time.perf_counter() - started < 0.05  # an append, not a commit
        ticks = 0
        for _ in range(10):
            await asyncio.sleep(0.005)
            ticks += 1
        assert ticks == 10 and fut is not None and not fut.done()
        started = time.perf_counter()
        assert set(store.load(TRUST_DOMAIN).workloads) == {"a"}  # durable state only
        assert [e.workload for e in store.events()] == ["a"]
        assert time.perf_counter() - started < 1  # the reader does not wait for the writer
    finally:
        gate.release.set()
    await asyncio.gather(held, fut)  # type: ignore[arg-type]
    assert set(store.load(TRUST_DOMAIN).workloads) == {"a", "gate-keeper", "b"}


async def test_close_drains_what_is_queued(inner: SqliteStore, db: Path) -> None:
    store = GroupCommitStore(inner)
    gate = Gate(inner)
    first = await gate.close_on(store)
    futures = [store.write(attestation(f"w-{k}", k)) for k in range(30)]
    threading.Timer(0.2, gate.release.set).start()
    store.close()  # blocks until the held group and the 30 queued batches are durable
    assert names_on_disk(db) == {"gate-keeper"} | {f"w-{k}" for k in range(30)}
    assert await asyncio.gather(first, *futures) == [None] * 31  # type: ignore[arg-type]
    with pytest.raises(StoreError) as closed:
        store.write(attestation("late"))
    assert closed.value.reason == "store_closed"
    store.close()  # idempotent


async def test_save_and_load_through_the_writer(store: GroupCommitStore, db: Path) -> None:
    s0 = MeshState(TRUST_DOMAIN)
    s1, events = register(s0, registration(), NOW)
    store.save(s0, s1, events)  # synchronous: durable on return
    assert row(db, "web-1") == s1.workloads["web-1"]
    assert store.load(TRUST_DOMAIN) == s1
    assert store.events() == events
    assert store.write(Batch()) is None  # nothing to wait for


def test_write_needs_a_running_loop(inner: SqliteStore) -> None:
    store = GroupCommitStore(inner)
    try:
        with pytest.raises(RuntimeError):
            store.write(attestation("a"))
    finally:
        store.close()


# -- crash safety: a writer process killed with SIGKILL at arbitrary points --------------------

ROWS = 5
CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from dataclasses import replace
    from datetime import UTC, datetime
    from pathlib import Path
    from tests.unit.fixtures_core import registration
    from xds.state import Event, EventKind, Revocation, WorkloadState
    from xds.store import Batch, GroupCommitStore

    NOW = datetime(2030, 1, 1, tzinfo=UTC)

    def batch(i):
        # Every batch rewrites all ROWS rows with its number, adds one event and one revocation.
        rows = {
            f"r{j}": WorkloadState(replace(registration(f"r{j}"), labels={"batch": str(i)}))
            for j in range(ROWS)
        }
        return Batch(
            upserts=rows,
            revoked=(Revocation(i, NOW, NOW, "r0"),),
            events=(Event(EventKind.AUDIT, "r0", NOW, str(i)),),
        )

    async def main():
        store = GroupCommitStore.open(Path(sys.argv[1]))
        i = int(sys.argv[2])
        while True:  # four writers in flight, so groups form
            futures = [store.write(batch(i + k)) for k in range(4)]
            for k, fut in enumerate(futures):
                await fut
                print(i + k, flush=True)  # acknowledged: durable
            i += 4

    asyncio.run(main())
    """
).replace("ROWS", str(ROWS))


def whole_batches(db: Path) -> int:
    """Check the database holds whole batches only; return the last batch number (-1: none)."""
    store = SqliteStore(db)  # recovery of the WAL happens here
    try:
        state = store.load(TRUST_DOMAIN)
        events = [int(e.reason) for e in store.events(limit=1_000_000)]
    finally:
        store.close()
    tags = {w.registration.labels["batch"] for w in state.workloads.values()}
    if not state.workloads:
        assert not events and not state.revocations
        return -1
    assert len(state.workloads) == ROWS and len(tags) == 1, tags  # every row from one batch
    last = int(tags.pop())
    assert events == list(range(last + 1))  # each batch's event, none torn off, none extra
    assert sorted(state.revoked_serials()) == list(range(last + 1))
    return last


def test_a_writer_killed_mid_way_leaves_only_whole_batches(db: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    last = -1
    rng = random.Random(7)
    for wait_for in (3, 57, 211, 5, 30, 9, 100, 1):  # acknowledged batches before each kill
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(db), str(last + 1)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        acked = last
        try:
            assert child.stdout is not None
            deadline = time.monotonic() + 60
            while acked < last + wait_for and time.monotonic() < deadline:
                line = child.stdout.readline()
                if not line:
                    break
                acked = int(line)
            # The child acknowledges right after a commit: killed at once it would always die
            # between groups. A few milliseconds later its writer is mid-transaction.
            time.sleep(rng.uniform(0, 0.02))
            child.send_signal(signal.SIGKILL)
        finally:
            child.kill()
            child.wait(10)
            if child.stdout is not None:
                child.stdout.close()
        assert acked >= last + wait_for, "the child did not acknowledge enough batches"
        found = whole_batches(db)
        assert found >= acked  # nothing acknowledged was lost
        last = found
