"""What the control-plane service needs from its surroundings, as protocols the wiring fills:
the announcer (xDS snapshots, Kubernetes actions), the identity check, vendor collateral, the
replicas' shared database, the clock."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime
from typing import Protocol

from certs.ca import CertificateAuthority
from certs.collateral.source import CollateralSource as CollateralSource  # beside the fetchers
from xds.build import TrustMaterial
from xds.meshpolicy import MeshPolicy
from xds.state import (
    Event,
    MeshState,
    Registration,
    WorkloadState,
)


class Publisher(Protocol):
    """Announces a persisted state: xDS snapshots, Kubernetes actions."""

    def publish(
        self,
        state: MeshState,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None:
        """``changed``: the workloads that differ from the state last published (None:
        unknown, compare)."""
        ...

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None: ...


class IdentityCheck(Protocol):
    async def check(self, reg: Registration, token: str | None) -> None: ...


class Replication(Protocol):
    """Several replicas on one database (attestmesh.replication): which one leads (CA
    rotation and revocation pruning are done once, by the leader), and the CA they share."""

    def is_leader(self) -> bool: ...

    def in_contact(self) -> bool:
        """The database answered within the last few seconds (else: issue nothing)."""
        ...

    def load_state(self) -> MeshState:
        """Everything durable now (blocking; after a failed write, to recover)."""
        ...

    def load_rows(self, names: Collection[str]) -> dict[str, WorkloadState | None]:
        """These workloads' rows as stored now (None: no row). Blocking."""
        ...

    async def caught_up(self) -> None:
        """Once the change feed has read once more, a read begun after this call: what the
        other replicas had committed by then is this replica's view (adopted on the loop).
        A feed that is reconnecting reads at its next connection; one that is cut off never
        does (the caller bounds the wait)."""
        ...

    def ca_rotated(self, ca: CertificateAuthority) -> None:
        """The leader persisted a rotation step: store it for the other replicas."""
        ...

    def load_ca(self) -> CertificateAuthority:
        """The leader rotated the shared CA: the CA as stored now."""
        ...


Clock = Callable[[], datetime]
