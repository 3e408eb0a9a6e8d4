"""A workload's standing as issuance sees it, and the refusals that follow from it.

Defined here, below both users: the mesh state (``xds.state`` keeps each workload's ``Status``
and raises these errors; it re-exports them) and the attestation API
(``attestmesh.controlplane.http`` maps them to HTTP answers).
"""

from __future__ import annotations

import enum

from certs.errors import AttestmeshError


class Status(enum.StrEnum):
    PENDING = "pending"  # registered or released; no certificate may be used yet
    ATTESTED = "attested"
    QUARANTINED = "quarantined"


class QuarantinedError(AttestmeshError):
    """The workload is quarantined: no certificate is issued to it."""


class UnknownWorkloadError(AttestmeshError):
    """No registration exists for this workload."""


__all__ = ["QuarantinedError", "Status", "UnknownWorkloadError"]
