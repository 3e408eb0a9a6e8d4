"""The sequence MeshState holds its revocations in (xds.state.Revocations), against a tuple.

For random sequences of appends and removals (across chunk boundaries), every sequence made
equals the tuple the same operations make: items, order, length, indexes, slices, membership by
serial; every sequence made earlier still equals its own tuple afterwards (nothing a reader
holds changes); ``extends`` tells an append from anything else. The transitions that revoke
share what was revoked before instead of copying it.
"""

from __future__ import annotations

import pickle
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.xds.meshfixture import NOW, TD
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    Revocation,
    Revocations,
    prune_revocations,
    record_attestation,
    register_all,
)
from xds.store import diff

CHUNK = Revocations._CHUNK


def rev(serial: int, hours: int = 1) -> Revocation:
    return Revocation(serial, NOW + timedelta(hours=hours), NOW, f"w{serial % 7}")


def same(made: Revocations, want: tuple[Revocation, ...]) -> None:
    assert made == want and want == made
    assert len(made) == len(want)
    assert tuple(made) == want
    assert list(reversed(made)) == list(reversed(want))
    for i in {0, len(want) // 2, len(want) - 1, -1, -len(want)} if want else ():
        assert made[i] == want[i]
    for a, b in [(0, None), (len(want) // 3, None), (1, len(want) - 1), (5, 3), (None, None)]:
        assert made[a:b] == want[a:b]
    assert made[::2] == want[::2]
    assert made.serials() == {r.serial for r in want}
    for r in want[:: max(1, len(want) // 5)]:
        assert made.revokes(r.serial) and r in made


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, CHUNK + 40)),
        st.tuples(st.just("without"), st.integers(0, 3)),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_revocations_equal_the_tuple_the_same_operations_make(steps: list[tuple[str, int]]) -> None:
    made, want = Revocations(), ()
    held: list[tuple[Revocations, tuple[Revocation, ...]]] = []
    serial = 0
    for op, k in steps:
        if op == "add":
            more = tuple(rev(serial + i) for i in range(k))
            serial += k
            after = made.added(more)
            assert after.extends(made)
            assert (after is made) == (not more)
            made, want = after, want + more
        else:  # drop every serial = k (mod 4)
            gone = [r.serial for r in want if r.serial % 4 == k]
            after = made.without(gone)
            assert (after is made) == (not gone)
            if gone:
                assert not after.extends(made)
            made, want = after, tuple(r for r in want if r.serial % 4 != k)
        held.append((made, want))
        same(made, want)
    for earlier, its in held:
        same(earlier, its)


def test_revocations_refuse_what_is_not_one_and_compare_only_with_sequences_of_them() -> None:
    with pytest.raises(TypeError, match="not a Revocation"):
        Revocations([rev(1), 2])  # type: ignore[list-item]
    r = Revocations([rev(1), rev(2)])
    assert r != [rev(1), rev(2)]  # as a tuple is not a list
    assert r == Revocations((rev(1), rev(2)))
    assert r != (rev(2), rev(1))
    assert hash(r) == hash((rev(1), rev(2)))
    assert pickle.loads(pickle.dumps(r)) == r  # noqa: S301 (our own bytes)
    with pytest.raises(IndexError):
        r[2]
    assert Revocations(r) == r and not Revocations().extends(r)


def _attested(n: int) -> MeshState:
    regs = [
        Registration(f"w{i}", "default", "sa", "svc", Endpoint("127.0.0.1", 15000), 8080)
        for i in range(n)
    ]
    state, _, _ = register_all(MeshState(TD), regs, NOW)
    return state


def test_a_superseding_attestation_shares_the_revocations_made_before() -> None:
    state = _attested(2)
    record = AttestationRecord("sim", {}, "p", "e", NOW)
    serial = 1
    due = NOW + timedelta(hours=1)
    early = state
    for k in range(3 * CHUNK):  # one workload attesting again and again
        before = state
        if k == CHUNK + 10:
            early = state
        cert = IssuedCert(serial, NOW + timedelta(hours=1))
        state, _ = record_attestation(state, "w0", record, cert, due, NOW)
        serial += 1
        assert state.revocations.extends(before.revocations)
        batch = diff(before, state)
        assert batch.revoked == state.revocations[len(before.revocations) :]
        assert not batch.unrevoked
    # every certificate but the 4 live ones, in the order they were superseded
    assert [r.serial for r in state.revocations] == list(range(1, serial - 4))
    # a later state holds the very chunk an earlier one filled (shared, not copied)
    assert (
        early.revocations._chunks and state.revocations._chunks[0] is early.revocations._chunks[0]
    )
    pruned = prune_revocations(state, NOW + timedelta(hours=2))
    assert len(pruned.revocations) == 0 and diff(state, pruned).unrevoked == state.revoked_serials()
