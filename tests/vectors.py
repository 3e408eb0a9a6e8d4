"""Shared test helpers: where the real-hardware vectors live and how to pin times."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO.parent / "shared" / "vectors"


def pin(iso: str) -> datetime:
    """Parse an ISO-8601 time (``Z`` allowed) into an aware UTC datetime."""
    parsed = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)
