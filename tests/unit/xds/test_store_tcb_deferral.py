"""A deferred TCB quarantine in the workload document: it round-trips, a row without one is
encoded as before schema 4 (so its bytes, and what older code reads, do not change), and a
SQLite database of schema 3 opens at 4 with its rows intact."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.state import MeshState, Status, TcbDeferral, WorkloadState, set_tcb_deferrals
from xds.store import SqliteStore, workload_from_doc, workload_to_doc


def _attested() -> WorkloadState:
    return WorkloadState(registration("web-1"), Status.ATTESTED, record(), NOW + timedelta(hours=1))


def test_the_deferral_round_trips_and_its_absence_changes_nothing() -> None:
    w = _attested()
    plain = workload_to_doc(w)
    assert "tcb_deferral" not in plain
    d = TcbDeferral(NOW + timedelta(minutes=10), "ab" * 32, "tcb_status_not_accepted: OutOfDate",
                    "tcb_status_not_accepted", revoked=True)  # fmt: skip
    doc = workload_to_doc(replace(w, tcb_deferral=d))
    assert {k: v for k, v in doc.items() if k != "tcb_deferral"} == plain
    assert workload_from_doc(json.loads(json.dumps(doc))) == replace(w, tcb_deferral=d)
    assert workload_from_doc(json.loads(json.dumps(plain))) == w


def test_a_deferral_is_only_recorded_on_the_evidence_it_names() -> None:
    state = MeshState(TRUST_DOMAIN, {"web-1": _attested()})
    other = TcbDeferral(NOW, "cd" * 32, "r", "c")  # about evidence web-1 no longer presents
    assert set_tcb_deferrals(state, {"web-1": other, "ghost": other}) == (state, [])
    mine = replace(other, evidence_sha256="ab" * 32)
    new, changed = set_tcb_deferrals(state, {"web-1": mine})
    assert changed == ["web-1"] and new.get("web-1").tcb_deferral == mine
    assert set_tcb_deferrals(new, {"web-1": mine}) == (new, [])  # unchanged: no row written
    dropped, changed = set_tcb_deferrals(new, {"web-1": None})
    assert changed == ["web-1"] and dropped.get("web-1").tcb_deferral is None


def test_a_schema_3_database_opens_at_4_with_its_rows(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    SqliteStore(db).close()
    w = _attested()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("UPDATE schema_version SET version = 3")
    conn.execute("INSERT INTO workloads VALUES(?, ?)", ("web-1", json.dumps(workload_to_doc(w))))
    conn.close()
    store = SqliteStore(db)
    try:
        assert store.version == 4
        assert store.load(TRUST_DOMAIN).get("web-1") == w
    finally:
        store.close()
