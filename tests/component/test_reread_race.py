"""Several replicas: a row read again after this replica's write resolved (``_reread``, a
direct read with no feed position) never takes back a newer row the change feed delivered
while the read ran."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from tests.unit.fixtures_core import NOW, Clock, make_control_plane, registration
from xds.state import Status, Trigger, WorkloadState, quarantine
from xds.store_pg import Changes

PLATFORM = ec.generate_private_key(ec.SECP256R1())


class SlowRows:
    """A replica's direct read of rows (``Replication.load_rows``) that waits for the test:
    it returns what was stored when it was asked."""

    def __init__(self, stored: dict[str, WorkloadState | None]) -> None:
        self.stored = dict(stored)
        self.asked = threading.Event()
        self.go = threading.Event()

    def in_contact(self) -> bool:
        return True

    def load_rows(self, names: Collection[str]) -> dict[str, WorkloadState | None]:
        read = {n: self.stored.get(n) for n in names}  # as stored now
        self.asked.set()
        assert self.go.wait(10)
        return read


async def _until_asked(rows: SlowRows) -> None:
    async with asyncio.timeout(10):
        while not rows.asked.is_set():
            await asyncio.sleep(0.01)


def _quarantined(w: WorkloadState) -> WorkloadState:
    """``w`` as another replica's quarantine stores it."""
    from xds.state import MeshState

    state, _ = quarantine(MeshState("mesh.example", {w.registration.name: w}),
                          w.registration.name, Trigger.OPERATOR, "on replica A", NOW)  # fmt: skip
    return state.get(w.registration.name)


async def test_a_row_fed_during_a_reread_is_not_taken_back(tmp_path: Path) -> None:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    cp = plane.cp
    await cp.flushed()
    before = cp.state.get("web-1")
    rows = SlowRows({"web-1": before})
    cp._replication = rows
    reread = asyncio.ensure_future(cp._reread(["web-1"]))
    await _until_asked(rows)  # it has read the row as it was
    newer = _quarantined(before)
    cp.adopt_changes(Changes((7, 7), {"web-1": newer}))  # the feed: replica A quarantined it
    assert cp.status_of("web-1") is Status.QUARANTINED
    rows.go.set()
    await reread
    assert cp.state.get("web-1") == newer  # not taken back to the older read
    assert cp._rereading == {} and cp._fed_at == {}  # nothing kept once the read is done


async def test_a_reread_adopts_its_row_when_the_feed_delivered_nothing_of_it(
    tmp_path: Path,
) -> None:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration(), registration("web-2", port=15002)])  # fmt: skip
    cp = plane.cp
    await cp.flushed()
    stored = _quarantined(cp.state.get("web-1"))
    rows = SlowRows({"web-1": stored})
    cp._replication = rows
    reread = asyncio.ensure_future(cp._reread(["web-1"]))
    await _until_asked(rows)
    cp.adopt_changes(Changes((7, 7), {"web-2": _quarantined(cp.state.get("web-2"))}))
    rows.go.set()
    await reread
    assert cp.state.get("web-1") == stored
    assert cp.status_of("web-2") is Status.QUARANTINED


async def test_a_resync_during_a_reread_wins_over_it(tmp_path: Path) -> None:
    """A resync delivers everything stored: a row it leaves out is gone, and the read that
    ran meanwhile cannot bring it back."""
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    cp = plane.cp
    await cp.flushed()
    rows = SlowRows({"web-1": cp.state.get("web-1")})
    cp._replication = rows
    reread = asyncio.ensure_future(cp._reread(["web-1"]))
    await _until_asked(rows)
    cp.adopt_changes(Changes((9, 9), {}, resync=True))  # unregistered on replica A
    assert "web-1" not in cp.state.workloads
    rows.go.set()
    await reread
    assert "web-1" not in cp.state.workloads
