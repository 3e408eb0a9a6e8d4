"""The persistent map MeshState holds its workloads in (xds.pmap), against a plain dict.

For random sequences of set / delete / batch updates, every map produced equals the dict the
same operations make, and every map produced earlier still equals its own dict afterwards
(nothing a reader holds changes). MeshState transitions keep the state they came from intact
and share the records they did not change.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.xds.meshfixture import NOW, TD
from xds.index import changed_names
from xds.pmap import PMap
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    Trigger,
    quarantine,
    record_attestation,
    register_all,
    unregister,
)

keys = st.integers(0, 300).map(lambda i: f"k{i}")
op_st = st.one_of(
    st.tuples(st.just("set"), keys, st.integers()),
    st.tuples(st.just("delete"), keys),
    st.tuples(
        st.just("update"),
        st.dictionaries(keys, st.integers(), max_size=40),
        st.lists(keys, max_size=10),
    ),
)


@settings(max_examples=200, deadline=None)
@given(start=st.dictionaries(keys, st.integers(), max_size=60), ops=st.lists(op_st, max_size=60))
def test_pmap_equals_a_dict_and_never_changes_under_its_readers(
    start: dict[str, int],
    ops: list[tuple],  # type: ignore[type-arg]
) -> None:
    m: PMap[str, int] = PMap(start)
    d = dict(start)
    held: list[tuple[PMap[str, int], dict[str, int]]] = [(m, dict(d))]
    for op in ops:
        if op[0] == "set":
            m, d[op[1]] = m.set(op[1], op[2]), op[2]
        elif op[0] == "delete":
            m = m.delete(op[1])
            d.pop(op[1], None)
        else:
            m = m.update(op[1], op[2])
            for k in op[2]:
                d.pop(k, None)
            d.update(op[1])
        assert m == d and len(m) == len(d) and set(m) == set(d)
        assert dict(m.items()) == d and sorted(m.values()) == sorted(d.values())
        prev = held[-1][0]
        expected = {
            k
            for k in set(prev) | set(m)
            if (k in prev) != (k in m) or (k in prev and prev[k] is not m[k])
        }
        assert prev.changed_keys(m) == expected == changed_names(prev, m)  # type: ignore[arg-type]
        held.append((m, dict(d)))
    for old, snapshot in held:
        assert old == snapshot
    for k in ("k0", "absent"):
        assert (k in m) == (k in d)
        assert m.get(k) == d.get(k)
    other: object = []
    assert other not in m  # unhashable: in no map
    assert pickle.loads(pickle.dumps(m)) == d  # noqa: S301 (our own bytes)


def test_changed_keys_is_by_identity_and_skips_shared_buckets() -> None:
    a: PMap[str, object] = PMap({f"k{i}": object() for i in range(1000)})
    b = a.set("k5", object()).delete("k7").set("new", 1)
    assert a.changed_keys(b) == {"k5", "k7", "new"}
    assert changed_names(a, b) == {"k5", "k7", "new"}  # type: ignore[arg-type]
    assert a.set("k1", a["k1"]) is a and a.delete("missing") is a and a.update({}) is a
    assert a.changed_keys(dict(b.items())) == {"k5", "k7", "new"}


def test_growth_keeps_every_binding() -> None:
    m: PMap[int, int] = PMap()
    for i in range(5000):
        m = m.set(i, i * i)
    assert len(m) == 5000 and all(m[i] == i * i for i in range(5000))
    assert len(m._buckets) >= 64  # about sqrt(n) buckets, not 4


def _mesh(n: int) -> MeshState:
    regs = [
        Registration(f"w{i}", "default", f"sa{i % 7}", "svc", Endpoint("127.0.0.1", 15000), 8080)
        for i in range(n)
    ]
    state, _, _ = register_all(MeshState(TD), regs, NOW)
    return state


def _attest(state: MeshState, name: str, serial: int) -> MeshState:
    new, _ = record_attestation(
        state, name, AttestationRecord("sim", {}, "p", "0", NOW),
        IssuedCert(serial, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
    )  # fmt: skip
    return new


def test_transitions_leave_the_state_they_came_from_intact_and_share_the_rest() -> None:
    s0 = _mesh(500)
    before = dict(s0.workloads.items())
    s1 = _attest(s0, "w3", 1)
    s2, _ = quarantine(s1, "w3", Trigger.OPERATOR, "x", NOW)
    s3, _ = unregister(s2, "w4", NOW)
    assert dict(s0.workloads.items()) == before  # a reader of s0 sees s0
    assert s1.workloads["w3"].attestation is not None and s0.workloads["w3"].attestation is None
    assert "w4" in s2.workloads and "w4" not in s3.workloads
    assert changed_names(s0.workloads, s3.workloads) == {"w3", "w4"}
    assert all(s3.workloads[n] is s0.workloads[n] for n in s3.workloads if n != "w3")
    # a plain dict given to MeshState is held as a persistent map
    assert isinstance(MeshState(TD, dict(before)).workloads, PMap)
    assert MeshState(TD, dict(before)) == s0


def test_one_transition_costs_what_it_changed_not_the_size_of_the_mesh() -> None:
    """A record_attestation at 20,000 workloads costs about what it costs at 200 (the old
    dict copy made it ~100x more); generous bound, the machine is shared."""

    def per_transition(n: int) -> float:
        state = _mesh(n)
        best = float("inf")
        for rep in range(5):
            t0 = time.perf_counter()
            for i in range(200):
                state = _attest(state, f"w{(i * 7) % n}", rep * 1000 + i)
            best = min(best, (time.perf_counter() - t0) / 200)
        return best

    small, large = per_transition(200), per_transition(20_000)
    assert large < 3 * small, (small, large)
