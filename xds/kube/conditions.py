"""Status conditions and the API server's time formats. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from xds.state import Trigger


def micro_time(now: datetime) -> str:
    """MicroTime (Lease acquire and renew times)."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def seconds_time(now: datetime) -> str:
    """Time (conditions, Events)."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def build_condition(
    ctype: str, status: bool, reason: str, message: str, now: datetime, generation: int | None
) -> dict[str, Any]:
    cond: dict[str, Any] = {
        "type": ctype,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": seconds_time(now),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def same_condition(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> bool:
    """``current`` already says what ``wanted`` says (its transition time aside)."""
    if current is None:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    return all(current.get(k) == wanted.get(k) for k in keys)


def find_condition(obj: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == ctype:
            return c
    return None


def condition_reason(trigger: Trigger) -> str:
    """A quarantine trigger as a condition reason (``appraisal_failed`` -> ``AppraisalFailed``)."""
    return "".join(part.capitalize() for part in trigger.value.split("_"))


__all__ = [
    "build_condition",
    "condition_reason",
    "find_condition",
    "micro_time",
    "parse_time",
    "same_condition",
    "seconds_time",
]
