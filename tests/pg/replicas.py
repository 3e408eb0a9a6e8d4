"""Control planes sharing one PostgreSQL database, in one process (the tests' replicas): each
its own GroupCommitStore(PostgresStore), its own nonce book and publisher; the CA directory is
shared (one trust)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane import AttestationLimiter, ControlPlane
from attestmesh.metrics import Metrics
from attestmesh.replication import PgReplication
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority
from certs.evidence import sim
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier
from certs.issuance import AttestRequest
from certs.policy import parse_policies
from tests.unit.fixtures_core import (
    MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    RecordingPublisher,
    csr_pem,
    new_key,
    policy_doc,
    spki,
)
from xds.state import Registration
from xds.store import GroupCommitStore
from xds.store_pg import Leadership, follow, open_store, share_ca

PLATFORM = ec.generate_private_key(ec.SECP256R1())


class Replica:
    """``follow``: the change feed runs (as ``attestmesh controlplane`` wires it), else the
    replica sees other replicas' changes only when the database refuses its decisions."""

    def __init__(
        self,
        url: str,
        ca_dir: Path,
        clock: Clock,
        *,
        follow_changes: bool = False,
        publisher: RecordingPublisher | None = None,
        replicate: bool = False,
    ) -> None:
        """``replicate``: the CA is shared through the database and a leader is elected, as
        ``attestmesh controlplane`` does (``follow_changes`` too)."""
        self.store: GroupCommitStore = open_store(url)
        self.publisher = publisher or RecordingPublisher()
        self.metrics = Metrics()
        loop = asyncio.get_running_loop()
        state, feed = follow(
            self.store,
            TRUST_DOMAIN,
            lambda ch: loop.call_soon_threadsafe(self.cp.adopt_changes, ch),
        )
        self.feed = feed if follow_changes or replicate else None

        def load() -> CertificateAuthority:
            return CertificateAuthority.load_or_create(ca_dir, TRUST_DOMAIN, clock())

        self.replication: PgReplication | None = None
        if replicate:
            assert feed is not None
            share_ca(url, ca_dir, load)
            self.replication = PgReplication(
                url, ca_dir, feed, load, leadership=Leadership(url, interval_seconds=0.2)
            )
        self.cp = ControlPlane(
            state=state,
            store=self.store,
            ca=load(),
            verifiers={Tee.SIM: SimVerifier([PLATFORM.public_key()])},
            policies=parse_policies([policy_doc()]),
            mesh_policies=(),
            metrics=self.metrics,
            publisher=self.publisher,
            clock=clock,
            serials=x509.random_serial_number,
            random_bytes=secrets.token_bytes,
            limiter=AttestationLimiter(burst=1000),
            replication=self.replication,
        )
        if self.feed is not None:
            self.store.attach(self.feed)
            self.feed.start()
        if self.replication is not None:
            self.store.attach(self.replication)
            self.replication.start()

    async def register(self, regs: Sequence[Registration]) -> None:
        self.cp.register(regs)
        await self.cp.flushed()

    def request(self, name: str) -> AttestRequest:
        key = new_key()
        nonce, _ = self.cp.challenge()
        evidence = sim.build_report(
            PLATFORM, report_data=expected_report_data(nonce, spki(key)), measurement=MEASUREMENT
        )
        return AttestRequest(name, "sim", evidence, csr_pem(key), nonce)

    async def attest(self, name: str) -> Any:
        return await self.cp.attest(self.request(name), None)

    def close(self) -> None:
        self.store.close()
