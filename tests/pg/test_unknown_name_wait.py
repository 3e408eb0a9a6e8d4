"""An agent reaching a replica before that replica's change feed has delivered its workload's
registration (made through another replica a moment before) is served, not refused as
unknown: the replica looks for the name again after its feed has read once more. A name
nobody registered is still refused, after that one read; requests waiting at the same time
share it; a replica whose feed does not read refuses once the wait is up."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from attestmesh.controlplane import service
from certs.issuance import IdentityError
from certs.standing import UnknownWorkloadError
from tests.pg.replicas import Replica
from tests.unit.fixtures_core import NOW, Clock, registration
from xds.state import Status
from xds.store_pg import Changes

pytestmark = pytest.mark.integration


@pytest.fixture
async def two(pg_url: str, tmp_path: Path) -> AsyncIterator[tuple[Replica, Replica]]:
    clock = Clock(NOW)
    a = Replica(pg_url, tmp_path / "ca-a", clock, replicate=True)
    b = Replica(pg_url, tmp_path / "ca-b", clock, replicate=True)
    try:
        yield a, b
    finally:
        b.close()  # (with its feed and replication: attached to its store)
        a.close()


def _waits(r: Replica, result: str) -> float:
    return r.metrics.unknown_names.labels(result)._value.get()


def _hold_deliveries(r: Replica) -> threading.Event:
    """``r``'s feed holds what it reads until the returned event is set (as a feed a moment
    behind would)."""
    feed = r.feed
    assert feed is not None
    gate = threading.Event()
    deliver = feed._deliver

    def held(changes: Changes) -> object:
        gate.wait(10)
        return deliver(changes)

    feed._deliver = held
    return gate


async def test_an_agent_ahead_of_the_feed_is_served(two: tuple[Replica, Replica]) -> None:
    a, b = two
    gate = _hold_deliveries(b)  # until the agent waits
    await a.register([registration("web-1")])
    assert "web-1" not in b.cp.state.workloads
    served = asyncio.ensure_future(b.attest("web-1"))
    await asyncio.sleep(0.05)
    assert not served.done()  # waiting for the feed, not refused
    gate.set()
    issued = await asyncio.wait_for(served, 10)
    assert issued.serial > 0
    assert b.cp.status_of("web-1") is Status.ATTESTED
    assert _waits(b, "found") == 1
    await b.attest("web-1")  # held now: no wait
    assert _waits(b, "found") == 1


async def test_a_name_nobody_registered_is_refused_after_one_read(
    two: tuple[Replica, Replica],
) -> None:
    _, b = two
    feed = b.replication.feed if b.replication is not None else None
    assert feed is not None
    async with asyncio.timeout(5):  # connected and read once (a replica just started)
        while feed.reads_begun == 0:
            await asyncio.sleep(0.01)
    before = feed.reads_begun
    results = await asyncio.gather(
        *(b.attest(f"nobody-{i}") for i in range(20)), return_exceptions=True
    )
    assert all(isinstance(r, UnknownWorkloadError) for r in results), results
    assert _waits(b, "unknown") == 20
    # the 20 waited together: one read (two when the first had begun as they came)
    assert feed.reads_begun - before <= 2


async def test_a_replica_whose_feed_does_not_read_refuses_when_the_wait_is_up(
    two: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two
    assert b.replication is not None
    b.replication.feed.close()  # (as cut off: it reads nothing more)
    monkeypatch.setattr(service, "FEED_WAIT_S", 0.3)
    await a.register([registration("web-2")])
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(UnknownWorkloadError):
        await b.attest("web-2")
    assert 0.3 <= loop.time() - t0 < 2
    assert _waits(b, "feed_unavailable") == 1


async def test_a_reconnecting_feed_serves_the_wait_when_it_reads_again(
    two: tuple[Replica, Replica], pg_url: str
) -> None:
    a, b = two
    feed = b.feed
    assert feed is not None
    async with asyncio.timeout(5):
        while not feed.connected:
            await asyncio.sleep(0.01)
    with psycopg.connect(pg_url, autocommit=True) as conn:  # every feed loses its connection
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'attestmesh-changefeed'"
        )
    await a.register([registration("web-3")])
    issued = await asyncio.wait_for(b.attest("web-3"), service.FEED_WAIT_S)
    assert issued.serial > 0
    assert feed.reconnects >= 1
    assert _waits(b, "found") + _waits(b, "unknown") + _waits(b, "feed_unavailable") <= 1


async def test_a_row_found_after_the_wait_still_checks_the_caller(
    two: tuple[Replica, Replica],
) -> None:
    # the wait finds the row; it does not stand in for the identity check: a caller with the
    # wrong join token is refused, the right one served
    a, b = two
    digest = hashlib.sha256(b"join-token").hexdigest()
    gate = _hold_deliveries(b)
    await a.register([registration("web-4", token_sha256=digest)])
    guessed = asyncio.ensure_future(b.cp.attest(b.request("web-4"), "guessed"))
    await asyncio.sleep(0.05)
    assert not guessed.done()  # waiting for the feed
    gate.set()
    with pytest.raises(IdentityError):
        await asyncio.wait_for(guessed, 10)
    assert _waits(b, "found") == 1
    assert b.cp.status_of("web-4") is Status.PENDING
    issued = await b.cp.attest(b.request("web-4"), "join-token")
    assert issued.serial > 0
