"""The database's leader lock gated by another election (Kubernetes mode: the Lease): a replica
takes the lock only while it is eligible and gives it up within an interval once it is not, so
one replica does all the leader's work (Kubernetes actions, CA rotation, the CRL)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.polling import until_blocking as until
from xds.store_pg import Leadership

pytestmark = pytest.mark.integration


def test_the_lock_follows_eligibility(pg_url: str) -> None:
    lease = {"holder": "b"}  # who holds the (other) election
    a = Leadership(pg_url, interval_seconds=0.2, eligible=lambda: lease["holder"] == "a").start()
    b = Leadership(pg_url, interval_seconds=0.2, eligible=lambda: lease["holder"] == "b").start()
    try:
        until(lambda: b.leading)
        time.sleep(0.6)  # three of A's tries: it never takes the lock it is not eligible for
        assert not a.is_leader and b.leading
        lease["holder"] = "a"  # the Lease moves: B lets go, A takes the lock
        moved = until(lambda: a.leading and not b.is_leader)
        assert moved < 2.0, moved
        assert b.backend_pid == 0 and a.backend_pid != 0
        lease["holder"] = "nobody"  # no Lease holder: no database leader either
        until(lambda: not a.is_leader and not b.is_leader)
    finally:
        a.close()
        b.close()


def test_without_a_gate_the_first_to_try_leads(pg_url: str) -> None:
    a = Leadership(pg_url, interval_seconds=0.2).start()
    try:
        until(lambda: a.leading)
    finally:
        a.close()


def test_a_frozen_leader_loses_the_lock_and_stops_acting_first(pg_url: str) -> None:
    """A leader whose process stops (SIGSTOP, a paused VM) keeps its TCP connection alive (its
    kernel answers keepalives); its election thread blocked between two checks is the same to
    the server: a session that sends nothing. The server ends it (idle_session_timeout), the
    other replica takes the lock, and the frozen one had stopped acting before."""
    frozen, thaw = threading.Event(), threading.Event()

    def a_eligible() -> bool:
        if frozen.is_set():
            thaw.wait(60)
        return True

    a = Leadership(pg_url, interval_seconds=0.2, eligible=a_eligible).start()
    b = Leadership(pg_url, interval_seconds=0.2)
    try:
        until(lambda: a.leading)
        b.start()
        time.sleep(0.6)
        assert a.leading and not b.is_leader
        frozen.set()
        until(lambda: not a.leading, within=2.0)  # stops acting within two intervals
        assert not b.is_leader
        until(lambda: b.leading, within=15.0)  # the server ended A's session (5 s)
        assert not a.leading  # never two acting at once
        thaw.set()  # A wakes up: its session is gone, it finds B leading and follows
        until(lambda: not a.is_leader)
        time.sleep(0.6)
        assert b.leading and not a.is_leader
    finally:
        thaw.set()
        a.close()
        b.close()
