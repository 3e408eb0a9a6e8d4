"""Two control planes on one PostgreSQL database: concurrent attestations on one replica and
quarantines on the other. Each replica decides on its own (possibly stale) view; the database
serialises the decisions: no certificate is handed out for a workload once its quarantine is
committed, and no quarantine is lost."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from certs.errors import AttestmeshError
from tests.pg.replicas import Replica
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, Clock, registration
from xds.state import EventKind, Status, Trigger
from xds.store_pg import PostgresStore

pytestmark = pytest.mark.integration

N = 24


async def test_concurrent_attest_and_quarantine_across_two_replicas(
    pg_url: str, tmp_path: Path
) -> None:
    clock = Clock(NOW)
    names = [f"web-{i}" for i in range(N)]
    a = Replica(pg_url, tmp_path / "ca", clock)
    try:
        await a.register([registration(n, port=15001 + i) for i, n in enumerate(names)])
        for n in names:
            await a.attest(n)
        b = Replica(pg_url, tmp_path / "ca", clock)  # sees them attested
        try:
            for n in names[: N // 2]:  # B's view of these goes stale: A renews them
                await a.attest(n)
            issued: dict[str, list[int]] = {n: [] for n in names}
            refused: list[str] = []

            async def renew(n: str) -> None:
                for _ in range(3):
                    try:
                        issued[n].append((await a.attest(n)).serial)
                    except AttestmeshError as exc:
                        refused.append(exc.reason)

            async def quarantine(n: str) -> None:
                assert b.cp.quarantine(n, Trigger.OPERATOR, "race") or True
                await b.cp.flushed()

            await asyncio.wait_for(
                asyncio.gather(*(f(n) for n in names for f in (renew, quarantine))), 60
            )
            await a.cp.flushed()
            # B decided on stale rows for the renewed half: the database refused those first
            assert b.store.stats().conflicts >= N // 2
            assert set(refused) <= {"quarantined", "store_unavailable"}, refused
            # the database has every quarantine, and nothing issued after one
            check = PostgresStore(pg_url)
            try:
                stored = check.load(TRUST_DOMAIN).workloads
                for n in names:
                    assert stored[n].status is Status.QUARANTINED, n
                    assert stored[n].certificates == ()
                    kinds = [e.kind for e in check.events(n, limit=1000)]
                    q = kinds.index(EventKind.QUARANTINED)
                    assert EventKind.ATTESTED not in kinds[q:], (n, kinds)
                    assert kinds.count(EventKind.QUARANTINED) == 1
                    # every certificate A answered with was recorded before the quarantine
                    assert kinds[:q].count(EventKind.ATTESTED) >= len(issued[n]) + 1
            finally:
                check.close()
            # each replica now refuses the workload, the stale one included (its attempt
            # conflicts in the database, it adopts the quarantine and says so)
            for n in names:
                with pytest.raises(AttestmeshError) as no:
                    await a.attest(n)
                assert no.value.reason == "quarantined"
                assert a.cp.status_of(n) is Status.QUARANTINED
                assert b.cp.status_of(n) is Status.QUARANTINED
        finally:
            b.close()
    finally:
        a.close()
