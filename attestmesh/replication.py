"""Several control-plane replicas on one PostgreSQL database: the leader, the shared CA and
the one CRL set.

``PgReplication`` is the control plane's ``Replication``: ``is_leader`` from the session advisory
lock (``xds.store_pg.Leadership``), ``ca_rotated`` stores the leader's rotation in the database
for the others (``publish_ca``), ``load_ca`` reads the CA as stored now into this replica's CA
directory and loads it (a follower, when its change feed says the CA changed).

``CrlSigner`` is a ``CrlSource``: on the leader it signs the CRL set from the revocations as
stored (those of every replica), at most once per ``settle_seconds`` however many revocations
arrive, and stores it; on every other replica it only follows the stored one. Either way
``deliver`` gets the CRL set to serve, and ``current()`` is the latest.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import psycopg

from certs.ca import CertificateAuthority
from xds.state import MeshState, WorkloadState
from xds.store_pg import (
    ChangeFeed,
    Leadership,
    PostgresStore,
    StoredCrl,
    download_ca,
    follow_notifications,
    publish_ca,
    read_crl,
    read_rows,
    redact_url,
    revocations_at,
    revoked_since,
    store_crl,
)

log = logging.getLogger(__name__)

# a replica whose database has not answered for this long issues nothing and is not ready
# (the change feed reads every 0.5 s while connected; the budget to stop issuing is 5 s)
CONTACT_SECONDS = 3.0

__all__ = ["CrlSigner", "CrlSource", "PgReplication"]


class PgReplication:
    def __init__(
        self,
        url: str,
        ca_dir: Path,
        feed: ChangeFeed,
        load: Callable[[], CertificateAuthority],
        *,
        leadership: Leadership | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """``feed``: this replica's change feed (its reads say the database is reachable);
        ``load``: the CA from ``ca_dir`` (with this replica's key store)."""
        self.url = url
        self.ca_dir = ca_dir
        self.feed = feed
        self.origin = feed.origin
        self._load = load
        self._monotonic = monotonic
        self.leadership = leadership or Leadership(url)
        # the next read of the feed that requests may wait for, and how many reads had begun
        # when it was asked for (a read begun since cannot serve a request made after it)
        self._barrier: asyncio.Future[None] | None = None
        self._barrier_reads = -1

    def start(self) -> PgReplication:
        self.leadership.start()
        return self

    def close(self) -> None:
        self.leadership.close()

    def is_leader(self) -> bool:
        return self.leadership.leading

    def in_contact(self) -> bool:
        return self.feed.connected and (
            self._monotonic() - self.feed.last_contact <= CONTACT_SECONDS
        )

    def load_rows(self, names: Collection[str]) -> dict[str, WorkloadState | None]:
        return read_rows(self.url, sorted(names))

    async def caught_up(self) -> None:
        """See ``attestmesh.controlplane.ports.Replication``. Requests that wait at the same
        time share one read (they cost the database nothing more: the feed's next read is
        the one it makes anyway, at the latest after its poll interval)."""
        feed = self.feed
        loop = asyncio.get_running_loop()
        barrier = self._barrier
        if barrier is None or barrier.done() or feed.reads_begun != self._barrier_reads:
            barrier = self._barrier = loop.create_future()
            self._barrier_reads = feed.reads_begun

            def read(done: asyncio.Future[None] = barrier) -> None:  # on the feed's thread,
                # after its deliveries: the loop adopts them before it resolves this
                loop.call_soon_threadsafe(_resolve, done)

            feed.after_next_read(read)
        await asyncio.shield(barrier)  # (a waiter given up leaves the read to the others)

    def load_state(self) -> MeshState:
        store = PostgresStore(self.url)
        try:
            return store.load(self.feed.trust_domain)
        finally:
            store.close()

    def ca_rotated(self, ca: CertificateAuthority) -> None:
        publish_ca(self.url, self.ca_dir, self.origin)

    def load_ca(self) -> CertificateAuthority:
        download_ca(self.url, self.ca_dir)
        return self._load()


def _resolve(barrier: asyncio.Future[None]) -> None:
    if not barrier.done():
        barrier.set_result(None)


class CrlSource(Protocol):
    """Where a replica's CRL set comes from when several replicas share a database: one
    leader signs it (covering revocations made on any replica) and every replica serves the
    stored one. The control plane serves ``current()`` instead of signing its own (it signs
    only while this is None: a database no leader has stored a CRL in yet) and republishes
    what the source delivers."""

    def current(self) -> bytes | None:
        """The CRL set to serve now (PEM; None: none stored yet)."""
        ...


class CrlSigner:
    """A thread per replica that keeps the one CRL set (see the module docstring).

    It LISTENs on the change channel (every commit of every replica notifies it) and, after
    each wake-up, waits ``settle_seconds`` so a burst of commits costs one step; the leader
    signs at most once per ``min_interval_seconds`` (a CRL lists every revoked serial: under
    sustained load each signature costs the whole list). A step on the
    leader (``leadership.leading``) signs a new CRL set with ``ca()`` when a transaction from
    the stored one's ``covers`` on committed a revocation, when the CA changed (rotation),
    when the stored one is older than ``refresh`` (default: half of ``validity``) or when none
    is stored, and stores it (``store_crl``: refused, and counted, unless the leader's election
    connection holds the lock when it commits); a step on any other replica reads the stored
    one if its number grew. Followers never sign. ``deliver(pem)`` is called on this thread
    with every CRL set this replica should serve from now on."""

    def __init__(
        self,
        url: str,
        *,
        origin: str,
        leadership: Leadership,
        ca: Callable[[], CertificateAuthority],
        deliver: Callable[[bytes], object],
        clock: Callable[[], datetime],
        validity: timedelta,
        refresh: timedelta | None = None,
        settle_seconds: float = 0.05,
        min_interval_seconds: float = 0.25,
        poll_seconds: float = 0.5,
        retry_seconds: float = 0.5,
    ) -> None:
        self.url = url
        self.origin = origin
        self._leadership = leadership
        self._ca = ca
        self._deliver = deliver
        self._clock = clock
        self.validity = validity
        self.refresh = validity / 2 if refresh is None else refresh
        self._settle = settle_seconds
        self._min_interval = min_interval_seconds
        self._signed_at = -float("inf")  # monotonic
        # a step that was due but came within min_interval of the last signature: when to take
        # the next one (monotonic; inf: nothing owed), so it waits the rest of the interval,
        # not a whole poll
        self._wake_at = float("inf")
        self._poll = poll_seconds
        self._retry = retry_seconds
        self._closed = threading.Event()
        self._first = threading.Event()
        self._signed_with: CertificateAuthority | None = None
        self.stored: StoredCrl | None = None  # the latest this replica serves
        self.signed = 0  # CRL sets this replica signed (and stored)
        self.refused = 0  # signed, but the database refused them (no longer the leader)
        self.followed = 0  # CRL sets stored by another replica, read and delivered
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="attestmesh-crl", daemon=True)

    def start(self) -> CrlSigner:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._thread.join(10)

    def current(self) -> bytes | None:
        stored = self.stored
        return None if stored is None else stored.pem

    def wait_first(self, timeout: float) -> bool:
        """Wait until this replica has a CRL set to serve (stored by a leader, maybe itself)."""
        return self._first.wait(timeout)

    def _run(self) -> None:
        follow_notifications(
            self.url,
            name="attestmesh-crl",
            closed=self._closed,
            step=self._step,
            lost=self._lost,
            settle_seconds=self._settle,
            retry_seconds=self._retry,
        )

    def _step(self, conn: psycopg.Connection[Any]) -> float:
        self.step(conn)
        return min(self._poll, max(0.0, self._wake_at - time.monotonic()))

    def _lost(self, exc: psycopg.Error) -> None:
        log.warning("CRL signer: %s: %s", redact_url(self.url), exc)

    def step(self, conn: psycopg.Connection[Any]) -> None:
        """Sign (the leader) or follow (everyone else), as the class docstring says."""
        self.steps += 1
        self._wake_at = float("inf")  # set again by a step that owes one
        if self._leadership.leading:
            self._lead(conn)
        else:
            self._follow(conn)

    def _follow(self, conn: psycopg.Connection[Any]) -> None:
        head = read_crl(conn, with_pem=False)
        if head is None or (self.stored is not None and head.number <= self.stored.number):
            return
        got = read_crl(conn)
        if got is not None:
            self.followed += 1
            self._serve(got)

    def _lead(self, conn: psycopg.Connection[Any]) -> None:
        stored = read_crl(conn, with_pem=False)
        ca = self._ca()
        now = self._clock()
        due = (
            stored is None
            or ca is not self._signed_with
            or now - stored.signed_at >= self.refresh
            or revoked_since(conn, stored.covers)
        )
        if due and time.monotonic() - self._signed_at < self._min_interval:
            self._wake_at = self._signed_at + self._min_interval
            return  # signed a moment ago: the next step (at _wake_at, or a commit) signs
        if not due:
            if self.stored is None or (stored is not None and stored.number > self.stored.number):
                self._follow(conn)
            return
        revoked, seq = revocations_at(conn)
        pem = ca.crl_pem(revoked, now, self.validity)
        got = store_crl(
            conn,
            pem,
            signed_at=now,
            covers=seq,
            revoked=len(revoked),
            origin=self.origin,
            leader_pid=self._leadership.backend_pid,
        )
        if got is None:
            self.refused += 1
            log.warning("CRL set not stored: this replica no longer holds the leader lock")
            return
        self.signed += 1
        self._signed_at = time.monotonic()
        self._signed_with = ca
        self._serve(got)

    def _serve(self, crl: StoredCrl) -> None:
        self.stored = crl
        self._first.set()
        self._deliver(crl.pem)
