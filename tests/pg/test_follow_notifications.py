"""``follow_notifications``, the LISTEN loop the change feed and the CRL signer share, against a
real PostgreSQL server: a step at once and after every notification (a burst: one step), the
step's own timeout as a backstop, and after a lost connection or a failed step a new connection
that LISTENs again and steps at once (the catch-up)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from attestmesh.demo import free_port
from xds.store_pg import CHANNEL, follow_notifications

pytestmark = pytest.mark.integration

NAME = "attestmesh-test-follow"
FOREVER = 60.0  # a step's wait no test reaches: only notifications wake the loop


class Follower:
    """Records the steps (the backend pid of each) and the errors of one loop."""

    def __init__(self, wait: float, fail_step: int | None = None) -> None:
        self.wait = wait
        self.fail_step = fail_step  # the step (1-based) that raises a psycopg.Error
        self.pids: list[int] = []
        self.errors: list[psycopg.Error] = []
        self.closed = threading.Event()
        self.changed = threading.Condition()

    def step(self, conn: psycopg.Connection[Any]) -> float:
        with self.changed:
            self.pids.append(conn.info.backend_pid)
            self.changed.notify_all()
        if len(self.pids) == self.fail_step:
            raise psycopg.OperationalError("step failed")
        return self.wait

    def lost(self, exc: psycopg.Error) -> None:
        with self.changed:
            self.errors.append(exc)
            self.changed.notify_all()

    def until(self, check: Callable[[], bool], timeout: float = 20) -> None:
        with self.changed:
            assert self.changed.wait_for(check, timeout), (self.pids, self.errors)


@contextmanager
def following(
    url: str, follower: Follower, settle: float = 0.0, *, reachable: bool = True
) -> Iterator[None]:
    thread = threading.Thread(
        target=follow_notifications,
        args=(url,),
        kwargs={
            "name": NAME,
            "closed": follower.closed,
            "step": follower.step,
            "lost": follower.lost,
            "settle_seconds": settle,
            "retry_seconds": 0.01,
        },
        daemon=True,
    )
    thread.start()
    try:
        yield
    finally:
        follower.closed.set()
        if reachable:
            notify_all(url)  # wakes a loop waiting FOREVER
        thread.join(10)
    assert not thread.is_alive()


def notify_all(url: str, count: int = 1) -> None:
    """``count`` notifications on the channel, each its own commit."""
    with psycopg.connect(url, autocommit=True) as conn:
        for i in range(count):
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(i)))


def listening(url: str) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND query LIKE 'LISTEN%%'",
            (NAME,),
        ).fetchone()
    return row is not None and row[0] == 1


def test_it_steps_at_once_and_once_per_burst_of_notifications(pg_url: str) -> None:
    follower = Follower(FOREVER)
    with following(pg_url, follower, settle=1.0):
        follower.until(lambda: len(follower.pids) == 1)
        # the LISTEN was the last statement before the wait (the step ran none)
        assert listening(pg_url)
        notify_all(pg_url, count=20)
        follower.until(lambda: len(follower.pids) == 2)
        time.sleep(1.5)  # the burst's other 19 were dropped, not stepped on
        assert len(follower.pids) == 2
        notify_all(pg_url)
        follower.until(lambda: len(follower.pids) == 3)
        assert len(set(follower.pids)) == 1 and follower.errors == []


def test_without_notifications_it_steps_after_the_steps_own_wait(pg_url: str) -> None:
    follower = Follower(0.01)
    with following(pg_url, follower):
        follower.until(lambda: len(follower.pids) >= 5)
    assert follower.errors == []


def test_after_a_lost_connection_it_listens_again_and_catches_up_at_once(pg_url: str) -> None:
    follower = Follower(FOREVER)
    with following(pg_url, follower):
        follower.until(lambda: len(follower.pids) == 1)
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s",
                (NAME,),
            )
        # no notification and no timeout: the step on the new connection is the catch-up
        follower.until(lambda: len(follower.pids) == 2)
        assert follower.pids[1] != follower.pids[0]
        assert len(follower.errors) == 1
        assert isinstance(follower.errors[0], psycopg.OperationalError)
        notify_all(pg_url)  # the new connection LISTENs
        follower.until(lambda: len(follower.pids) == 3)
        assert follower.pids[2] == follower.pids[1]


def test_a_failing_step_costs_its_connection_and_is_retried_on_a_new_one(pg_url: str) -> None:
    follower = Follower(FOREVER, fail_step=1)
    with following(pg_url, follower):
        follower.until(lambda: len(follower.pids) == 2)
        assert [str(e) for e in follower.errors] == ["step failed"]
        assert follower.pids[1] != follower.pids[0]


def test_an_unreachable_server_is_retried_until_closed() -> None:
    follower = Follower(FOREVER)
    url = f"postgresql://nobody@127.0.0.1:{free_port()}/none"
    with following(url, follower, reachable=False):
        follower.until(lambda: len(follower.errors) >= 3)
    assert follower.pids == []
