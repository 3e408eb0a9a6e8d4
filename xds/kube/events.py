"""core/v1 Events with client-side aggregation.

``event_name`` and ``event_body`` are pure: the same (object, reason, message) always names the
same Event, so recording it again bumps its ``count`` instead of creating another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from xds.kube.client import Clock, KubeClient, KubeError
from xds.kube.conditions import seconds_time
from xds.kube.names import COMPONENT


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
    """Records Events: creates one, or bumps ``count`` and ``lastTimestamp`` of the existing
    Event of the same (object, reason, message)."""

    def __init__(self, kube: KubeClient, clock: Clock, instance: str = "") -> None:
        self.kube, self.clock, self.instance = kube, clock, instance

    async def record(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = True,
    ) -> None:
        body = event_body(involved, reason, message, self.clock(), self.instance, warning=warning)
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
            patch = {"count": int(current.get("count") or 1) + 1, "lastTimestamp": now}
            await self.kube.call(self.kube.core.patch_namespaced_event, name, ns, patch)


__all__ = ["EventRecorder", "event_body", "event_name"]
