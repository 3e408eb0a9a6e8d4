"""The Events' bounds: the budget of writes about one object (a token bucket, pure), and the
recorder keeping budgets for a bounded number of objects (the API calls stubbed; the writes
against a real API server are tests/kube_real/test_kube_adapter.py's)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from xds.kube.events import (
    EVENT_BURST,
    EVENT_OBJECTS,
    EVENT_REFILL,
    EventBudget,
    EventRecorder,
    spend,
)

T0 = datetime(2026, 12, 2, 1, 0, 0, tzinfo=UTC)


def spend_all(budget: EventBudget | None, now: datetime, times: int) -> list[bool]:
    out = []
    for _ in range(times):
        allowed, budget = spend(budget, now)
        out.append(allowed)
    return out


def test_a_burst_then_one_per_refill_never_more_than_the_burst() -> None:
    assert spend_all(None, T0, EVENT_BURST + 2) == [True] * EVENT_BURST + [False, False]
    empty = EventBudget(0.0, T0)
    assert spend(empty, T0 + EVENT_REFILL / 2)[0] is False
    allowed, after = spend(empty, T0 + EVENT_REFILL)
    assert allowed and after == EventBudget(0.0, T0 + EVENT_REFILL)
    # a day of silence refills the burst, not a day's worth
    rested = T0 + timedelta(days=1)
    assert spend_all(empty, rested, EVENT_BURST + 1) == [True] * EVENT_BURST + [False]
    # a clock that went back refills nothing
    assert spend(empty, T0 - timedelta(hours=1))[0] is False


class Core:
    def create_namespaced_event(self, ns: str, body: dict[str, Any]) -> None: ...


class Kube:
    """The one call a first Event makes (a create), counted."""

    def __init__(self) -> None:
        self.core = Core()
        self.created: list[str] = []

    async def call(self, fn: Callable[..., Any], *args: Any) -> None:
        assert fn == self.core.create_namespaced_event
        self.created.append(args[1]["metadata"]["name"])


def pod(name: str) -> dict[str, str]:
    return {"apiVersion": "v1", "kind": "Pod", "name": name, "namespace": "shop"}


async def test_budgets_are_kept_for_the_most_recent_objects_only() -> None:
    kube = Kube()
    recorder = EventRecorder(kube, lambda: T0)  # type: ignore[arg-type]
    for i in range(EVENT_BURST + 1):
        await recorder.record(pod("loud"), "AttestationAudit", f"attempt {i}")
    assert len(kube.created) == EVENT_BURST and recorder.dropped == 1
    for i in range(EVENT_OBJECTS):  # the loud pod's budget is the least recently used: gone
        await recorder.record(pod(f"web-{i}"), "Quarantined", "m")
    assert len(recorder._budgets) == EVENT_OBJECTS
    await recorder.record(pod("loud"), "AttestationAudit", "again")
    assert len(kube.created) == EVENT_BURST + EVENT_OBJECTS + 1 and recorder.dropped == 1
    assert len(recorder._budgets) == EVENT_OBJECTS
