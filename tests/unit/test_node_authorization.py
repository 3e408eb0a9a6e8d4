"""xDS node access is per certificate: the node's own live certificate, nothing else."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from attestmesh.serve import node_may_fetch
from tests.unit.xds.meshfixture import NOW, TD, attested, reg
from xds.server import PeerIdentity, peer_identity
from xds.state import MeshState, Trigger, quarantine, release, spiffe_id

SA = spiffe_id(TD, "default", "web")


def mesh() -> MeshState:
    """web-0 (serial 100) and web-1 (serial 200), both of service account "web"."""
    state = MeshState(TD)
    for name, port, serial in (("web-0", 15001, 100), ("web-1", 15002, 200)):
        state = attested(state, replace(reg(name, port, service="web"), service_account="web"),
                         serial)  # fmt: skip
    return state


def test_only_the_nodes_own_live_certificate_fetches_it() -> None:
    state = mesh()
    assert node_may_fetch(state, "web-0", PeerIdentity((SA,), 100))
    # a sibling's certificate names the same SPIFFE ID but is not web-0's
    assert not node_may_fetch(state, "web-0", PeerIdentity((SA,), 200))
    assert not node_may_fetch(state, "web-0", PeerIdentity((SA,), None))
    assert not node_may_fetch(state, "web-0", PeerIdentity(("spiffe://x/ns/a/sa/b",), 100))
    assert not node_may_fetch(state, "nobody", PeerIdentity((SA,), 100))


def test_a_revoked_certificate_fetches_nothing() -> None:
    state, _ = quarantine(mesh(), "web-0", Trigger.OPERATOR, "x", NOW + timedelta(minutes=1))
    assert not node_may_fetch(state, "web-0", PeerIdentity((SA,), 100))
    state, _ = release(state, "web-0", NOW + timedelta(minutes=2))  # pending: still nothing
    assert not node_may_fetch(state, "web-0", PeerIdentity((SA,), 100))


def test_peer_identity_reads_getpeercert() -> None:
    cert = {"subjectAltName": (("URI", SA), ("DNS", "x")), "serialNumber": "0A1B"}
    assert peer_identity(cert) == PeerIdentity((SA,), 0x0A1B)
    assert peer_identity(None) == PeerIdentity((), None)
    assert peer_identity({"serialNumber": "zz"}).serial is None
