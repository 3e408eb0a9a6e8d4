"""A workload that leaves the mesh (its pod deleted, ``unregister``) leaves no per-node state
behind in the xDS layer: the cache drops its snapshot, the publisher's index forgets it and its
reverse-index entries, and nothing rebuilds it later. Without this a control plane's memory grows
with every pod that ever existed (pods churn; names rarely repeat)."""

from __future__ import annotations

import pytest

from tests.unit.xds.meshfixture import NOW, TD, TRUST, attested, many_callers, reg
from xds.build import TrustMaterial
from xds.cache import SnapshotCache
from xds.index import principal_of
from xds.publisher import XdsPublisher
from xds.state import MeshState, unregister

GONE = "client-3"


def published(n: int) -> tuple[SnapshotCache, XdsPublisher, MeshState]:
    cache = SnapshotCache()
    pub = XdsPublisher(cache)
    state = many_callers(n)
    pub.publish(state, [], TRUST)
    for node in state.workloads:  # every node asked for once: every snapshot held
        assert cache.get(node) is not None
    return cache, pub, state


def assert_forgotten(cache: SnapshotCache, pub: XdsPublisher, name: str) -> None:
    assert name not in cache.nodes()
    assert name not in cache.held()
    assert cache.get(name) is None  # not built again on demand either
    assert name not in cache.nodes()
    index = pub.index
    assert index is not None
    assert index.get(name) is None
    for table in (index.members, index.callers, index.principals):
        assert all(name not in names for names in table.values()), table


@pytest.mark.parametrize("tell", [True, False], ids=["changed-named", "changed-compared"])
def test_an_unregistered_workload_leaves_no_snapshot_or_index_entry(tell: bool) -> None:
    cache, pub, state = published(6)
    gone_reg = state.workloads[GONE].registration
    state, events = unregister(state, GONE, NOW)
    assert events
    pub.publish(state, [], TRUST, {GONE} if tell else None)
    assert_forgotten(cache, pub, GONE)
    assert cache.nodes() == set(state.workloads)  # the others are still held
    index = pub.index
    assert index is not None
    # its principal and the service it called hold no empty leftovers either
    assert principal_of(gone_reg) not in index.principals
    assert index.callers_of([("default", "backend")]) == {f"client-{i}" for i in range(6) if i != 3}


def test_a_stream_still_open_for_a_gone_node_keeps_its_last_snapshot_but_nothing_rebuilds_it() -> (
    None
):
    cache, pub, state = published(4)
    with cache.watch(GONE) as watch:
        last = cache.get(GONE)
        assert last is not None
        watch.changed.clear()
        state, _ = unregister(state, GONE, NOW)
        pub.publish(state, [], TRUST, {GONE})
        assert_forgotten(cache, pub, GONE)
        assert not watch.changed.is_set()  # the stream is not woken with an empty config
        # a trust change rebuilds every watched node: the gone one stays gone
        pub.publish(state, [], TrustMaterial(TRUST.bundle_pem, b"crl-2"))
        assert_forgotten(cache, pub, GONE)
        assert not watch.changed.is_set()
    assert cache.watching(GONE) == 0


def test_a_full_republish_drops_the_snapshots_of_workloads_no_longer_in_state() -> None:
    cache, pub, state = published(4)
    state, _ = unregister(state, GONE, NOW)
    # another trust domain: the publisher resets (a full rebuild from the new state)
    moved = MeshState("other." + TD)
    for name, w in state.workloads.items():
        moved = attested(moved, reg(name, w.registration.inbound.port), 1)
    pub.publish(moved, [], TRUST)
    assert_forgotten(cache, pub, GONE)
    assert cache.nodes() <= set(moved.workloads)


def test_churn_does_not_grow_the_cache() -> None:
    """Pods come and go under new names: what is held stays the size of the live mesh."""
    cache, pub, state = published(2)
    live = len(state.workloads)
    for i in range(50):
        name = f"churn-{i}"
        state = attested(state, reg(name, 50000 + i, {"backend": 40000}), 100 + i)
        pub.publish(state, [], TRUST, {name})
        assert cache.get(name) is not None
        state, _ = unregister(state, name, NOW)
        pub.publish(state, [], TRUST, {name})
        assert len(cache.nodes()) <= live
        index = pub.index
        assert index is not None and len(index.workloads) == live
