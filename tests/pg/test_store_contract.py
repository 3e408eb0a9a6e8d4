"""The store seam's contract, run against both backends: SQLite (embedded default) and a real
PostgreSQL server (tests/pg_harness.py). Same batches in, same state out."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.fixtures_core import TRUST_DOMAIN
from tests.unit.xds.test_store_batch import batches, ev, model, rev, wl
from xds.state import MeshState
from xds.store import (
    SQLITE_MIGRATIONS,
    Batch,
    Migration,
    SqliteStore,
    StoreConflict,
    StoreError,
    merge,
)
from xds.store_pg import PG_MIGRATIONS, PostgresStore, open_store

pytestmark = pytest.mark.integration

Store = SqliteStore | PostgresStore


@dataclass
class Backend:
    """One database of one kind: open stores on it, and run SQL behind their back."""

    kind: str
    spec: str  # a path or a postgresql:// URL
    migrations: tuple[Migration, ...]

    def open(self, **options: Any) -> Store:
        if self.kind == "sqlite":
            return SqliteStore(Path(self.spec), **options)
        return PostgresStore(self.spec, **options)

    def sql(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run one statement on a separate connection (``?`` placeholders for both)."""
        if self.kind == "sqlite":
            db = sqlite3.connect(self.spec, isolation_level=None)
            try:
                return db.execute(statement, params).fetchall()
            finally:
                db.close()
        with psycopg.connect(self.spec, autocommit=True) as conn:
            cur = conn.execute(statement.replace("?", "%s").encode(), params)
            return cur.fetchall() if cur.description else []

    def versions(self) -> list[int]:
        return sorted(int(v) for (v,) in self.sql("SELECT version FROM schema_version"))

    def wipe(self) -> None:
        for table in ("workloads", "revocations", "events"):
            self.sql(f"DELETE FROM {table}")  # noqa: S608 (a fixed table name)


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "sqlite":
        return Backend("sqlite", str(tmp_path / "mesh.db"), SQLITE_MIGRATIONS)
    return Backend("postgresql", request.getfixturevalue("pg_url"), PG_MIGRATIONS)


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    s = backend.open()
    yield s
    s.close()


def test_upsert_delete_revoke_unrevoke_events(store: Store) -> None:
    first = Batch(
        upserts={"a": wl("a"), "b": wl("b", 2)},
        revoked=(rev(10), rev(2**159 - 1, "b")),
        events=(ev("a", "one"), ev("b", "two")),
    )
    assert store.write(first) is None  # durable on return
    assert store.load(TRUST_DOMAIN) == MeshState(
        TRUST_DOMAIN, {"a": wl("a"), "b": wl("b", 2)}, (rev(10), rev(2**159 - 1, "b"))
    )
    store.write(
        Batch(
            upserts={"a": wl("a", 3)},
            deletes=frozenset({"b"}),
            unrevoked=frozenset({10}),
            events=(ev("a", "three"),),
        )
    )
    assert store.load(TRUST_DOMAIN) == MeshState(
        TRUST_DOMAIN, {"a": wl("a", 3)}, (rev(2**159 - 1, "b"),)
    )
    assert [e.reason for e in store.events()] == ["one", "two", "three"]
    assert [e.reason for e in store.events("a")] == ["one", "three"]
    assert [e.reason for e in store.events(limit=2)] == ["two", "three"]
    assert store.events("ghost") == []


def test_within_a_batch_deletes_follow_upserts_and_unrevoked_follows_revoked(store: Store) -> None:
    store.write(
        Batch(
            upserts={"a": wl("a"), "b": wl("b")},
            deletes=frozenset({"a"}),
            revoked=(rev(1), rev(2)),
            unrevoked=frozenset({1}),
        )
    )
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"b": wl("b")}, (rev(2),))


def test_deleting_what_is_not_there_changes_nothing(store: Store) -> None:
    store.write(Batch(upserts={"a": wl("a")}))
    store.write(Batch(deletes=frozenset({"ghost"}), unrevoked=frozenset({99})))
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"a": wl("a")})


def test_only_the_rows_in_the_batch_are_written(store: Store, backend: Backend) -> None:
    store.write(Batch(upserts={f"w-{i:03d}": wl(f"w-{i:03d}", i) for i in range(20)}))
    # A row changed behind the store's back: a store that rewrote every row would undo this.
    changed = store.load(TRUST_DOMAIN).workloads["w-005"]
    from xds.store import _encode_doc, workload_to_doc

    backend.sql(
        "UPDATE workloads SET doc = ? WHERE name = 'w-005'",
        (_encode_doc(workload_to_doc(wl("w-005", 4242))),),
    )
    store.write(Batch(upserts={"w-001": wl("w-001", 7)}, events=(ev("w-001"),)))
    loaded = store.load(TRUST_DOMAIN)
    assert loaded.workloads["w-005"] == wl("w-005", 4242) != changed
    assert loaded.workloads["w-001"] == wl("w-001", 7)
    assert loaded.workloads["w-002"] == wl("w-002", 2)


def test_a_batch_that_cannot_be_encoded_is_refused_and_changes_nothing(store: Store) -> None:
    with pytest.raises(StoreError) as refused:
        store.write(Batch(upserts={"a": wl("b")}, events=(ev("a"),)))
    assert refused.value.reason == "store_batch_invalid"
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN)
    assert store.events() == []


def test_write_group_is_one_commit_and_counts(store: Store) -> None:
    store.write_group(
        [
            Batch(upserts={"a": wl("a")}, events=(ev("a"),)),
            Batch(upserts={"a": wl("a", 2)}, revoked=(rev(1),)),
            Batch(deletes=frozenset({"zz"})),
        ]
    )
    s = store.stats()
    assert (s.commits, s.batches, s.max_group, s.failed_commits) == (1, 3, 3, 0)
    assert s.rows == 4  # net: a (written once), zz (deleted), one revocation, one event
    assert store.load(TRUST_DOMAIN).workloads["a"] == wl("a", 2)
    store.write(Batch())  # an empty batch is no commit
    assert store.stats().commits == 1


def test_reopening_loads_what_was_written(backend: Backend) -> None:
    s = backend.open()
    s.write(Batch(upserts={"a": wl("a"), "b": wl("b")}, revoked=(rev(3),), events=(ev("a"),)))
    s.write(Batch(deletes=frozenset({"b"}), events=(ev("b", "gone"),)))
    state, events = s.load(TRUST_DOMAIN), s.events()
    s.close()
    again = backend.open()
    try:
        assert (
            again.load(TRUST_DOMAIN) == state == MeshState(TRUST_DOMAIN, {"a": wl("a")}, (rev(3),))
        )
        assert again.events() == events
    finally:
        again.close()


def test_the_event_log_keeps_the_newest_rows(backend: Backend) -> None:
    s = backend.open(max_events=10, prune_slack=0)
    try:
        for i in range(25):
            s.write(Batch(events=(ev("a", str(i)),)))
        assert [e.reason for e in s.events(limit=100)] == [str(i) for i in range(15, 25)]
        assert backend.sql("SELECT count(*) FROM events")[0][0] == 10
    finally:
        s.close()


# A model of the tables: sequential writes, one group and one merged batch agree with it.
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(batches, max_size=6))
def test_sequential_grouped_and_merged_writes_agree(
    three: list[tuple[Backend, Store]], bs: list[Batch]
) -> None:
    rows, revs, events = model(bs)
    for b, _ in three:
        b.wipe()
    (_, seq), (_, grouped), (_, merged) = three
    for b in bs:
        seq.write(b)
    grouped.write_group(bs)
    merged.write(merge(bs))
    for _, s in three:
        loaded = s.load(TRUST_DOMAIN)
        assert dict(loaded.workloads) == rows
        assert {r.serial: r for r in loaded.revocations} == revs
        assert len(s.events(limit=100)) == events


@pytest.fixture
def three(
    request: pytest.FixtureRequest, backend: Backend, tmp_path: Path
) -> Iterator[list[tuple[Backend, Store]]]:
    if backend.kind == "sqlite":
        specs = [str(tmp_path / f"{k}.db") for k in range(3)]
    else:
        pg = request.getfixturevalue("pg")
        specs = [pg.create_database(f"three_{os.getpid()}_{id(request)}_{k}") for k in range(3)]
    made = [Backend(backend.kind, spec, backend.migrations) for spec in specs]
    opened = [(b, b.open()) for b in made]
    yield opened
    for _, s in opened:
        s.close()


# -- group commit over either backend ---------------------------------------------------------


async def test_group_commit_resolves_every_write_once_durable(backend: Backend) -> None:
    gc = open_store(backend.spec)
    try:
        futures = [
            gc.write(Batch(upserts={"a": wl("a", i)}, events=(ev("a", str(i)),)))
            for i in range(1, 41)
        ]
        bad = gc.write(Batch(upserts={"x": wl("y")}))  # cannot be encoded: fails alone
        tail = gc.write(Batch(upserts={"b": wl("b")}))
        results = await asyncio.gather(
            *(f for f in [*futures, bad, tail] if f), return_exceptions=True
        )
        assert all(r is None for r in results[:40]) and results[41] is None
        assert isinstance(results[40], StoreError) and results[40].reason == "store_batch_invalid"
        s = gc.stats()
        assert (s.batches, s.failed_commits) == (41, 0)
        assert gc.load(TRUST_DOMAIN).workloads == {"a": wl("a", 40), "b": wl("b")}
        assert [e.reason for e in gc.events(limit=100)] == [str(i) for i in range(1, 41)]
        assert gc.write(Batch()) is None
    finally:
        gc.close()
    with pytest.raises(StoreError) as closed:
        gc.write(Batch(upserts={"c": wl("c")}))
    assert closed.value.reason == "store_closed"


# -- schema versions ----------------------------------------------------------------------------


def test_a_fresh_database_is_created_at_the_latest_version(backend: Backend) -> None:
    s = backend.open()
    s.close()
    assert backend.versions()[-1] == backend.migrations[-1].version
    before = backend.versions()
    backend.open().close()  # opening again applies nothing
    assert backend.versions() == before


def test_a_database_newer_than_the_code_is_refused_and_left_alone(backend: Backend) -> None:
    backend.open().close()
    newer = backend.migrations[-1].version + 1
    if backend.kind == "sqlite":
        backend.sql("INSERT INTO schema_version(version) VALUES(?)", (newer,))
    else:
        backend.sql("INSERT INTO schema_version(version, description) VALUES(?, 'x')", (newer,))
    before = backend.versions()
    with pytest.raises(StoreError) as refused:
        backend.open()
    assert refused.value.reason == "store_schema_too_new"
    assert str(newer) in str(refused.value)
    assert backend.versions() == before


def test_migrations_run_in_order_from_the_current_version(backend: Backend) -> None:
    backend.open().close()
    latest = backend.migrations[-1].version
    extra = (
        Migration(latest + 1, "a", ("CREATE TABLE extra_a (x integer)",)),
        Migration(latest + 2, "b", ("INSERT INTO extra_a VALUES (7)",)),
    )
    s = backend.open(migrations=(*backend.migrations, *extra))
    assert s.version == latest + 2
    s.close()
    assert backend.sql("SELECT x FROM extra_a") == [(7,)]
    assert backend.versions()[-1] == latest + 2
    backend.open(migrations=(*backend.migrations, *extra)).close()  # idempotent
    assert backend.sql("SELECT x FROM extra_a") == [(7,)]
    with pytest.raises(StoreError) as refused:  # and the old code now refuses it
        backend.open()
    assert refused.value.reason == "store_schema_too_new"


def test_a_failing_migration_changes_nothing(backend: Backend) -> None:
    s = backend.open()
    s.write(Batch(upserts={"a": wl("a")}))
    s.close()
    before = backend.versions()
    latest = backend.migrations[-1].version
    broken = Migration(
        latest + 1,
        "half done",
        ("CREATE TABLE half (x integer)", "INSERT INTO no_such_table VALUES (1)"),
    )
    with pytest.raises(StoreError) as failed:
        backend.open(migrations=(*backend.migrations, broken))
    assert failed.value.reason == "store_migration_failed"
    assert backend.versions() == before
    with pytest.raises((sqlite3.Error, psycopg.Error)):
        backend.sql("SELECT * FROM half")
    again = backend.open()
    try:
        assert again.load(TRUST_DOMAIN).workloads == {"a": wl("a")}
    finally:
        again.close()


def test_replicas_opening_a_fresh_database_together_migrate_once(backend: Backend) -> None:
    results: list[BaseException | int] = []
    start = threading.Barrier(4)

    def opener() -> None:
        start.wait()
        try:
            s = backend.open()
            results.append(s.version)
            s.close()
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    latest = backend.migrations[-1].version
    assert results == [latest] * 4
    if backend.kind == "postgresql":  # one row per applied migration, none twice
        assert backend.versions() == [m.version for m in backend.migrations]


# -- crash of the writing process: nothing acknowledged is lost --------------------------------

_WRITER = textwrap.dedent(
    """
    import asyncio, sys
    from tests.unit.xds.test_store_batch import ev, wl
    from xds.store import Batch
    from xds.store_pg import open_store

    async def main() -> None:
        store = open_store(sys.argv[1])
        i = 0
        async def one(k: int) -> None:
            fut = store.write(Batch(upserts={f"w{k}": wl(f"w{k}", k + 1)}, events=(ev(f"w{k}"),)))
            await fut
            print(f"ack {k}", flush=True)
        while True:  # eight writers in flight at a time, forever (until killed)
            await asyncio.gather(*(one(i + j) for j in range(8)))
            i += 8

    asyncio.run(main())
    """
)


def test_kill_9_of_the_writer_loses_nothing_acknowledged(backend: Backend) -> None:
    backend.open().close()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, backend.spec],
        stdout=subprocess.PIPE,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    acked: list[int] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) >= 300:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stdout.close()
    assert len(acked) >= 300, "the writer died before acknowledging 300 writes"
    s = backend.open()
    try:
        loaded = s.load(TRUST_DOMAIN).workloads
        missing = [k for k in acked if loaded.get(f"w{k}") != wl(f"w{k}", k + 1)]
        assert missing == []
        logged = {e.workload for e in s.events(limit=100_000)}
        assert {f"w{k}" for k in acked} <= logged
    finally:
        s.close()


# -- decisions taken on rows read earlier: expectations --------------------------------------


def test_a_batch_applies_only_while_the_rows_it_read_are_unchanged(store: Store) -> None:
    store.write(Batch(upserts={"a": wl("a", 1)}, expect={"a": None}))
    store.write(Batch(upserts={"a": wl("a", 2)}, expect={"a": wl("a", 1)}, events=(ev("a", "2"),)))
    with pytest.raises(StoreConflict) as stale:  # decided on serial 1's row: refused
        store.write(
            Batch(
                upserts={"a": wl("a", 3)},
                revoked=(rev(77),),
                events=(ev("a", "3"),),
                expect={"a": wl("a", 1)},
            )
        )
    assert stale.value.reason == "store_conflict"
    assert stale.value.current == {"a": wl("a", 2)}
    with pytest.raises(StoreConflict) as exists:  # "no row yet" no longer holds
        store.write(Batch(upserts={"a": wl("a", 9)}, expect={"a": None}))
    assert exists.value.current == {"a": wl("a", 2)}
    with pytest.raises(StoreConflict) as gone:
        store.write(Batch(deletes=frozenset({"b"}), expect={"b": wl("b")}))
    assert gone.value.current == {"b": None}
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"a": wl("a", 2)})
    assert [e.reason for e in store.events()] == ["2"]  # nothing of a refused batch


def test_in_a_group_each_batch_is_checked_against_the_earlier_ones(store: Store) -> None:
    store.write(Batch(upserts={"a": wl("a", 1)}))
    outcomes = store.write_group(
        [
            Batch(upserts={"a": wl("a", 2)}, expect={"a": wl("a", 1)}),
            Batch(upserts={"a": wl("a", 3)}, expect={"a": wl("a", 2)}),  # sees the first
            Batch(upserts={"a": wl("a", 4)}, expect={"a": wl("a", 1)}),  # stale: refused alone
            Batch(upserts={"b": wl("b")}, expect={"b": None}, events=(ev("b"),)),
            Batch(deletes=frozenset({"a"}), expect={"a": wl("a", 3)}),
        ]
    )
    assert [type(o).__name__ for o in outcomes] == [
        "NoneType", "NoneType", "StoreConflict", "NoneType", "NoneType"
    ]  # fmt: skip
    conflict = outcomes[2]
    assert conflict is not None and conflict.current == {"a": wl("a", 3)}
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"b": wl("b")})
    assert store.stats().batches == 1 + 4


def test_a_row_written_by_older_code_matches_its_decoded_self(
    store: Store, backend: Backend
) -> None:
    from xds.store import workload_from_doc, workload_to_doc

    doc = workload_to_doc(wl("a", 5))
    del doc["registration"]["ready"], doc["registration"]["pod_uid"]  # before those fields
    backend.sql("INSERT INTO workloads(name, doc) VALUES(?, ?)", ("a", json.dumps(doc)))
    read = workload_from_doc(json.loads(json.dumps(doc)))
    store.write(Batch(upserts={"a": wl("a", 6)}, expect={"a": read}))
    assert store.load(TRUST_DOMAIN).workloads == {"a": wl("a", 6)}


async def test_group_commit_refuses_a_stale_decision_alone(backend: Backend) -> None:
    gc = open_store(backend.spec)
    try:
        first = gc.write(Batch(upserts={"a": wl("a", 1)}, expect={"a": None}))
        second = gc.write(Batch(upserts={"a": wl("a", 2)}, expect={"a": wl("a", 1)}))
        stale = gc.write(Batch(upserts={"a": wl("a", 3)}, expect={"a": wl("a", 1)}))
        other = gc.write(Batch(upserts={"b": wl("b")}))
        got = await asyncio.gather(first, second, stale, other, return_exceptions=True)  # type: ignore[arg-type]
        assert got[0] is None and got[1] is None and got[3] is None
        assert isinstance(got[2], StoreConflict) and got[2].current == {"a": wl("a", 2)}
        assert gc.load(TRUST_DOMAIN).workloads == {"a": wl("a", 2), "b": wl("b")}
    finally:
        gc.close()


def test_merge_keeps_the_expectations_about_rows_it_did_not_write() -> None:
    merged = merge(
        [
            Batch(upserts={"a": wl("a", 2)}, expect={"a": wl("a", 1), "c": None}),
            Batch(upserts={"a": wl("a", 3)}, expect={"a": wl("a", 2), "b": wl("b")}),
        ]
    )
    assert merged.expect == {"a": wl("a", 1), "c": None, "b": wl("b")}
