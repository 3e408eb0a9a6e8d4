"""Real ``attestmesh controlplane`` replicas on one PostgreSQL database: one CA (the second
replica takes the first one's root and intermediate from the database), exactly one leader, and
leadership moves within 15 s when the leader is killed with SIGKILL."""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import NAMES, free_port, join_token, write_config
from tests.pg.test_controlplane_pg import start

pytestmark = pytest.mark.integration

LEADERSHIP_MOVES_WITHIN_S = 15.0


def leaders(url: str) -> list[int]:
    """The process ids whose leader-election connection holds an advisory lock."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted "
            "AND a.application_name LIKE 'attestmesh-leader %'"
        ).fetchall()
    return [int(name.split()[1]) for (name,) in rows]


def wait_for_leader(url: str, timeout: float) -> tuple[list[int], float]:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        got = leaders(url)
        if got:
            return got, time.monotonic() - started
        time.sleep(0.05)
    return [], time.monotonic() - started


def test_one_ca_one_leader_and_leadership_moves_when_the_leader_dies(
    tmp_path: Path, pg_url: str
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    s1 = write_config(tmp_path, ports, pub, {n: join_token(n) for n in NAMES})
    s2 = dataclasses.replace(
        s1,
        state_dir=tmp_path / "state-2",
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
    )
    first = start(s1, tmp_path / "cp1.log", pg_url)
    second = None
    try:
        got, _ = wait_for_leader(pg_url, 10)
        assert got == [first.pid]
        second = start(s2, tmp_path / "cp2.log", pg_url)
        # one trust: the second replica signs with the first one's CA, taken from the database
        for name in ("root.pem", "intermediate.pem"):
            assert (s2.state_dir / "ca" / name).read_bytes() == (
                s1.state_dir / "ca" / name
            ).read_bytes()
        time.sleep(2.5)  # the second replica tries for the lock meanwhile, and fails
        assert leaders(pg_url) == [first.pid]
        first.kill()  # SIGKILL: no goodbye to the database
        first.wait(10)
        got, took = wait_for_leader(pg_url, LEADERSHIP_MOVES_WITHIN_S + 5)
        assert got == [second.pid], (got, took)
        assert took <= LEADERSHIP_MOVES_WITHIN_S, took
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


async def test_the_leader_alone_rotates_the_shared_ca_and_the_others_follow(
    tmp_path: Path, pg_url: str
) -> None:
    import asyncio

    from certs.ca import preparation_time
    from tests.pg.replicas import Replica
    from tests.unit.fixtures_core import NOW, Clock

    clock = Clock(NOW)
    a = Replica(pg_url, tmp_path / "ca-a", clock, replicate=True)
    try:
        async with asyncio.timeout(10):
            while a.replication is None or not a.replication.is_leader():
                await asyncio.sleep(0.05)
        b = Replica(pg_url, tmp_path / "ca-b", clock, replicate=True)
        try:
            assert b.cp.ca.root == a.cp.ca.root  # one trust, taken from the database
            assert b.cp.ca.intermediate.cert == a.cp.ca.intermediate.cert
            assert b.replication is not None and not b.replication.is_leader()
            clock.now = preparation_time(a.cp.ca.intermediate.cert) + timedelta(minutes=1)
            b.cp.check_deadlines()  # due, but B does not lead: nothing
            assert b.cp.ca.prepared is None
            a.cp.check_deadlines()  # the leader prepares the next intermediate
            prepared = a.cp.ca.prepared
            assert prepared is not None
            async with asyncio.timeout(10):  # B loads it from the database
                while b.cp.ca.prepared is None:
                    await asyncio.sleep(0.02)
            assert b.cp.ca.prepared.cert == prepared.cert
            # both publish a CRL for each live intermediate: B's covers the prepared one
            crls = b.publisher.last_trust.crl_pem.count(b"BEGIN X509 CRL")
            assert crls == 2
            b.cp.check_deadlines()  # still nothing of its own
            assert b.cp.ca.prepared.cert == prepared.cert
        finally:
            b.close()
    finally:
        a.close()
