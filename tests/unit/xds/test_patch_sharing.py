"""Patching held snapshots shares what it can and leaks nothing between nodes.

The callers of a service read its endpoints through one layer (one mapping for all of them,
made once per change), each still a snapshot of its own: a later change of one caller's own
resources is not seen by another. ``Snapshot.patched`` builds its result without the
dataclass's ``__init__``: it is a snapshot like any other (equal to one built from the same
resources, versions included, frozen). The publisher queues the nodes of a change in bulk
when nothing was queued before it: only the held ones, each once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import pytest

from tests.unit.xds.meshfixture import NOW, TRUST
from tests.unit.xds.test_incremental import _serving_mesh
from xds.build import Snapshot, build_snapshots
from xds.cache import SnapshotCache
from xds.publisher import XdsPublisher
from xds.resources import TypeUrl
from xds.state import MeshState, Trigger, quarantine, register

WEB_CALLERS = [f"n{i}" for i in range(3, 13)]


def _published(state: MeshState) -> tuple[SnapshotCache, XdsPublisher, list[Callable[[], None]]]:
    cache = SnapshotCache()
    soon: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, soon=soon.append, chunk=4)
    pub.publish(state, [], TRUST)
    return cache, pub, soon


def _snap(cache: SnapshotCache, node: str) -> Snapshot:
    snap = cache.get(node)
    assert snap is not None
    return snap


def _equal_to_rebuild(cache: SnapshotCache, state: MeshState) -> None:
    for node, expected in build_snapshots(state, [], TRUST).items():
        got = _snap(cache, node)
        for t in TypeUrl:
            assert dict(got.get(t)) == dict(expected.get(t)), (node, t.short)
            assert got.version(t) == expected.version(t), (node, t.short)


def test_callers_read_one_endpoints_mapping_through_their_layer_and_keep_their_own() -> None:
    """A quarantine changes the endpoints every caller of the service reads: their group's
    layer takes the new mapping once, and every caller's snapshot reads it, as a rebuild
    would build it (here n0's identity also leaves web's pinned identities: the callers'
    clusters are their own, patched in). A later change of one caller's own resources is
    not seen by another."""
    state = _serving_mesh()
    cache, pub, soon = _published(state)
    before = {n: _snap(cache, n) for n in WEB_CALLERS}
    old_eds = before[WEB_CALLERS[0]].get(TypeUrl.ENDPOINT)
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    pub.publish(q, [], TRUST, changed={"n0"})
    while soon:
        soon.pop(0)()
    after = {n: _snap(cache, n) for n in WEB_CALLERS}
    eds = after[WEB_CALLERS[0]].get(TypeUrl.ENDPOINT)
    assert eds is not old_eds and dict(eds) != dict(old_eds)
    assert pub.patched_nodes == len(WEB_CALLERS)  # their clusters (sa0 no longer pinned)
    assert set(WEB_CALLERS) <= set(pub.wake_order)
    for n in WEB_CALLERS:
        assert after[n] is not before[n]
        assert after[n].get(TypeUrl.ENDPOINT) is eds  # one mapping, made once
        assert before[n].get(TypeUrl.ENDPOINT) is eds  # (through the layer both read)
        assert after[n].version(TypeUrl.ENDPOINT) == after[WEB_CALLERS[0]].version(TypeUrl.ENDPOINT)
        assert after[n].get(TypeUrl.LISTENER) is before[n].get(TypeUrl.LISTENER)
        assert after[n].get(TypeUrl.CLUSTER) != before[n].get(TypeUrl.CLUSTER)
    _equal_to_rebuild(cache, q)

    # one caller's own change later: the others keep theirs (nothing shared was written to)
    mover = WEB_CALLERS[0]
    reg = q.workloads[mover].registration
    moved = dataclasses.replace(reg, app_port=reg.app_port + 7, outbound={"web": 21000})
    q2, _ = register(q, moved, NOW)
    pub.publish(q2, [], TRUST, changed={mover})
    while soon:
        soon.pop(0)()
    assert _snap(cache, mover).get(TypeUrl.CLUSTER) != after[mover].get(TypeUrl.CLUSTER)
    for n in WEB_CALLERS[1:]:
        assert _snap(cache, n) is after[n]
        assert _snap(cache, n).get(TypeUrl.ENDPOINT) is eds
    assert dict(eds) == dict(build_snapshots(q2, [], TRUST)[WEB_CALLERS[1]].get(TypeUrl.ENDPOINT))
    _equal_to_rebuild(cache, q2)


def _snapshot() -> Snapshot:
    return Snapshot.of(
        {
            TypeUrl.CLUSTER: {"inbound|app": b"app", "out|web": b"c1"},
            TypeUrl.ENDPOINT: {"out|web": b"e1"},
            TypeUrl.LISTENER: {"inbound": b"l"},
            TypeUrl.ROUTE: {"inbound": b"r"},
            TypeUrl.SECRET: {"mesh-trust": b"s"},
        },
        {TypeUrl.ENDPOINT: frozenset({"out|web"})},
    )


def test_a_patched_snapshot_is_a_snapshot_like_one_built_from_its_resources() -> None:
    snap = _snapshot()
    new = snap.patched({TypeUrl.CLUSTER: {"out|web": b"c2"}, TypeUrl.ENDPOINT: {"out|web": b"e2"}})
    built = Snapshot.of(
        {
            TypeUrl.CLUSTER: {"inbound|app": b"app", "out|web": b"c2"},
            TypeUrl.ENDPOINT: {"out|web": b"e2"},
            TypeUrl.LISTENER: {"inbound": b"l"},
            TypeUrl.ROUTE: {"inbound": b"r"},
            TypeUrl.SECRET: {"mesh-trust": b"s"},
        },
        {TypeUrl.ENDPOINT: frozenset({"out|web"})},
    )
    assert type(new) is Snapshot and new == built
    assert {t: new.version(t) for t in TypeUrl} == {t: built.version(t) for t in TypeUrl}
    assert new.version(TypeUrl.CLUSTER) != snap.version(TypeUrl.CLUSTER)
    assert new.references is snap.references and new.consistent()
    assert isinstance(new.resources, MappingProxyType)
    assert isinstance(new.versions, MappingProxyType)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.resources = {}  # type: ignore[misc]
    # the original is untouched
    assert dict(snap.get(TypeUrl.CLUSTER)) == {"inbound|app": b"app", "out|web": b"c1"}
    assert dict(snap.get(TypeUrl.ENDPOINT)) == {"out|web": b"e1"}
    # equal bytes, or names it does not hold: nothing differs
    same = bytes(bytearray(b"c1"))
    assert snap.patched({TypeUrl.CLUSTER: {"out|web": same, "out|nope": b"x"}}) is snap


class _Plain(Mapping[TypeUrl, Mapping[str, bytes]]):
    """A mapping that is neither a dict nor a read-only proxy."""

    def __init__(self, d: dict[TypeUrl, Mapping[str, bytes]]) -> None:
        self._d = d

    def __getitem__(self, k: TypeUrl) -> Mapping[str, bytes]:
        return self._d[k]

    def __iter__(self) -> Iterator[TypeUrl]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)


def test_a_snapshot_made_directly_from_plain_mappings_patches_without_changing_them() -> None:
    base = _snapshot()
    resources = dict(base.resources)
    versions = dict(base.versions)
    for made in (
        Snapshot(resources, base.references, versions),
        Snapshot(_Plain(resources), base.references, _Plain(versions)),  # type: ignore[arg-type]
    ):
        new = made.patched({TypeUrl.CLUSTER: {"out|web": b"c3"}})
        assert new.get(TypeUrl.CLUSTER)["out|web"] == b"c3"
        assert made.get(TypeUrl.CLUSTER)["out|web"] == b"c1"
        assert resources == dict(base.resources) and versions == dict(base.versions)


def test_only_held_nodes_are_queued_and_unheld_ones_are_built_when_asked() -> None:
    state = _serving_mesh()
    cache = SnapshotCache()
    pub = XdsPublisher(cache, soon=lambda fn: fn(), chunk=4)
    pub.publish(state, [], TRUST)
    held = WEB_CALLERS[::2]
    for n in held:
        _snap(cache, n)
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    pub.publish(q, [], TRUST, changed={"n0"})
    assert sorted(pub.wake_order) == sorted(held)  # each held caller once, no other
    assert pub.patched_nodes == len(held)
    assert not pub._first and not pub._rest
    assert all(not cache.has(n) for n in WEB_CALLERS[1::2])
    _equal_to_rebuild(cache, q)  # the others are built from the current state


def test_an_endpoint_change_alone_wakes_the_callers_and_patches_nothing() -> None:
    """n1 of web stops being ready: its endpoint leaves web's EDS, its identity stays pinned
    (the clusters do not change). The callers' snapshots are the very objects they held, not
    patched, their streams woken; what they read is what a rebuild makes."""
    state = _serving_mesh()
    cache, pub, soon = _published(state)
    before = {n: _snap(cache, n) for n in WEB_CALLERS}
    clusters = {n: s.get(TypeUrl.CLUSTER) for n, s in before.items()}
    reg = state.workloads["n1"].registration
    flipped, _ = register(state, dataclasses.replace(reg, ready=False), NOW)
    pub.publish(flipped, [], TRUST, changed={"n1"})
    while soon:
        soon.pop(0)()
    assert pub.patched_nodes == 0 and pub.woken_nodes >= len(WEB_CALLERS)
    assert set(WEB_CALLERS) <= set(pub.wake_order)
    for n in WEB_CALLERS:
        assert _snap(cache, n) is before[n]
        assert before[n].get(TypeUrl.CLUSTER) is clusters[n]
    _equal_to_rebuild(cache, flipped)
