"""The publisher's event log: routine attestations at DEBUG, every other transition at INFO."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import pytest

from xds.cache import SnapshotCache
from xds.publisher import XdsPublisher
from xds.state import Event, EventKind, MeshState


def test_attestations_log_at_debug_and_the_rest_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = XdsPublisher(SnapshotCache())
    now = datetime(2030, 1, 1, tzinfo=UTC)
    events = [
        Event(EventKind.ATTESTED, "web-1", now),
        Event(EventKind.QUARANTINED, "web-2", now, "measurement_mismatch"),
        Event(EventKind.REFUSED, "web-3", now, "signature_invalid"),
    ]
    state = MeshState("mesh.example")
    with caplog.at_level(logging.INFO, logger="xds.publisher"):
        publisher.on_events(state, events)
    assert [(r.levelno, r.getMessage().split()[1]) for r in caplog.records] == [
        (logging.INFO, "quarantined"),
        (logging.INFO, "refused"),
    ]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="xds.publisher"):
        publisher.on_events(state, events[:1])
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.DEBUG, "event attested web-1 ")
    ]
