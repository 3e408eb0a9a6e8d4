"""The renewal fast paths (a record whose registration is the very object it was and whose
status is unchanged) answer what the general paths answer: ``affected_by`` for renewals with
the same or other claims, attested or not, and ``MeshIndex.put``'s reverse indexes, which stay
those of an index built afresh from the same state."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.unit.xds.meshfixture import NOW, TD, two_workloads
from tests.unit.xds.test_config_view import renewed
from xds.index import MeshIndex, affected_by
from xds.state import Status, Trigger, WorkloadState, quarantine


def _general(old: WorkloadState, new: WorkloadState) -> object:
    """``affected_by`` through its general path: an equal registration, not the same one."""
    return affected_by(replace(old, registration=replace(old.registration)), new, TD)


@pytest.mark.parametrize("claims", ["same", "other measurement", "other tee", "none"])
@pytest.mark.parametrize("status", [Status.ATTESTED, Status.QUARANTINED, Status.PENDING])
def test_affected_by_fast_path_answers_what_the_general_path_does(
    claims: str, status: Status
) -> None:
    state = two_workloads()
    old = replace(state.workloads["frontend"], status=status)
    new = replace(renewed(state).workloads["frontend"], status=status)
    assert new.attestation is not None and old.attestation is not None
    if claims == "same":
        new = replace(new, attestation=replace(new.attestation, tee=old.attestation.tee,
                      measurements=dict(old.attestation.measurements)))  # fmt: skip
    elif claims == "other measurement":
        new = replace(new, attestation=replace(new.attestation, measurements={"m": "ab"}))
    elif claims == "other tee":
        new = replace(new, attestation=replace(new.attestation, tee="snp"))
    else:
        new = replace(new, attestation=None)
    assert old.registration is new.registration
    assert affected_by(old, new, TD) == _general(old, new)


def test_index_after_renewals_and_changes_is_the_index_built_afresh() -> None:
    state = two_workloads()
    index = MeshIndex.of(state)
    for step in range(4):
        before = state
        state = renewed(state) if step % 2 == 0 else quarantine(
            state, "backend", Trigger.OPERATOR, "x", NOW
        )[0]  # fmt: skip
        for name in state.workloads:
            if state.workloads[name] is not before.workloads.get(name):
                index.put(name, state.workloads[name])
        fresh = MeshIndex.of(state)
        assert index.workloads == fresh.workloads
        assert (index.members, index.callers, index.principals, index.quarantined) == (
            fresh.members, fresh.callers, fresh.principals, fresh.quarantined,
        )  # fmt: skip
