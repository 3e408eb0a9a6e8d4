"""Two replicas deciding about one workload on one PostgreSQL database, at the store level: each
decision is taken on the row as that replica last read it and written with ``expect``. Whatever
the interleaving, no certificate is recorded on a quarantined row and the quarantine is never
overwritten."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN
from tests.unit.xds.test_store_batch import wl
from xds.state import (
    Event,
    EventKind,
    IssuedCert,
    QuarantineRecord,
    Status,
    Trigger,
    WorkloadState,
)
from xds.store import Batch, StoreConflict
from xds.store_pg import PostgresStore

pytestmark = pytest.mark.integration

ROUNDS = 40


def issue(w: WorkloadState, serial: int) -> WorkloadState:
    return replace(w, certificates=(*w.certificates, IssuedCert(serial, NOW)))


def quarantined(w: WorkloadState) -> WorkloadState:
    return replace(
        w,
        status=Status.QUARANTINED,
        quarantine=QuarantineRecord(Trigger.OPERATOR, "race", NOW, "operator"),
        certificates=(),
    )


def one_round(setup: PostgresStore, a: PostgresStore, b: PostgresStore, name: str) -> None:
    setup.write(Batch(upserts={name: wl(name, 1)}))
    # both replicas read the same row, then decide at once
    seen_a = a.load(TRUST_DOMAIN).workloads[name]
    seen_b = b.load(TRUST_DOMAIN).workloads[name]
    start = threading.Barrier(2)
    issued: list[int] = []

    def attest(seen: WorkloadState = seen_a) -> None:
        start.wait()
        for k in range(2, 6):  # several renewals back to back
            if seen.status is Status.QUARANTINED:
                return  # the replica's own check refuses
            new = issue(seen, k)
            try:
                a.write(
                    Batch(
                        upserts={name: new},
                        events=(Event(EventKind.ATTESTED, name, NOW, str(k)),),
                        expect={name: seen},
                    )
                )
            except StoreConflict as exc:
                current = exc.current[name]
                assert current is not None
                seen = current  # re-read, decide again
                continue
            issued.append(k)
            seen = new

    def quarantine(seen: WorkloadState = seen_b) -> None:
        start.wait()
        while True:  # a quarantine is retried on the fresh row until it holds
            try:
                b.write(
                    Batch(
                        upserts={name: quarantined(seen)},
                        events=(Event(EventKind.QUARANTINED, name, NOW, "race", Trigger.OPERATOR),),
                        expect={name: seen},
                    )
                )
                return
            except StoreConflict as exc:
                current = exc.current[name]
                assert current is not None
                seen = current

    threads = [threading.Thread(target=attest), threading.Thread(target=quarantine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    final = setup.load(TRUST_DOMAIN).workloads[name]
    assert final.status is Status.QUARANTINED, final  # never lost
    assert final.certificates == ()  # no certificate recorded after it
    kinds = [e.kind for e in setup.events(name, limit=100)]
    assert kinds[-1] is EventKind.QUARANTINED, kinds  # nothing issued after
    assert kinds.count(EventKind.QUARANTINED) == 1
    assert kinds.count(EventKind.ATTESTED) == len(issued)


def test_concurrent_issue_and_quarantine_serialise_in_the_database(pg_url: str) -> None:
    setup = PostgresStore(pg_url)
    a, b = PostgresStore(pg_url), PostgresStore(pg_url)
    try:
        for r in range(ROUNDS):
            one_round(setup, a, b, f"w{r}")
    finally:
        for s in (setup, a, b):
            s.close()
