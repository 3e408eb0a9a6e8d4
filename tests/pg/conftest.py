"""A throwaway PostgreSQL cluster shared by this package's tests (one per session; each test
gets its own database). PostgreSQL missing is a failure, not a skip."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tests.pg_harness import PgCluster, pg_cluster

_names = itertools.count()


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    with pg_cluster() as cluster:
        yield cluster


@pytest.fixture
def pg_url(pg: PgCluster) -> str:
    """A fresh empty database on the shared cluster."""
    if pg.process is None or pg.process.poll() is not None:  # a test stopped it
        pg.start()
    return pg.create_database(f"t{next(_names)}")
