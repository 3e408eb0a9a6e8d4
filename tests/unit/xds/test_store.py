from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.state import (
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    Status,
    Trigger,
    prune_revocations,
    quarantine,
    record_attestation,
    register,
    release,
)
from xds.store import SqliteStore, StoreError, workload_from_doc, workload_to_doc

H = timedelta(hours=1)
BIG_SERIAL = 2**159 - 1  # serials exceed 64 bits


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "state" / "mesh.db"


@pytest.fixture
def store(db: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(db)
    yield s
    s.close()


def _save(store: SqliteStore, old: MeshState, step: tuple[MeshState, list[Event]]) -> MeshState:
    new, events = step
    store.save(old, new, events)
    assert store.load(TRUST_DOMAIN) == new
    return new


def test_round_trip_after_every_transition(store: SqliteStore) -> None:
    empty = MeshState(TRUST_DOMAIN)
    assert store.load(TRUST_DOMAIN) == empty
    reg = registration(labels={"app": "web"}, token_sha256="0f" * 32)
    reg = replace(reg, outbound={"db": 15002, "cache": 15003})
    s = _save(store, empty, register(empty, reg, NOW))
    s = _save(store, s, register(s, registration("api-1", service_account="api"), NOW))
    s = _save(
        store,
        s,
        record_attestation(s, "web-1", record(), IssuedCert(BIG_SERIAL, NOW + 2 * H), NOW + H, NOW),
    )
    s = _save(
        store,
        s,
        record_attestation(s, "web-1", record(), IssuedCert(5, NOW + 3 * H), NOW + 2 * H, NOW),
    )
    s = _save(store, s, quarantine(s, "web-1", Trigger.DEADLINE_MISSED, "late", NOW + H))
    assert store.load(TRUST_DOMAIN).revoked_serials() == {BIG_SERIAL, 5}
    s = _save(store, s, release(s, "web-1", NOW + H))
    s = _save(
        store,
        s,
        record_attestation(s, "web-1", record(), IssuedCert(6, NOW + 4 * H), NOW + 3 * H, NOW),
    )
    pruned = prune_revocations(s, NOW + 2 * H + timedelta(seconds=1))
    assert pruned.revoked_serials() == {5}
    _save(store, s, (pruned, []))


def test_workload_doc_round_trip() -> None:
    s, _ = register(MeshState(TRUST_DOMAIN), registration(labels={"a": "b"}), NOW)
    s, _ = record_attestation(s, "web-1", record(), IssuedCert(3, NOW + H), NOW + H, NOW)
    s, _ = quarantine(s, "web-1", Trigger.TCB_REVOKED, "revoked", NOW)
    w = s.get("web-1")
    assert workload_from_doc(workload_to_doc(w)) == w


def test_restart_keeps_quarantine_revocations_and_events(db: Path) -> None:
    first = SqliteStore(db)
    s0 = MeshState(TRUST_DOMAIN)
    s1, e1 = register(s0, registration(), NOW)
    first.save(s0, s1, e1)
    s2, e2 = record_attestation(s1, "web-1", record(), IssuedCert(77, NOW + H), NOW + H, NOW)
    first.save(s1, s2, e2)
    s3, e3 = quarantine(s2, "web-1", Trigger.VERIFICATION_FAILED, "signature_invalid", NOW)
    first.save(s2, s3, e3)
    first.close()

    second = SqliteStore(db)
    try:
        loaded = second.load(TRUST_DOMAIN)
        w = loaded.get("web-1")
        assert w.status is Status.QUARANTINED
        assert w.quarantine is not None and w.quarantine.trigger is Trigger.VERIFICATION_FAILED
        assert loaded.revoked_serials() == {77}
        assert [e.kind for e in second.events()] == [
            EventKind.REGISTERED,
            EventKind.ATTESTED,
            EventKind.QUARANTINED,
        ]
    finally:
        second.close()


def test_event_log_order_filter_and_limit(store: SqliteStore) -> None:
    s0 = MeshState(TRUST_DOMAIN)
    s1, e1 = register(s0, registration("a"), NOW)
    s2, e2 = register(s1, registration("b"), NOW + H)
    store.save(s0, s2, e1 + e2)
    s3, e3 = quarantine(s2, "a", Trigger.OPERATOR, "because", NOW + 2 * H)
    store.save(s2, s3, e3)
    events = store.events()
    assert events == [
        Event(EventKind.REGISTERED, "a", NOW),
        Event(EventKind.REGISTERED, "b", NOW + H),
        Event(EventKind.QUARANTINED, "a", NOW + 2 * H, "because", Trigger.OPERATOR),
    ]
    assert store.events("a") == [events[0], events[2]]
    assert store.events("b") == [events[1]]
    assert store.events(limit=2) == events[1:]  # the most recent, oldest first
    assert store.events("ghost") == []


def test_save_without_changes_writes_nothing(store: SqliteStore, db: Path) -> None:
    s0 = MeshState(TRUST_DOMAIN)
    s1, e1 = register(s0, registration(), NOW)
    store.save(s0, s1, e1)
    store.save(s1, s1, [])
    assert len(store.events()) == 1


def _rows(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        return {
            t: conn.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]  # noqa: S608
            for t in ("workloads", "revocations", "events")
        }


def _attested_then_quarantined() -> tuple[MeshState, MeshState, list[Event]]:
    s0 = MeshState(TRUST_DOMAIN)
    s1, _ = register(s0, registration(), NOW)
    s2, _ = record_attestation(s1, "web-1", record(), IssuedCert(9, NOW + H), NOW + H, NOW)
    s3, events = quarantine(s2, "web-1", Trigger.OPERATOR, "x", NOW)
    return s2, s3, events


def test_a_failure_mid_transaction_leaves_the_previous_state(store: SqliteStore, db: Path) -> None:
    s0 = MeshState(TRUST_DOMAIN)
    s2, s3, events = _attested_then_quarantined()
    store.save(s0, s2, [])
    before = _rows(db)

    # A batch that cannot be encoded (an event without a time) fails before any row is written.
    bad = [*events, Event(EventKind.RELEASED, "web-1", None)]  # type: ignore[arg-type]
    with pytest.raises(StoreError) as failed:
        store.save(s2, s3, bad)
    assert failed.value.reason == "store_batch_invalid"
    assert store.load(TRUST_DOMAIN) == s2
    assert _rows(db) == before
    # The store is still usable afterwards.
    store.save(s2, s3, events)
    assert store.load(TRUST_DOMAIN) == s3


class _FailingCursor:
    """Delegates to a real cursor; the n-th executemany raises."""

    def __init__(self, real: sqlite3.Cursor, fail_at: int) -> None:
        self._real = real
        self._calls = 0
        self._fail_at = fail_at

    def execute(self, *args: Any) -> Any:
        return self._real.execute(*args)

    def executemany(self, *args: Any) -> Any:
        self._calls += 1
        if self._calls == self._fail_at:
            raise sqlite3.OperationalError("disk I/O error (injected)")
        return self._real.executemany(*args)


class _Connection:
    def __init__(self, real: sqlite3.Connection, fail_at: int) -> None:
        self._real = real
        self._fail_at = fail_at

    def cursor(self) -> _FailingCursor:
        return _FailingCursor(self._real.cursor(), self._fail_at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@pytest.mark.parametrize("fail_at", [2, 3, 5])
def test_injected_executemany_failure_rolls_back(
    store: SqliteStore, db: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    s0 = MeshState(TRUST_DOMAIN)
    s2, s3, events = _attested_then_quarantined()
    store.save(s0, s2, [])
    before = _rows(db)
    monkeypatch.setattr(store, "_db", _Connection(store._db, fail_at))
    with pytest.raises(StoreError, match="injected") as failed:
        store.save(s2, s3, events)
    assert failed.value.reason == "store_commit_failed"
    assert isinstance(failed.value.__cause__, sqlite3.OperationalError)
    monkeypatch.undo()
    assert store.load(TRUST_DOMAIN) == s2
    assert _rows(db) == before
    other = SqliteStore(db)  # another connection sees the same
    try:
        assert other.load(TRUST_DOMAIN) == s2
    finally:
        other.close()
