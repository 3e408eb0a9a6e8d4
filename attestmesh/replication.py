"""Several control-plane replicas on one PostgreSQL database: the leader and the shared CA.

``PgReplication`` is the control plane's ``Replication``: ``is_leader`` from the session advisory
lock (``xds.store_pg.Leadership``), ``ca_rotated`` stores the leader's rotation in the database
for the others (``publish_ca``), ``load_ca`` reads the CA as stored now into this replica's CA
directory and loads it (a follower, when its change feed says the CA changed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

from certs.ca import CertificateAuthority
from xds.state import MeshState, WorkloadState
from xds.store_pg import (
    ChangeFeed,
    Leadership,
    PostgresStore,
    download_ca,
    publish_ca,
    read_rows,
)

# a replica whose database has not answered for this long issues nothing and is not ready
# (the change feed reads every 0.5 s while connected; the budget to stop issuing is 5 s)
CONTACT_SECONDS = 3.0

__all__ = ["PgReplication"]


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
