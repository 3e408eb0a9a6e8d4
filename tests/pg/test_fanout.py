"""Cross-replica fan-out on one PostgreSQL database: the change log, LISTEN/NOTIFY and the
catch-up read (after a lost connection, after the log was pruned), and two control planes where
what one commits (attestation, quarantine, release, CRL) reaches the other's view and
announcements."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.pg.replicas import Replica
from tests.pg_harness import PgCluster
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, Clock, registration
from tests.unit.xds.test_store_batch import rev, wl
from xds.state import Status, Trigger
from xds.store import Batch, workload_to_doc
from xds.store_pg import ChangeFeed, Changes, PostgresStore, follow, open_store

pytestmark = pytest.mark.integration


def feed_on(
    url: str, origin: str, after: tuple[int, int] = (0, 0), **options: object
) -> tuple[ChangeFeed, queue.Queue[Changes]]:
    got: queue.Queue[Changes] = queue.Queue()
    feed = ChangeFeed(
        url,
        origin=origin,
        after=after,
        trust_domain=TRUST_DOMAIN,
        deliver=got.put,
        **options,  # type: ignore[arg-type]
    )
    return feed.start(), got


def collect(
    got: queue.Queue[Changes],
    until: Callable[[dict[str, object], set[int]], bool],
    timeout: float = 10,
) -> tuple[dict[str, object], set[int]]:
    """Apply delivered changes to a model (rows, revoked serials) until ``until`` holds."""
    rows: dict[str, object] = {}
    revoked: set[int] = set()
    deadline = time.monotonic() + timeout
    while not until(rows, revoked):
        ch = got.get(timeout=max(0.01, deadline - time.monotonic()))
        if ch.resync:
            rows.clear()
            revoked.clear()
        rows.update(ch.workloads)
        revoked |= {r.serial for r in ch.revoked}
        revoked -= ch.unrevoked
    return rows, revoked


def test_the_feed_delivers_the_other_replicas_rows_and_skips_its_own(pg_url: str) -> None:
    mine, other = PostgresStore(pg_url, origin="mine"), PostgresStore(pg_url, origin="other")
    feed, got = feed_on(pg_url, "mine")
    try:
        mine.write(Batch(upserts={"m": wl("m")}))
        other.write(Batch(upserts={"a": wl("a", 1), "b": wl("b")}, revoked=(rev(5), rev(6))))
        other.write(
            Batch(upserts={"a": wl("a", 2)}, deletes=frozenset({"b"}), unrevoked=frozenset({5}))
        )
        rows, revoked = collect(
            got, lambda r, s: r.get("a") == wl("a", 2) and "b" in r and r["b"] is None and s == {6}
        )
        assert "m" not in rows  # its own replica's change
        assert revoked == {6}
        assert feed.connected
    finally:
        feed.close()
        mine.close()
        other.close()


def test_after_a_lost_connection_the_feed_catches_up(pg_url: str) -> None:
    other = PostgresStore(pg_url, origin="other")
    feed, got = feed_on(pg_url, "mine", retry_seconds=0.1)
    try:
        other.write(Batch(upserts={"a": wl("a", 1)}))
        collect(got, lambda r, s: r.get("a") == wl("a", 1))
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'attestmesh-changefeed'"
            )
        for i in range(2, 30):  # written while the feed reconnects: none may be missed
            other.write(Batch(upserts={f"w{i}": wl(f"w{i}", i)}))
        rows, _ = collect(got, lambda r, s: all(f"w{i}" in r for i in range(2, 30)))
        assert all(rows[f"w{i}"] == wl(f"w{i}", i) for i in range(2, 30))
        assert feed.reconnects >= 1
    finally:
        feed.close()
        other.close()


def test_a_follower_behind_a_pruned_log_gets_everything(pg_url: str) -> None:
    other = PostgresStore(pg_url, origin="other", max_changes=10)
    try:
        other.write(Batch(upserts={"gone": wl("gone")}))
        with psycopg.connect(pg_url) as conn:  # a follower that read this first change only
            first = conn.execute("SELECT xid::text::bigint, seq FROM changes").fetchone()
        assert first is not None
        for i in range(40):
            other.write(Batch(upserts={f"w{i}": wl(f"w{i}", i + 1)}))
        other.write(Batch(deletes=frozenset({"gone"})))
        feed, got = feed_on(pg_url, "mine", after=(int(first[0]), int(first[1])))
        try:
            ch = got.get(timeout=10)
            assert ch.resync
            assert set(ch.workloads) == {f"w{i}" for i in range(40)}
        finally:
            feed.close()
    finally:
        other.close()


async def test_what_one_replica_commits_reaches_the_other(pg_url: str, tmp_path: Path) -> None:
    clock = Clock(NOW)
    a = Replica(pg_url, tmp_path / "ca", clock, follow_changes=True)
    b = Replica(pg_url, tmp_path / "ca", clock, follow_changes=True)
    try:

        async def on_b(check: Callable[[], bool]) -> None:
            async with asyncio.timeout(10):
                while not check():
                    await asyncio.sleep(0.01)

        def b_announced(name: str, status: Status) -> bool:
            state = b.publisher.last_state if b.publisher.published else None
            return (
                state is not None
                and name in state.workloads
                and state.workloads[name].status is status
            )

        await a.register([registration("web-1"), registration("web-2", port=15002)])
        await on_b(lambda: b_announced("web-1", Status.PENDING))  # a registration
        issued = await a.attest("web-1")
        await on_b(lambda: b_announced("web-1", Status.ATTESTED))  # an attestation
        assert b.cp.state.get("web-1").certificates[-1].serial == issued.serial
        assert a.cp.quarantine("web-1", Trigger.OPERATOR, "on a")
        await a.cp.flushed()
        await on_b(lambda: b_announced("web-1", Status.QUARANTINED))  # a quarantine
        # the CRL B's Envoys get covers the certificate A revoked
        await on_b(lambda: issued.serial in b.cp.state.revoked_serials())
        from cryptography import x509

        crl = x509.load_pem_x509_crl(b.publisher.last_trust.crl_pem)
        assert crl.get_revoked_certificate_by_serial_number(issued.serial) is not None
        # B refuses the quarantined workload from its own view, no database round trip needed
        with pytest.raises(Exception, match="quarantined"):
            await b.attest("web-1")
        assert b.cp.release("web-1")  # a release on B reaches A
        await b.cp.flushed()
        async with asyncio.timeout(10):
            while a.cp.status_of("web-1") is not Status.PENDING:
                await asyncio.sleep(0.01)
        # A's state takes the change first; its announcement to Envoys follows (the publisher
        # runs on the same loop, right after): wait for it too, then it is what A serves
        async with asyncio.timeout(10):
            while a.publisher.last_state.workloads["web-1"].status is not Status.PENDING:
                await asyncio.sleep(0.01)
        assert a.cp.status_of("web-1") is Status.PENDING
        again = await a.attest("web-1")
        await on_b(lambda: b_announced("web-1", Status.ATTESTED))
        assert b.cp.state.get("web-1").certificates[-1].serial == again.serial
    finally:
        a.close()
        b.close()


def test_follow_on_sqlite_is_one_replica(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s.db")
    try:
        state, feed = follow(store, TRUST_DOMAIN, lambda ch: None)
        assert feed is None and state.workloads == {}
    finally:
        store.close()


def test_the_feed_reconnects_after_a_server_restart(pg: PgCluster, pg_url: str) -> None:
    feed, got = feed_on(pg_url, "mine", retry_seconds=0.1)
    try:
        pg.restart()
        other = PostgresStore(pg_url, origin="other")
        try:
            other.write(Batch(upserts={"after": wl("after")}))
            collect(got, lambda r, s: "after" in r, timeout=20)
        finally:
            other.close()
    finally:
        feed.close()


async def test_a_change_arriving_while_a_write_is_in_flight_is_read_again(
    pg_url: str, tmp_path: Path
) -> None:
    """A's renewal commits, but A learns it late (its writer is slow to report); meanwhile B,
    having seen the renewal, quarantines. The feed brings the quarantine to A while A's write
    on that row is still in flight, so A leaves it alone; once the write resolves A reads the
    row again and adopts the quarantine (it would otherwise keep the renewed row).

    The writer reports only once the test saw the quarantine skipped (an event, not a sleep:
    under load B's quarantine may take longer than any fixed delay to reach A)."""
    import threading

    clock = Clock(NOW)
    a = Replica(pg_url, tmp_path / "ca-a", clock, replicate=True)
    b = Replica(pg_url, tmp_path / "ca-b", clock, replicate=True)
    try:
        await a.register([registration("web-1")])
        await a.attest("web-1")
        async with asyncio.timeout(10):  # B may not know web-1 at all yet
            while (
                w := b.cp.state.workloads.get("web-1")
            ) is None or w.status is not Status.ATTESTED:
                await asyncio.sleep(0.01)
        resolve = a.store._resolve

        report = threading.Event()

        def slow(outcomes: object) -> None:  # the writer thread: committed, reported late
            report.wait(10)
            resolve(outcomes)  # type: ignore[arg-type]

        a.store._resolve = slow  # type: ignore[method-assign]
        renewal = asyncio.create_task(a.attest("web-1"))
        async with asyncio.timeout(10):  # B sees the renewal from the database
            while len(b.cp.state.get("web-1").certificates) < 2:
                await asyncio.sleep(0.01)
        assert b.cp.quarantine("web-1", Trigger.OPERATOR, "on b")
        await b.cp.flushed()
        async with asyncio.timeout(10):  # the quarantine reached A while its write was in flight
            while "web-1" not in a.cp._skipped:
                await asyncio.sleep(0.01)
        assert a.cp.status_of("web-1") is Status.ATTESTED and not renewal.done()
        a.store._resolve = resolve  # type: ignore[method-assign]
        report.set()
        await renewal  # the renewal itself was durable before the quarantine
        # A's state adopts the row first; its announcement follows on the loop (coalesced,
        # scheduled with call_soon): wait for that, then it is what A serves
        async with asyncio.timeout(10):
            while a.publisher.last_state.workloads["web-1"].status is not Status.QUARANTINED:
                await asyncio.sleep(0.01)
        assert a.cp.status_of("web-1") is Status.QUARANTINED
    finally:
        a.close()
        b.close()


def test_commits_do_not_wait_for_each_other_and_the_feed_follows_transaction_order(
    pg_url: str,
) -> None:
    """A replica's transaction still open (older: it took its transaction id first) does not
    hold up another replica's commit (no lock serialises commits); the feed delivers the newer
    commit only once the older transaction ended, and misses neither (a follower reading in
    commit order alone would have passed the older one's change by)."""
    PostgresStore(pg_url, origin="setup").close()  # the schema
    other = PostgresStore(pg_url, origin="other")
    feed, got = feed_on(pg_url, "mine", poll_seconds=0.05)
    try:
        with psycopg.connect(pg_url) as slow:  # a transaction, open until commit below
            slow.execute(
                "INSERT INTO workloads(name, doc) VALUES ('slow', %s)",
                (json.dumps(workload_to_doc(wl("slow"))),),
            )
            slow.execute("INSERT INTO changes(kind, key, origin) VALUES ('w', 'slow', 'third')")
            started = time.monotonic()
            other.write(Batch(upserts={"fast": wl("fast")}))  # commits while 'slow' is open
            assert time.monotonic() - started < 2.0
            time.sleep(0.5)  # several polls: 'fast' is held back behind the running one
            assert got.empty()
            slow.commit()
        rows, _ = collect(got, lambda r, s: "slow" in r and "fast" in r)
        assert rows["slow"] == wl("slow") and rows["fast"] == wl("fast")
    finally:
        feed.close()
        other.close()
