"""The control-plane service (the relying party) and its HTTP adapter, one room:

- ``service``: ``ControlPlane`` holds the mesh state and applies transitions (attest, renew,
  quarantine, register, release, TCB re-appraisal, CA rotation); every transition is persisted
  before it is announced;
- ``http``: the attestation API over HTTPS (aiohttp: challenge, attest, renew, trust), typed
  against the service (``Issuing``);
- ``ports``: the protocols the wiring fills (``Publisher``, ``IdentityCheck``,
  ``CollateralSource``, ``Replication``, ``Clock``); ``identity`` (join tokens), ``limiter``
  (attestations per workload), ``issued`` (what an attestation hands back);
- ``workers``: threads and worker processes for verification and signing (``certs.offload``);
- ``secrets`` and ``kbs``: secret release to attested workloads (mutual-TLS API, KBS protocol).

A layer of its own between the adapters below (certs, xds) and the wiring above (serve,
kube_mode, cli, demo): it imports none of the wiring (the ``service`` contract in
pyproject.toml). What others may import: the names below, and ``http.build_app``.
"""

from attestmesh.controlplane.identity import RegistrationTokenCheck
from attestmesh.controlplane.issued import Issued
from attestmesh.controlplane.limiter import AttestationLimiter
from attestmesh.controlplane.ports import (
    Clock,
    CollateralSource,
    IdentityCheck,
    Publisher,
    Replication,
)
from attestmesh.controlplane.service import ControlPlane, StoreUnavailableError
from attestmesh.controlplane.workers import WorkerProcesses

__all__ = [
    "AttestationLimiter",
    "Clock",
    "CollateralSource",
    "ControlPlane",
    "IdentityCheck",
    "Issued",
    "Publisher",
    "RegistrationTokenCheck",
    "Replication",
    "StoreUnavailableError",
    "WorkerProcesses",
]
