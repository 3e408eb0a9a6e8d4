"""Row-granular batches: what a Batch means, and that only its rows are written."""

from __future__ import annotations

import json
import sqlite3
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.state import (
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    Revocation,
    Status,
    Trigger,
    WorkloadState,
)
from xds.store import (
    Batch,
    SqliteStore,
    StoreError,
    diff,
    merge,
    workload_from_doc,
    workload_to_doc,
)

H = timedelta(hours=1)


def wl(name: str, serial: int = 1, port: int = 15001) -> WorkloadState:
    return WorkloadState(
        registration(name, port=port),
        Status.ATTESTED,
        record(),
        NOW + H,
        (IssuedCert(serial, NOW + 2 * H),),
    )


def rev(serial: int, workload: str = "a") -> Revocation:
    return Revocation(serial, NOW + 2 * H, NOW, workload)


def ev(workload: str, reason: str = "") -> Event:
    return Event(EventKind.ATTESTED, workload, NOW, reason)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "mesh.db"


@pytest.fixture
def store(db: Path) -> Iterator[SqliteStore]:
    s = SqliteStore(db)
    yield s
    s.close()


def test_empty_batch() -> None:
    assert Batch().empty()
    assert not Batch(upserts={"a": wl("a")}).empty()
    assert not Batch(deletes=frozenset({"a"})).empty()
    assert not Batch(revoked=(rev(1),)).empty()
    assert not Batch(unrevoked=frozenset({1})).empty()
    assert not Batch(events=(ev("a"),)).empty()


def test_upsert_delete_revoke_unrevoke_events(store: SqliteStore) -> None:
    first = Batch(
        upserts={"a": wl("a"), "b": wl("b", 2)},
        revoked=(rev(10), rev(2**159 - 1, "b")),
        events=(ev("a", "one"), ev("b", "two")),
    )
    assert store.write(first) is None  # durable on return
    assert store.load(TRUST_DOMAIN) == MeshState(
        TRUST_DOMAIN, {"a": wl("a"), "b": wl("b", 2)}, (rev(10), rev(2**159 - 1, "b"))
    )
    second = Batch(
        upserts={"a": wl("a", 3)},
        deletes=frozenset({"b"}),
        unrevoked=frozenset({10}),
        events=(ev("a", "three"),),
    )
    store.write(second)
    assert store.load(TRUST_DOMAIN) == MeshState(
        TRUST_DOMAIN, {"a": wl("a", 3)}, (rev(2**159 - 1, "b"),)
    )
    assert [e.reason for e in store.events()] == ["one", "two", "three"]
    assert [e.reason for e in store.events("a")] == ["one", "three"]


def test_within_a_batch_deletes_follow_upserts_and_unrevoked_follows_revoked(
    store: SqliteStore,
) -> None:
    store.write(
        Batch(
            upserts={"a": wl("a"), "b": wl("b")},
            deletes=frozenset({"a"}),
            revoked=(rev(1), rev(2)),
            unrevoked=frozenset({1}),
        )
    )
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"b": wl("b")}, (rev(2),))


def test_deleting_what_is_not_there_changes_nothing(store: SqliteStore, db: Path) -> None:
    store.write(Batch(upserts={"a": wl("a")}))
    store.write(Batch(deletes=frozenset({"ghost"}), unrevoked=frozenset({99})))
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"a": wl("a")})


def _other_connection_changes(db: Path) -> sqlite3.Connection:
    return sqlite3.connect(db, isolation_level=None)


def test_only_the_rows_in_the_batch_are_written(store: SqliteStore, db: Path) -> None:
    store.write(Batch(upserts={f"w-{i:03d}": wl(f"w-{i:03d}", i) for i in range(100)}))
    # A row changed behind the store's back: a store that rewrote every row would undo this.
    sentinel = json.dumps(workload_to_doc(wl("w-050", 4242)))
    with _other_connection_changes(db) as other:
        other.execute("UPDATE workloads SET doc = ? WHERE name = 'w-050'", (sentinel,))
    other.close()
    before = store._db.total_changes
    store.write(
        Batch(upserts={"w-001": wl("w-001", 7)}, revoked=(rev(5, "w-001"),), events=(ev("w-001"),))
    )
    assert store._db.total_changes - before == 3  # one workload, one revocation, one event
    loaded = store.load(TRUST_DOMAIN)
    assert loaded.workloads["w-050"] == wl("w-050", 4242)
    assert loaded.workloads["w-001"] == wl("w-001", 7)
    assert loaded.workloads["w-002"] == wl("w-002", 2)


def test_save_writes_only_what_differs(store: SqliteStore) -> None:
    old = MeshState(TRUST_DOMAIN, {f"w-{i}": wl(f"w-{i}", i) for i in range(50)})
    store.save(MeshState(TRUST_DOMAIN), old, [])
    new = replace(old, workloads={**old.workloads, "w-7": wl("w-7", 700)})
    before = store._db.total_changes
    store.save(old, new, [ev("w-7")])
    assert store._db.total_changes - before == 2
    assert store.load(TRUST_DOMAIN) == new


def test_an_upsert_under_another_name_is_refused(store: SqliteStore) -> None:
    with pytest.raises(StoreError) as refused:
        store.write(Batch(upserts={"a": wl("b")}, events=(ev("a"),)))
    assert refused.value.reason == "store_batch_invalid"
    assert store.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN)
    assert store.events() == []


def test_write_group_is_one_commit_and_counts(store: SqliteStore) -> None:
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


def test_diff_is_the_batch_between_two_states() -> None:
    old = MeshState(TRUST_DOMAIN, {"a": wl("a"), "b": wl("b"), "c": wl("c")}, (rev(1), rev(2)))
    new = MeshState(TRUST_DOMAIN, {"a": wl("a"), "b": wl("b", 9), "d": wl("d")}, (rev(2), rev(3)))
    events = [ev("b")]
    assert diff(old, new, events) == Batch(
        upserts={"b": wl("b", 9), "d": wl("d")},
        deletes=frozenset({"c"}),
        revoked=(rev(3),),
        unrevoked=frozenset({1}),
        events=(ev("b"),),
    )
    assert diff(old, old).empty()


def test_merge_is_the_net_effect_in_order() -> None:
    merged = merge(
        [
            Batch(upserts={"a": wl("a"), "b": wl("b")}, revoked=(rev(1),), events=(ev("a"),)),
            Batch(deletes=frozenset({"a"}), unrevoked=frozenset({1, 2}), events=(ev("b"),)),
            Batch(upserts={"a": wl("a", 5)}, revoked=(rev(2),)),
            Batch(upserts={"b": wl("b", 6)}, deletes=frozenset({"b"})),
        ]
    )
    assert merged == Batch(
        upserts={"a": wl("a", 5)},
        deletes=frozenset({"b"}),
        revoked=(rev(2),),
        unrevoked=frozenset({1}),
        events=(ev("a"), ev("b")),
    )


def test_documents_round_trip_and_are_compact() -> None:
    w = replace(
        wl("a"),
        status=Status.QUARANTINED,
        quarantine=None,
        registration=replace(registration("a"), outbound={"db": 1}, labels={"x": "y"}),
    )
    assert workload_from_doc(json.loads(json.dumps(workload_to_doc(w)))) == w


# A model of the tables, to check that sequential writes, one group and a merged batch agree.
NAMES = st.sampled_from(["a", "b", "c"])
SERIALS = st.integers(min_value=1, max_value=4)
batches = st.builds(
    Batch,
    upserts=st.dictionaries(NAMES, st.integers(1, 9)).map(
        lambda d: {n: wl(n, s) for n, s in d.items()}
    ),
    deletes=st.frozensets(NAMES),
    revoked=st.lists(SERIALS, unique=True).map(lambda xs: tuple(rev(x) for x in xs)),
    unrevoked=st.frozensets(SERIALS),
    events=st.lists(NAMES, max_size=2).map(lambda xs: tuple(ev(x) for x in xs)),
)


def model(bs: list[Batch]) -> tuple[dict[str, WorkloadState], dict[int, Revocation], int]:
    rows: dict[str, WorkloadState] = {}
    revs: dict[int, Revocation] = {}
    events = 0
    for b in bs:
        rows.update(b.upserts)
        for n in b.deletes:
            rows.pop(n, None)
        revs.update((r.serial, r) for r in b.revoked)
        for s in b.unrevoked:
            revs.pop(s, None)
        events += len(b.events)
    return rows, revs, events


@settings(max_examples=40, deadline=None)
@given(st.lists(batches, max_size=6))
def test_sequential_grouped_and_merged_writes_agree(bs: list[Batch]) -> None:
    rows, revs, events = model(bs)
    with tempfile.TemporaryDirectory() as tmp:
        stores = [SqliteStore(Path(tmp) / f"{k}.db") for k in range(3)]
        try:
            for b in bs:
                stores[0].write(b)
            stores[1].write_group(bs)
            stores[2].write(merge(bs))
            for s in stores:
                loaded = s.load(TRUST_DOMAIN)
                assert dict(loaded.workloads) == rows
                assert {r.serial: r for r in loaded.revocations} == revs
                assert len(s.events(limit=100)) == events
            assert stores[1].stats().commits == (1 if model_nonempty(bs) else 0)
        finally:
            for s in stores:
                s.close()


def model_nonempty(bs: list[Batch]) -> bool:
    return any(not b.empty() for b in bs)


def test_quarantine_event_round_trips(store: SqliteStore) -> None:
    e = Event(EventKind.QUARANTINED, "a", NOW, "late", Trigger.DEADLINE_MISSED)
    store.write(Batch(events=(e,)))
    assert store.events() == [e]
