"""PostgreSQL-only behaviour of the store: failures inside a transaction, broken connections, a
crash of the server itself, credentials kept out of messages."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import psycopg
import pytest

from tests.pg_harness import PgCluster
from tests.unit.fixtures_core import TRUST_DOMAIN
from tests.unit.xds.test_store_batch import ev, rev, wl
from xds import store_pg
from xds.state import MeshState
from xds.store import Batch, SqliteStore, StoreError
from xds.store_pg import PostgresStore, open_store, redact_url

pytestmark = pytest.mark.integration


def _sql(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement.encode())


def test_a_failure_inside_the_transaction_applies_nothing(pg_url: str) -> None:
    s = PostgresStore(pg_url)
    try:
        s.write(Batch(upserts={"a": wl("a")}, events=(ev("a", "first"),)))
        _sql(pg_url, "ALTER TABLE events ADD CONSTRAINT no_boom CHECK (reason <> 'boom')")
        with pytest.raises(StoreError) as failed:  # the events statement runs last
            s.write(
                Batch(
                    upserts={"a": wl("a", 2), "b": wl("b")},
                    revoked=(rev(9),),
                    events=(ev("a", "ok"), ev("a", "boom")),
                )
            )
        assert failed.value.reason == "store_commit_failed"
        assert s.load(TRUST_DOMAIN) == MeshState(TRUST_DOMAIN, {"a": wl("a")})
        assert [e.reason for e in s.events()] == ["first"]
        assert s.stats().failed_commits == 1
        s.write(Batch(upserts={"b": wl("b")}))  # the store goes on
        assert set(s.load(TRUST_DOMAIN).workloads) == {"a", "b"}
    finally:
        s.close()


def test_a_broken_connection_fails_one_commit_and_is_replaced(pg_url: str) -> None:
    s = PostgresStore(pg_url)
    try:
        s.write(Batch(upserts={"a": wl("a")}))
        _sql(
            pg_url,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'attestmesh-controlplane'",
        )
        with pytest.raises(StoreError) as failed:
            s.write(Batch(upserts={"b": wl("b")}))
        assert failed.value.reason == "store_commit_failed"
        s.write(Batch(upserts={"c": wl("c")}))  # a new connection
        assert set(s.load(TRUST_DOMAIN).workloads) == {"a", "c"}
    finally:
        s.close()


async def test_a_server_crash_loses_nothing_acknowledged(pg: PgCluster, pg_url: str) -> None:
    """kill -9 of the PostgreSQL server under group-commit load: every write whose future
    resolved is there after the restart; writes in flight fail (StoreError), none hangs."""
    gc = open_store(pg_url)
    acked: list[int] = []
    failed: list[BaseException] = []

    async def one(k: int) -> None:
        fut = gc.write(Batch(upserts={f"w{k}": wl(f"w{k}", k + 1)}, events=(ev(f"w{k}"),)))
        assert fut is not None
        try:
            await fut
            acked.append(k)
        except StoreError as exc:
            failed.append(exc)

    try:
        tasks: list[asyncio.Task[None]] = []
        for k in range(400):
            tasks.append(asyncio.create_task(one(k)))
            if k == 200:
                while len(acked) < 100:
                    await asyncio.sleep(0.005)
                pg.stop(signal.SIGKILL)  # the whole server, mid-load
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        assert acked and failed, (len(acked), len(failed))
        assert {getattr(e, "reason", "") for e in failed} <= {
            "store_commit_failed",
            "store_unreachable",
        }
    finally:
        gc.close()
    pg.start()
    s = PostgresStore(pg_url)
    try:
        loaded = s.load(TRUST_DOMAIN).workloads
        assert [k for k in acked if loaded.get(f"w{k}") != wl(f"w{k}", k + 1)] == []
    finally:
        s.close()


def test_credentials_stay_out_of_messages(pg: PgCluster) -> None:
    url = f"postgresql://mesh:s3cret-pw@127.0.0.1:{pg.port}/nosuchdb"
    with pytest.raises(StoreError) as refused:
        PostgresStore(url)
    assert refused.value.reason == "store_unreachable"
    assert "s3cret-pw" not in str(refused.value)
    assert "nosuchdb" in str(refused.value)
    assert redact_url(url) == f"postgresql://mesh:***@127.0.0.1:{pg.port}/nosuchdb"
    assert redact_url("postgresql://u@h/db") == "postgresql://u@h/db"


def test_open_store_picks_the_backend_from_the_spec(pg_url: str, tmp_path: Path) -> None:
    for spec, kind in ((pg_url, PostgresStore), (str(tmp_path / "s.db"), SqliteStore)):
        gc = open_store(spec)
        try:
            assert isinstance(gc.backend, kind)
        finally:
            gc.close()
    assert (tmp_path / "s.db").exists()


def test_the_stores_sessions_are_ended_by_the_server_when_left_inside_a_transaction(
    pg_url: str,
) -> None:
    """A replica frozen mid-transaction must not hold its row locks for ever: the server ends
    the session after IDLE_IN_TRANSACTION_MS."""
    with store_pg._connect(pg_url) as conn:
        shown = conn.execute(b"SHOW idle_in_transaction_session_timeout").fetchone()
    assert shown is not None
    assert shown[0] == f"{store_pg.IDLE_IN_TRANSACTION_MS // 1000}s"
