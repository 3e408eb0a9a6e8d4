"""Several control-plane replicas on one PostgreSQL database: the leader and the shared CA.

``PgReplication`` is the control plane's ``Replication``: ``is_leader`` from the session advisory
lock (``xds.store_pg.Leadership``), ``ca_rotated`` stores the leader's rotation in the database
for the others (``publish_ca``), ``load_ca`` reads the CA as stored now into this replica's CA
directory and loads it (a follower, when its change feed says the CA changed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from certs.ca import CertificateAuthority
from xds.store_pg import Leadership, download_ca, publish_ca

__all__ = ["PgReplication"]


class PgReplication:
    def __init__(
        self,
        url: str,
        ca_dir: Path,
        origin: str,
        load: Callable[[], CertificateAuthority],
        *,
        leadership: Leadership | None = None,
    ) -> None:
        """``load``: the CA from ``ca_dir`` (with this replica's key store)."""
        self.url = url
        self.ca_dir = ca_dir
        self.origin = origin
        self._load = load
        self.leadership = leadership or Leadership(url)

    def start(self) -> PgReplication:
        self.leadership.start()
        return self

    def close(self) -> None:
        self.leadership.close()

    def is_leader(self) -> bool:
        return self.leadership.is_leader

    def ca_rotated(self, ca: CertificateAuthority) -> None:
        publish_ca(self.url, self.ca_dir, self.origin)

    def load_ca(self) -> CertificateAuthority:
        download_ca(self.url, self.ca_dir)
        return self._load()
