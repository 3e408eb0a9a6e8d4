"""Per-node snapshots share what equal nodes hold alike (memory per node, not meaning)."""

from __future__ import annotations

from tests.unit.xds.meshfixture import TRUST, allow, many_callers
from xds.build import Snapshot, build_snapshots
from xds.resources import INBOUND_ROUTE, MESH_TRUST, TypeUrl


def test_nodes_calling_the_same_services_share_one_references_mapping() -> None:
    snaps = build_snapshots(many_callers(5), [allow("backend", "client-0")], TRUST)
    clients = [snaps[f"client-{i}"] for i in range(5)]
    for snap in clients:
        assert snap.references is clients[0].references
        assert snap.references[TypeUrl.ENDPOINT] == frozenset({"out|backend"})
        assert snap.references[TypeUrl.ROUTE] == frozenset({INBOUND_ROUTE})
        assert snap.references[TypeUrl.SECRET] == frozenset({MESH_TRUST})
        assert snap.consistent()
    backend = snaps["backend-0"]  # calls nothing: its own (shared) mapping, no EDS reference
    assert backend.references is snaps["backend-1"].references
    assert backend.references[TypeUrl.ENDPOINT] == frozenset()
    assert backend.consistent()


def test_snapshot_of_copies_a_mutable_references_mapping() -> None:
    refs = {TypeUrl.ROUTE: frozenset({INBOUND_ROUTE})}
    snap = Snapshot.of({TypeUrl.ROUTE: {INBOUND_ROUTE: b"r"}}, refs)
    refs[TypeUrl.ENDPOINT] = frozenset({"out|x"})  # the caller's dict changes afterwards
    assert TypeUrl.ENDPOINT not in snap.references
    assert snap.consistent()
