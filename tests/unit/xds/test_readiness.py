"""Readiness: a registered, attested workload that is not ready leaves its service's EDS (only),
comes back when ready, and its readiness survives the store."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tests.unit.xds.meshfixture import NOW, TD, TRUST, attested, reg
from tests.unit.xds.test_xds_build import decoded, endpoints
from xds.build import Packer, build_snapshot
from xds.resources import TypeUrl
from xds.state import MeshState, WorkloadState, register
from xds.store import SqliteStore, workload_from_doc, workload_to_doc


def mesh(*, b1_ready: bool) -> MeshState:
    state = MeshState(TD)
    state = attested(state, reg("backend-0", 20000, service="backend"), 1)
    b1 = replace(reg("backend-1", 20001, service="backend"), ready=b1_ready)
    state = attested(state, b1, 2)
    return attested(state, reg("client", 30000, {"backend": 40000}), 3)


def test_registration_is_ready_by_default() -> None:
    assert reg("x", 1).ready is True


def test_not_ready_endpoint_leaves_eds_and_comes_back() -> None:
    packer = Packer()
    ready = build_snapshot(mesh(b1_ready=True), "client", [], TRUST, packer=packer)
    assert endpoints(ready, "out|backend") == [("127.0.0.1", 20000), ("127.0.0.1", 20001)]

    not_ready = build_snapshot(mesh(b1_ready=False), "client", [], TRUST, packer=packer)
    assert endpoints(not_ready, "out|backend") == [("127.0.0.1", 20000)]
    assert not_ready.consistent()
    # only EDS changes: the cluster still pins both identities (readiness flaps, clusters do not)
    for t in (TypeUrl.CLUSTER, TypeUrl.LISTENER, TypeUrl.ROUTE, TypeUrl.SECRET):
        assert not_ready.version(t) == ready.version(t)
    assert not_ready.version(TypeUrl.ENDPOINT) != ready.version(TypeUrl.ENDPOINT)
    tls = decoded(not_ready, TypeUrl.CLUSTER, "out|backend")["transportSocket"]["typedConfig"]
    sans = tls["commonTlsContext"]["combinedValidationContext"]["defaultValidationContext"]
    pinned = [m["matcher"]["exact"] for m in sans["matchTypedSubjectAltNames"]]
    assert pinned == [
        f"spiffe://{TD}/ns/default/sa/backend-0",
        f"spiffe://{TD}/ns/default/sa/backend-1",
    ]

    again = build_snapshot(mesh(b1_ready=True), "client", [], TRUST, packer=packer)
    assert again.version(TypeUrl.ENDPOINT) == ready.version(TypeUrl.ENDPOINT)


def test_every_endpoint_not_ready_leaves_an_empty_assignment() -> None:
    state = mesh(b1_ready=False)
    b0 = state.get("backend-0").registration
    state, _ = register(state, replace(b0, ready=False), NOW)
    snap = build_snapshot(state, "client", [], TRUST)
    assert snap.consistent() and endpoints(snap, "out|backend") == []


def test_readiness_change_updates_the_registration_and_keeps_status() -> None:
    state = mesh(b1_ready=True)
    b1 = state.get("backend-1")
    new, events = register(state, replace(b1.registration, ready=False), NOW)
    assert events == []  # an update, not a new registration
    w = new.get("backend-1")
    assert w.registration.ready is False
    assert (w.status, w.certificates) == (b1.status, b1.certificates)


def test_readiness_round_trips_through_the_store(tmp_path: Path) -> None:
    state = mesh(b1_ready=False)
    w = state.get("backend-1")
    assert workload_from_doc(workload_to_doc(w)) == w
    store = SqliteStore(tmp_path / "state.db")
    try:
        store.save(MeshState(TD), state, [])
        loaded = store.load(TD)
    finally:
        store.close()
    assert loaded.get("backend-1").registration.ready is False
    assert loaded.get("backend-0").registration.ready is True


def test_documents_written_before_readiness_load_as_ready() -> None:
    w = WorkloadState(reg("old", 1))
    doc = json.loads(json.dumps(workload_to_doc(w)))
    del doc["registration"]["ready"]
    assert workload_from_doc(doc).registration.ready is True
