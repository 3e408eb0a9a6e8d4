"""core/v1 Events with client-side aggregation and a budget, as client-go's EventCorrelator.

``event_name`` and ``event_body`` are pure: the same (object, reason, message) always names the
same Event, so recording it again bumps its ``count`` instead of creating another. Nothing
grows without bound: the writes about one object are budgeted (``spend``: a burst of
``EVENT_BURST``, then one per ``EVENT_REFILL``; client-go's spam filter), the budgets are kept
for the last ``EVENT_OBJECTS`` objects only, and ``count`` stops at ``MAX_COUNT`` (the API's
int32). The API server expires an Event ``--event-ttl`` (1 h) after its last write.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from xds.kube.client import Clock, KubeClient, KubeError
from xds.kube.conditions import seconds_time
from xds.kube.names import COMPONENT

# client-go's EventSourceObjectSpamFilter defaults (burst 25, one more every 5 minutes) and
# the size of its caches (4096)
EVENT_BURST = 25
EVENT_REFILL = timedelta(minutes=5)
EVENT_OBJECTS = 4096
MAX_COUNT = 2**31 - 1  # core/v1 Event.count is an int32


@dataclass(frozen=True, slots=True)
class EventBudget:
    """The Events one object may still be written (``tokens``) as of ``at``."""

    tokens: float
    at: datetime


def spend(
    budget: EventBudget | None,
    now: datetime,
    burst: int = EVENT_BURST,
    refill: timedelta = EVENT_REFILL,
) -> tuple[bool, EventBudget]:
    """Whether one more Event about an object may be written now, and its budget after.
    A token bucket: ``burst`` to start with, one more per ``refill``, never more than
    ``burst``. Pure."""
    if budget is None:
        tokens = float(burst)
    else:
        elapsed = max(0.0, (now - budget.at).total_seconds())
        tokens = min(float(burst), budget.tokens + elapsed / refill.total_seconds())
    if tokens < 1:
        return False, EventBudget(tokens, now)
    return True, EventBudget(tokens - 1, now)


def event_name(involved: Mapping[str, Any], reason: str, message: str) -> str:
    """The Event's name: the object's name and a digest of (kind, name, reason, message)."""
    digest = hashlib.sha256(
        json.dumps([involved.get("kind"), involved.get("name"), reason, message]).encode()
    ).hexdigest()[:16]
    return f"{involved.get('name')}.{digest}"


def event_body(
    involved: Mapping[str, Any],
    reason: str,
    message: str,
    now: datetime,
    instance: str,
    *,
    warning: bool = True,
) -> dict[str, Any]:
    """A new Event (``count`` 1) about ``involved``, reported by ``instance``. Pure."""
    stamp = seconds_time(now)
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": event_name(involved, reason, message),
            "namespace": involved.get("namespace") or "default",
        },
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "count": 1,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "source": {"component": COMPONENT, "host": instance},
        "reportingComponent": COMPONENT,
        "reportingInstance": instance,
    }


class EventRecorder:
    """Records Events: creates one, or bumps ``count`` (up to ``MAX_COUNT``) and
    ``lastTimestamp`` of the existing Event of the same (object, reason, message); within the
    object's budget (``spend``) only: an Event over it is not written, and counted in
    ``dropped``."""

    def __init__(self, kube: KubeClient, clock: Clock, instance: str = "") -> None:
        self.kube, self.clock, self.instance = kube, clock, instance
        # (kind, namespace, name) -> budget, least recently used first
        self._budgets: OrderedDict[tuple[str, str, str], EventBudget] = OrderedDict()
        self.dropped = 0

    async def record(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = True,
    ) -> None:
        at = self.clock()
        key = (
            str(involved.get("kind")),
            str(involved.get("namespace")),
            str(involved.get("name")),
        )
        allowed, self._budgets[key] = spend(self._budgets.get(key), at)
        self._budgets.move_to_end(key)
        if len(self._budgets) > EVENT_OBJECTS:
            self._budgets.popitem(last=False)
        if not allowed:
            self.dropped += 1
            return
        body = event_body(involved, reason, message, at, self.instance, warning=warning)
        ns, name, now = (
            body["metadata"]["namespace"],
            body["metadata"]["name"],
            body["lastTimestamp"],
        )
        try:
            await self.kube.call(self.kube.core.create_namespaced_event, ns, body)
        except KubeError as exc:
            if exc.status != 409:
                raise
            current = await self.kube.call(self.kube.core.read_namespaced_event, name, ns)
            count = min(MAX_COUNT, int(current.get("count") or 1) + 1)
            patch = {"count": count, "lastTimestamp": now}
            await self.kube.call(self.kube.core.patch_namespaced_event, name, ns, patch)


__all__ = [
    "EVENT_BURST",
    "EVENT_OBJECTS",
    "EVENT_REFILL",
    "MAX_COUNT",
    "EventBudget",
    "EventRecorder",
    "event_body",
    "event_name",
    "spend",
]
