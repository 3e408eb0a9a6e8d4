"""A deferred TCB quarantine on PostgreSQL (the store several replicas share): the deadline a
replica decided is in the workload's row, so a second replica that takes over after the first
one stops quarantines at that deadline, not a grace period later."""

from __future__ import annotations

import asyncio
import queue
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

import tests.unit.evidence.dcap_fixtures as fx
from tests.component.test_tcb_monitor import OUT_OF_DATE, _policy, make_env
from tests.unit.fixtures_core import TRUST_DOMAIN, registration
from xds.state import EventKind, Status, Trigger
from xds.store import GroupCommitStore
from xds.store_pg import PG_SCHEMA_VERSION, Changes, PostgresStore, follow

pytestmark = pytest.mark.integration


async def test_another_replica_quarantines_at_the_deadline_the_first_decided(
    tmp_path: Path, pg_url: str
) -> None:
    policy = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    a = make_env(tmp_path, policy, store=PostgresStore(pg_url))
    await a.attest("web-1")
    await a.monitor.refresh()
    a.pcs.publish(fx.build_collateral(a.pki, tdx=True, levels=OUT_OF_DATE))
    a.clock.advance(hours=1, seconds=1)
    await a.monitor.refresh()
    deadline = a.clock() + timedelta(minutes=10)
    assert PG_SCHEMA_VERSION >= 4  # 4: documents may carry a TCB deferral
    with psycopg.connect(pg_url) as conn:
        versions = [v for (v,) in conn.execute("SELECT version FROM schema_version ORDER BY 1")]
    assert versions[-1] == PG_SCHEMA_VERSION
    # replica B starts on the same database 4 minutes later; then A goes away
    a.clock.advance(minutes=4)
    b = make_env(tmp_path, policy, store=PostgresStore(pg_url), like=a)
    a.store.close()
    row = b.cp.state.get("web-1")
    assert row.tcb_deferral is not None and row.tcb_deferral.due == deadline
    assert await b.monitor.refresh() == []  # B's own re-appraisal keeps A's deadline
    assert b.cp.state.get("web-1").tcb_deferral == row.tcb_deferral
    b.clock.advance(minutes=5, seconds=59)
    assert b.cp.check_deadlines() == [] and b.cp.status_of("web-1") is Status.ATTESTED
    b.clock.advance(seconds=1)
    b.cp.check_deadlines()
    assert b.cp.status_of("web-1") is Status.QUARANTINED
    stored = b.store.load(TRUST_DOMAIN).get("web-1")
    assert stored.status is Status.QUARANTINED and stored.tcb_deferral is None
    (last,) = b.store.events("web-1", limit=1)
    assert last.kind is EventKind.QUARANTINED and last.trigger is Trigger.TCB_CHANGED
    b.store.close()


@pytest.mark.parametrize("group_commit", [False, True])
async def test_a_deferral_decided_on_a_stale_row_is_decided_again_on_the_stored_one(
    tmp_path: Path, pg_url: str, group_commit: bool
) -> None:
    """Replica B changed the workload's row (its labels) after A last read it: A's deferral
    batch is refused by the database, A adopts the stored row and records the deferral on it
    (B's change is kept, the deadline is the one A decided)."""
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    strict = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    # the production wiring: writes through the group-commit thread, conflicts resolved in
    # the write's callback; or the synchronous store (the conflict raised in the call)
    opened = PostgresStore(pg_url)
    store = GroupCommitStore(opened) if group_commit else opened
    a = make_env(tmp_path, lenient, store=store)
    await a.attest("web-1", fx.build_collateral(a.pki, tdx=True, levels=OUT_OF_DATE))
    await a.cp.flushed()
    b = make_env(tmp_path, lenient, store=PostgresStore(pg_url), like=a)
    b.cp.register([registration("web-1", labels={"team": "ml"})])
    assert a.cp.state.get("web-1").registration.labels == {}  # A has not seen it (no feed)
    a.cp.set_policies([strict])
    for _ in range(3):  # the refused batch, then the one decided again
        await a.cp.flushed()
        await asyncio.sleep(0)
    assert opened.stats().conflicts == 1  # refused once, then recorded on the stored row
    stored = a.store.load(TRUST_DOMAIN).get("web-1")
    assert stored.registration.labels == {"team": "ml"}
    assert stored.tcb_deferral is not None
    assert stored.tcb_deferral.due == a.clock() + timedelta(minutes=10)
    assert a.cp.state.get("web-1") == stored  # A's view is the stored row
    assert (
        a.metrics.registry.get_sample_value(
            "attestmesh_tcb_reappraisals_total", {"outcome": "deferred"}
        )
        == 1.0
    )
    a.clock.advance(minutes=10)
    a.cp.check_deadlines()
    await a.cp.flushed()
    assert a.store.load(TRUST_DOMAIN).get("web-1").status is Status.QUARANTINED
    a.store.close()
    b.store.close()


async def test_a_running_replica_learns_the_deadline_from_the_change_feed(
    tmp_path: Path, pg_url: str
) -> None:
    """B runs beside A and follows the database (its change feed): the deferral A records
    reaches B as a row; when A stops before the deadline, B quarantines at it."""
    lenient = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    lenient["spec"]["referenceValues"]["tdx"]["acceptedTcbStatuses"] = ["UpToDate", "OutOfDate"]
    strict = _policy(onTcbChange="quarantine", tcbChangeGracePeriod="10m")
    a = make_env(tmp_path, lenient, store=PostgresStore(pg_url, origin="a"))
    await a.attest("web-1", fx.build_collateral(a.pki, tdx=True, levels=OUT_OF_DATE))
    b_store = GroupCommitStore(PostgresStore(pg_url, origin="b"))  # as the CLI wires it
    b = make_env(tmp_path, strict, store=b_store, like=a)
    got: queue.Queue[Changes] = queue.Queue()
    _, feed = follow(b_store, TRUST_DOMAIN, got.put)
    assert feed is not None
    feed.start()
    try:
        a.cp.set_policies([strict])
        deadline = a.clock() + timedelta(minutes=10)
        until = time.monotonic() + 10
        while b.cp.state.get("web-1").tcb_deferral is None:
            b.cp.adopt_changes(got.get(timeout=max(0.01, until - time.monotonic())))
        assert b.cp.state.get("web-1").tcb_deferral == a.cp.state.get("web-1").tcb_deferral
    finally:
        feed.close()
    a.store.close()  # A goes away before the deadline
    b.clock.advance(minutes=9, seconds=59)
    assert b.cp.check_deadlines() == [] and b.cp.status_of("web-1") is Status.ATTESTED
    b.clock.advance(seconds=1)
    assert b.clock() == deadline
    b.cp.check_deadlines()
    await b.cp.flushed()
    assert b.store.load(TRUST_DOMAIN).get("web-1").status is Status.QUARANTINED
    b_store.close()
