"""What an admitted attestation hands back: the chain, the trust bundle and the deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from certs.evidence.claims import Claims
from xds.state import WorkloadState


@dataclass(frozen=True, slots=True)
class Issued:
    chain_pem: bytes
    bundle_pem: bytes
    serial: int
    not_after: datetime
    renew_after: datetime
    reattest_by: datetime
    spiffe_id: str
    claims: Claims
    workload: str = ""
    # the workload's record before this issuance (to take it back if the response is lost)
    before: WorkloadState | None = field(default=None, compare=False, repr=False)
    # the nonce offered for this workload's next attestation (saves it a challenge), and its
    # expiry; empty if none was offered
    next_nonce: bytes = field(default=b"", repr=False)
    next_nonce_expires: datetime | None = None
