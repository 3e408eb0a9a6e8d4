"""The store's files and schema: versioned migrations, private file modes, a bounded event log."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, registration
from xds.state import Event, EventKind, MeshState, WorkloadState
from xds.store import (
    SCHEMA_VERSION,
    SQLITE_MIGRATIONS,
    Batch,
    Migration,
    SqliteStore,
    StoreError,
    migrate,
    schema_version,
    workload_to_doc,
)

# The schema as the first release created it (no schema_version table).
V1_SCHEMA = """
CREATE TABLE IF NOT EXISTS workloads (name TEXT PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revocations (
    serial TEXT PRIMARY KEY, workload TEXT NOT NULL, not_after TEXT NOT NULL,
    revoked_at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, kind TEXT NOT NULL,
    workload TEXT NOT NULL, trigger TEXT, reason TEXT NOT NULL);
"""


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "mesh.db"


def raw(db: Path) -> closing[sqlite3.Connection]:
    return closing(sqlite3.connect(db, isolation_level=None))


def objects(db: Path) -> set[tuple[str, str]]:
    with raw(db) as conn:
        return set(conn.execute("SELECT type, name FROM sqlite_master"))


def version_rows(db: Path) -> list[tuple[int, str]]:
    with raw(db) as conn:
        return list(conn.execute("SELECT version, applied_at FROM schema_version"))


def event(i: int, workload: str = "a") -> Event:
    return Event(EventKind.AUDIT, workload, NOW + timedelta(seconds=i), str(i))


# -- migrations ---------------------------------------------------------------------------------


def test_a_fresh_database_is_created_at_the_latest_version(db: Path) -> None:
    store = SqliteStore(db)
    store.close()
    assert store.version == SCHEMA_VERSION == 4
    assert [v for v, _ in version_rows(db)] == [SCHEMA_VERSION]
    assert {("table", "workloads"), ("table", "revocations"), ("table", "events")} <= objects(db)
    assert ("index", "events_by_workload") in objects(db)


def test_a_version_1_database_without_the_version_table_is_migrated(db: Path) -> None:
    db.parent.mkdir()
    w = WorkloadState(registration())
    with raw(db) as conn:
        conn.executescript(V1_SCHEMA)
        conn.execute(
            "INSERT INTO workloads VALUES(?, ?)", ("web-1", json.dumps(workload_to_doc(w)))
        )
        conn.execute(
            "INSERT INTO events(at, kind, workload, trigger, reason) VALUES(?, ?, ?, ?, ?)",
            (NOW.isoformat(), "registered", "web-1", None, ""),
        )
        assert schema_version(conn) == 1
    store = SqliteStore(db)
    try:
        assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"web-1": w})
        assert store.events() == [Event(EventKind.REGISTERED, "web-1", NOW)]
    finally:
        store.close()
    assert [v for v, _ in version_rows(db)] == [SCHEMA_VERSION]
    assert ("index", "events_by_workload") in objects(db)


def test_opening_again_applies_nothing(db: Path) -> None:
    SqliteStore(db).close()
    before_objects, before_rows = objects(db), version_rows(db)
    SqliteStore(db).close()
    with raw(db) as conn:
        assert migrate(conn) == SCHEMA_VERSION
        assert not conn.in_transaction
    assert objects(db) == before_objects
    assert version_rows(db) == before_rows  # same row, same applied_at


def test_a_database_newer_than_the_code_is_refused(db: Path) -> None:
    SqliteStore(db).close()
    with raw(db) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError) as refused:
        SqliteStore(db)
    assert refused.value.reason == "store_schema_too_new"
    assert str(db) in str(refused.value) and f"version {SCHEMA_VERSION + 1}" in str(refused.value)
    assert [v for v, _ in version_rows(db)] == [SCHEMA_VERSION + 1]  # left as it was


def test_migrations_run_in_order_from_the_current_version(db: Path) -> None:
    db.parent.mkdir()
    with raw(db) as conn:
        conn.executescript(V1_SCHEMA)
    extra = Migration(3, "workload owner", ("ALTER TABLE workloads ADD COLUMN owner TEXT",))
    store = SqliteStore(db, migrations=(*SQLITE_MIGRATIONS, extra))
    store.close()
    assert store.version == 3
    with raw(db) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(workloads)")]
    assert columns == ["name", "doc", "owner"]
    assert ("index", "events_by_workload") in objects(db)  # 2 ran before 3


def test_a_failing_migration_changes_nothing(db: Path) -> None:
    SqliteStore(db).close()
    before = objects(db)
    broken = Migration(
        SCHEMA_VERSION + 1, "broken", ("CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL")
    )
    with pytest.raises(StoreError) as failed:
        SqliteStore(db, migrations=(*SQLITE_MIGRATIONS, broken))
    assert failed.value.reason == "store_migration_failed"
    assert objects(db) == before  # the first statement of migration 3 was rolled back too
    assert [v for v, _ in version_rows(db)] == [SCHEMA_VERSION]


def test_per_workload_events_use_the_index(db: Path) -> None:
    SqliteStore(db).close()
    with raw(db) as conn:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT at FROM events WHERE workload = ? ORDER BY id DESC LIMIT 5",
            ("a",),
        ).fetchall()
    assert any("events_by_workload" in row[-1] for row in plan)


# -- file modes ---------------------------------------------------------------------------------


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def side_files(db: Path) -> list[Path]:
    return [db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")]


def test_database_files_are_created_private(db: Path) -> None:
    with umask(0o000):  # even with a permissive umask
        store = SqliteStore(db)
        try:
            store.write(Batch(upserts={"web-1": WorkloadState(registration())}))
            assert [mode(p) for p in side_files(db)] == [0o600, 0o600, 0o600]
            assert mode(db.parent) == 0o700  # the directory it created
        finally:
            store.close()


def test_existing_readable_files_are_made_private(db: Path) -> None:
    with umask(0o000):
        first = SqliteStore(db)  # keeps -wal and -shm in place while open
        try:
            first.write(Batch(events=(event(1),)))
            for p in side_files(db):
                p.chmod(0o644)
            SqliteStore(db).close()
            assert [mode(p) for p in side_files(db)] == [0o600, 0o600, 0o600]
        finally:
            first.close()


# -- the bounded event log ----------------------------------------------------------------------


def count_events(db: Path) -> int:
    with raw(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM events").fetchone()[0])


def test_the_event_log_keeps_the_newest_rows(db: Path) -> None:
    store = SqliteStore(db, max_events=10, prune_slack=0)
    try:
        for i in range(25):
            store.write(Batch(events=(event(i, "a" if i % 2 else "b"),)))
            assert count_events(db) == min(i + 1, 10)
        assert [e.reason for e in store.events(limit=100)] == [str(i) for i in range(15, 25)]
        assert [e.reason for e in store.events("a", limit=100)] == [
            str(i) for i in range(15, 25) if i % 2
        ]
        store.write(Batch(events=tuple(event(i) for i in range(100, 130))))  # one big batch
        assert [e.reason for e in store.events(limit=100)] == [str(i) for i in range(120, 130)]
    finally:
        store.close()


def test_pruning_is_amortised_within_the_slack(db: Path) -> None:
    store = SqliteStore(db, max_events=100, prune_slack=10)
    statements: list[str] = []
    try:
        store._db.set_trace_callback(statements.append)
        for i in range(300):
            store.write(Batch(events=(event(i),)))
            assert count_events(db) <= 110
        assert count_events(db) >= 100
        assert store.events(limit=1) == [event(299)]
        deletes = [q for q in statements if q.startswith("DELETE FROM events")]
        assert len(deletes) == 18  # every 11 events after the first 110, not on every commit
    finally:
        store.close()


def test_a_smaller_bound_applies_from_the_next_write_after_reopening(db: Path) -> None:
    big = SqliteStore(db)
    big.write(Batch(events=tuple(event(i) for i in range(50))))
    big.close()
    small = SqliteStore(db, max_events=5, prune_slack=0)
    try:
        small.write(Batch(events=(event(50),)))
        assert [e.reason for e in small.events()] == ["46", "47", "48", "49", "50"]
    finally:
        small.close()
