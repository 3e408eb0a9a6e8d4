"""One CRL set for every replica on one PostgreSQL database: the leader signs it from the
revocations as stored (made on any replica), coalescing bursts, and stores it; the other
replicas serve the stored one and never sign; a write of a replica that no longer holds the
leader lock is refused; when the leader dies the next one signs."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from cryptography import x509

from attestmesh.replication import CrlSigner
from certs.ca import CertificateAuthority
from tests.polling import until_blocking as until
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN
from tests.unit.xds.test_store_batch import rev
from xds.store import Batch
from xds.store_pg import Leadership, PostgresStore, read_crl, store_crl

pytestmark = pytest.mark.integration

VALIDITY = timedelta(hours=24)


def listed(pem: bytes | None) -> set[int] | None:
    """``serials``, or None while no CRL set has arrived (for ``until``: not there yet)."""
    return None if pem is None else serials(pem)


def serials(pem: bytes | None) -> set[int]:
    """The serials the first CRL of a CRL set lists (each lists every revoked serial)."""
    assert pem is not None
    first = pem.split(b"-----END X509 CRL-----")[0] + b"-----END X509 CRL-----\n"
    return {r.serial_number for r in x509.load_pem_x509_crl(first)}


class Node:
    """One replica's election and CRL signer (the control plane around them is not needed:
    revocations are written through a store of this replica's own origin)."""

    def __init__(self, url: str, ca: CertificateAuthority, **signer: float) -> None:
        self.leadership = Leadership(url, interval_seconds=0.2).start()
        self.store = PostgresStore(url)
        self.delivered: list[bytes] = []
        self.signer = CrlSigner(
            url,
            origin=self.store.origin,
            leadership=self.leadership,
            ca=lambda: ca,
            deliver=self.delivered.append,
            clock=lambda: NOW,
            validity=VALIDITY,
            **signer,
        ).start()

    def close(self) -> None:
        self.signer.close()
        self.leadership.close()
        self.store.close()


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, NOW)


def leader_and_follower(nodes: list[Node]) -> tuple[Node, Node]:
    until(lambda: sum(n.leadership.leading for n in nodes) == 1)
    leader = next(n for n in nodes if n.leadership.leading)
    return leader, next(n for n in nodes if n is not leader)


def test_the_leader_signs_once_what_any_replica_revoked_and_followers_serve_it(
    pg_url: str, ca: CertificateAuthority
) -> None:
    nodes = [Node(pg_url, ca), Node(pg_url, ca)]
    try:
        leader, follower = leader_and_follower(nodes)
        until(lambda: follower.signer.current() is not None)  # the first one, on leading
        assert serials(follower.signer.current()) == set()
        follower.store.write(Batch(revoked=(rev(101, "on-follower"),)))
        leader.store.write(Batch(revoked=(rev(202, "on-leader"),)))
        for n in nodes:
            until(lambda n=n: listed(n.signer.current()) == {101, 202})
        # byte for byte the CRL set the leader signed and stored: signed once, served twice
        with psycopg.connect(pg_url) as conn:
            stored = read_crl(conn)
        assert stored is not None and stored.origin == leader.store.origin
        assert follower.signer.current() == leader.signer.current() == stored.pem
        assert follower.signer.signed == 0 and follower.signer.refused == 0
        assert follower.signer.followed >= 2 and leader.signer.signed >= 2
        crl = x509.load_pem_x509_crl(
            stored.pem.split(b"-----END X509 CRL-----")[0] + b"-----END X509 CRL-----\n"
        )
        assert crl.is_signature_valid(ca.intermediate.cert.public_key())  # type: ignore[arg-type]
        assert stored.revoked == 2
    finally:
        for n in nodes:
            n.close()


def test_a_burst_of_revocations_is_signed_a_few_times_not_once_each(
    pg_url: str, ca: CertificateAuthority
) -> None:
    nodes = [Node(pg_url, ca), Node(pg_url, ca)]
    try:
        leader, follower = leader_and_follower(nodes)
        until(lambda: leader.signer.signed == 1)
        burst = [rev(1000 + i, f"w{i}") for i in range(60)]
        for r in burst:  # 60 commits, 60 notifications
            follower.store.write(Batch(revoked=(r,)))
        until(lambda: listed(follower.signer.current()) == {r.serial for r in burst})
        signed = leader.signer.signed - 1
        assert 1 <= signed < 20, signed  # coalesced (settle 50 ms), not one CRL per revocation
        assert follower.signer.signed == 0
    finally:
        for n in nodes:
            n.close()


def test_a_crl_from_a_replica_without_the_leader_lock_or_older_than_stored_is_refused(
    pg_url: str, ca: CertificateAuthority
) -> None:
    node = Node(pg_url, ca)
    try:
        until(lambda: node.signer.signed == 1)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            before = read_crl(conn)
            assert before is not None
            kwargs = {"signed_at": NOW, "revoked": 0, "origin": "intruder"}
            # this connection is no leader: its own pid holds no leader lock
            assert (
                store_crl(conn, b"forged", covers=10**9, leader_pid=conn.info.backend_pid, **kwargs)  # type: ignore[arg-type]
                is None
            )
            # the leader's pid, but covering less than the stored one (a deposed leader's late write)
            assert (
                store_crl(
                    conn,
                    b"late",
                    covers=before.covers - 1,
                    leader_pid=node.leadership.backend_pid,
                    **kwargs,
                )  # type: ignore[arg-type]
                is None
            )
            assert read_crl(conn) == before
            (n,) = conn.execute("SELECT count(*) FROM changes WHERE kind = 'l'").fetchone()  # type: ignore[misc]
        assert n == 1
    finally:
        node.close()


def test_when_the_leader_dies_the_next_one_signs_and_the_old_one_stops(
    pg_url: str, ca: CertificateAuthority
) -> None:
    nodes = [Node(pg_url, ca), Node(pg_url, ca)]
    try:
        leader, follower = leader_and_follower(nodes)
        until(lambda: follower.signer.current() is not None)
        leader.leadership.close()  # its election connection closes: the lock is free
        until(lambda: follower.leadership.leading)
        follower.store.write(Batch(revoked=(rev(303, "after"),)))
        until(lambda: listed(follower.signer.current()) == {303})
        assert follower.signer.signed >= 1
        signed = leader.signer.signed
        until(lambda: listed(leader.signer.current()) == {303})  # it follows now
        assert leader.signer.signed == signed
        with psycopg.connect(pg_url) as conn:
            stored = read_crl(conn)
        assert stored is not None and stored.origin == follower.store.origin
    finally:
        for n in nodes:
            n.close()


def test_a_revocation_right_after_a_signature_waits_out_the_interval_not_a_poll(
    pg_url: str, ca: CertificateAuthority
) -> None:
    # the leader signs at most once per min_interval; a revocation inside that interval is
    # signed when it ends, not at the next poll (5 s here) or the next commit (none comes)
    timing = {"poll_seconds": 5.0, "min_interval_seconds": 1.0}
    nodes = [Node(pg_url, ca, **timing), Node(pg_url, ca, **timing)]
    try:
        leader, follower = leader_and_follower(nodes)
        until(lambda: leader.signer.signed == 1)  # the first set, on leading: just signed
        until(lambda: follower.signer.current() is not None)
        start = time.monotonic()
        follower.store.write(Batch(revoked=(rev(303, "soon-after"),)))
        # (the database may hold the other tests' revocations too)
        until(lambda: 303 in (listed(follower.signer.current()) or ()), within=10)
        took = time.monotonic() - start
        assert took < 3.0, took  # <= the rest of the 1 s interval + settle + the follower's read
        assert leader.signer.signed == 2 and follower.signer.signed == 0
    finally:
        for n in nodes:
            n.close()
