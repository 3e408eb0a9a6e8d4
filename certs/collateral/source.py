"""The seam between the control plane and the collateral fetchers: what a fetcher of vendor
collateral offers (``PcsCollateralSource`` and ``KdsCollateralSource`` implement it)."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from certs.evidence.claims import Collateral


class CollateralSource(Protocol):
    async def collateral_for(
        self, evidence: bytes, supplied: Collateral, now: datetime
    ) -> dict[str, bytes]:
        """``supplied`` merged with what this source fetched (or had cached) for ``evidence``:
        names the agent supplied win."""
        ...
