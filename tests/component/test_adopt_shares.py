"""A replica adopting rows another replica wrote (the change feed's ``adopt_rows``) costs what
the rows cost, not the mesh: the state it makes, and the state it announces, share every
record they did not change with the state before (a persistent map's update); the
revocations adopted are added to those held, not copied with them. On the old code each
adoption copied the whole mesh twice (a dict, then a new map: ~6 ms at 10,000 workloads,
``benchmarks/bench_revocations``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from tests.unit.fixtures_core import NOW, Clock, make_control_plane, registration
from xds.pmap import PMap
from xds.state import Revocation, Status, Trigger


def _plane(tmp_path: Path, n: int, publisher: object = None) -> Any:
    """A control plane with ``n`` registered workloads (w0..), announcing to ``publisher``."""
    regs = [registration(f"w{i}", port=20000 + i) for i in range(n)]
    return make_control_plane(
        tmp_path, clock=Clock(NOW), platform_key=ec.generate_private_key(ec.SECP256R1()),
        registrations=regs, publisher=publisher,  # type: ignore[arg-type]
    )  # fmt: skip


def _shared_buckets(a: PMap[str, object], b: PMap[str, object]) -> int:
    return sum(x is y for x, y in zip(a._buckets, b._buckets, strict=True))


async def test_adopting_a_row_shares_every_other_record_and_adds_revocations(
    tmp_path: Path,
) -> None:
    plane = _plane(tmp_path, 300)
    cp = plane.cp
    before = cp.state
    held = before.revocations
    assert isinstance(before.workloads, PMap)
    row = replace(before.workloads["w7"], status=Status.QUARANTINED)
    revoked = Revocation(12345, NOW + timedelta(hours=1), NOW, "w7")
    cp.adopt_rows({"w7": row, "w8": None}, [revoked])

    after = cp.state
    assert after.workloads["w7"] is row and "w8" not in after.workloads
    assert after.workloads["w9"] is before.workloads["w9"]
    buckets = len(before.workloads._buckets)
    # the two rows touched at most two buckets: the others are the very same dicts
    assert _shared_buckets(before.workloads, after.workloads) >= buckets - 2
    assert after.revocations.extends(held) and after.revocations[len(held) :] == (revoked,)
    assert after.revocations.revokes(12345)

    cp._flush()  # (the announcement is queued on the loop: made now)
    announced = plane.publisher.last_state
    assert announced.workloads["w7"] is row and "w8" not in announced.workloads
    assert _shared_buckets(before.workloads, announced.workloads) >= buckets - 2


class _ChangedPublisher:
    """Records the names each announcement says changed."""

    def __init__(self) -> None:
        self.changed: list[frozenset[str]] = []
        self.states: list[object] = []

    def publish(
        self, state: object, mesh_policies: object, trust: object, changed: object = None
    ) -> None:
        self.changed.append(frozenset(changed) if changed is not None else frozenset({"*"}))
        self.states.append(state)

    def on_events(self, state: object, events: object) -> None:
        pass


async def test_a_replica_that_only_adopts_announces_each_row_once(tmp_path: Path) -> None:
    """Rows adopted with no decision of this replica in flight are announced once, then
    forgotten: each fed batch is announced as what it changed (before, a replica that only
    adopted announced every row it had ever adopted again with each batch)."""
    publisher = _ChangedPublisher()
    cp = _plane(tmp_path, 50, publisher).cp
    publisher.changed.clear()
    for i in range(20):
        row = replace(cp.state.workloads[f"w{i}"], status=Status.QUARANTINED)
        cp.adopt_rows({f"w{i}": row})
        await asyncio.sleep(0)  # the announcement, queued on the loop
        assert publisher.changed[-1] == {f"w{i}"}
        assert publisher.states[-1].workloads[f"w{i}"] is row  # type: ignore[attr-defined]
    assert len(publisher.changed) == 20
    assert not cp._adopted


async def test_a_row_adopted_while_a_decision_is_in_flight_reaches_its_announcement(
    tmp_path: Path,
) -> None:
    """A decision made before a row was adopted, announced after it: the announcement still
    carries the adopted row (its state was decided without it), and the row is forgotten
    only then."""
    publisher = _ChangedPublisher()
    cp = _plane(tmp_path, 5, publisher).cp
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    real_write = cp._store.write
    cp._store.write = lambda batch: (real_write(batch), gate)[1]  # durable when opened
    cp.quarantine("w0", Trigger.OPERATOR, "decided first")  # its write in flight
    row = replace(cp.state.workloads["w1"], status=Status.QUARANTINED)
    cp.adopt_rows({"w1": row})
    await asyncio.sleep(0)  # the adoption's announcement
    assert publisher.states[-1].workloads["w1"] is row  # type: ignore[attr-defined]
    assert "w1" in cp._adopted  # the decision in flight predates it
    gate.set_result(None)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    last = publisher.states[-1]
    assert last.workloads["w1"] is row  # type: ignore[attr-defined]
    assert last.workloads["w0"].status is Status.QUARANTINED  # type: ignore[attr-defined]
    assert not cp._adopted
