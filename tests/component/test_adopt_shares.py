"""A replica adopting rows another replica wrote (the change feed's ``adopt_rows``) costs what
the rows cost, not the mesh: the state it makes, and the state it announces, share every
record they did not change with the state before (a persistent map's update); the
revocations adopted are added to those held, not copied with them. On the old code each
adoption copied the whole mesh twice (a dict, then a new map: ~6 ms at 10,000 workloads,
``benchmarks/bench_revocations``)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric import ec

from tests.unit.fixtures_core import NOW, Clock, make_control_plane, registration
from xds.pmap import PMap
from xds.state import Revocation, Status


def _shared_buckets(a: PMap[str, object], b: PMap[str, object]) -> int:
    return sum(x is y for x, y in zip(a._buckets, b._buckets, strict=True))


async def test_adopting_a_row_shares_every_other_record_and_adds_revocations(
    tmp_path: Path,
) -> None:
    clock = Clock(NOW)
    regs = [registration(f"w{i}", port=20000 + i) for i in range(300)]
    plane = make_control_plane(
        tmp_path, clock=clock, platform_key=ec.generate_private_key(ec.SECP256R1()),
        registrations=regs,
    )  # fmt: skip
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
