"""A deferred TCB quarantine on PostgreSQL (the store several replicas share): the deadline a
replica decided is in the workload's row, so a second replica that takes over after the first
one stops quarantines at that deadline, not a grace period later."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

import tests.unit.evidence.dcap_fixtures as fx
from tests.component.test_tcb_monitor import OUT_OF_DATE, _policy, make_env
from tests.unit.fixtures_core import TRUST_DOMAIN
from xds.state import EventKind, Status, Trigger
from xds.store_pg import PG_SCHEMA_VERSION, PostgresStore

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
    assert PG_SCHEMA_VERSION == 4
    with psycopg.connect(pg_url) as conn:
        assert [v for (v,) in conn.execute("SELECT version FROM schema_version")][-1] == 4
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
