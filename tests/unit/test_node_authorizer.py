"""The per-push authorization (``NodeAuthorizer``) remembers its last answer per node, and
still gives exactly what ``node_may_fetch`` gives for the state as it is now: a quarantined,
renewed, released or removed workload is decided afresh on the very next push."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from attestmesh.serve import NodeAuthorizer, node_may_fetch
from tests.unit.xds.meshfixture import NOW, TD, attested, reg
from xds.server import PeerIdentity
from xds.state import (
    AttestationRecord,
    IssuedCert,
    MeshState,
    Trigger,
    quarantine,
    record_attestation,
    release,
    spiffe_id,
    unregister,
)

SA = spiffe_id(TD, "default", "web")


@dataclass
class _Cp:
    state: MeshState


def mesh() -> MeshState:
    state = MeshState(TD)
    for name, port, serial in (("web-0", 15001, 100), ("web-1", 15002, 200)):
        state = attested(state, replace(reg(name, port, service="web"), service_account="web"),
                         serial)  # fmt: skip
    return state


def _authorizer(state: MeshState) -> tuple[_Cp, NodeAuthorizer]:
    cp = _Cp(state)
    return cp, NodeAuthorizer(cp)  # type: ignore[arg-type]  # only .state is read


def test_a_quarantine_is_refused_on_the_next_push() -> None:
    cp, authorize = _authorizer(mesh())
    peer = PeerIdentity((SA,), 100)
    assert authorize("web-0", peer) and authorize("web-0", peer)  # the second from the memo
    cp.state, _ = quarantine(cp.state, "web-0", Trigger.OPERATOR, "x", NOW + timedelta(minutes=1))
    assert not authorize("web-0", peer)
    cp.state, _ = release(cp.state, "web-0", NOW + timedelta(minutes=2))
    assert not authorize("web-0", peer)  # pending: still nothing


def test_a_renewal_supersedes_the_remembered_certificate() -> None:
    cp, authorize = _authorizer(mesh())
    old = PeerIdentity((SA,), 100)
    assert authorize("web-0", old)
    cp.state, _ = record_attestation(
        cp.state,
        "web-0",
        AttestationRecord("sim", {}, "p", "00", NOW),
        IssuedCert(101, NOW + timedelta(hours=2)),
        NOW + timedelta(hours=2),
        NOW,
    )
    assert authorize("web-0", PeerIdentity((SA,), 101))
    assert authorize("web-0", old) == node_may_fetch(cp.state, "web-0", old)


def test_another_peer_is_decided_for_itself() -> None:
    _, authorize = _authorizer(mesh())
    assert authorize("web-0", PeerIdentity((SA,), 100))
    assert not authorize("web-0", PeerIdentity((SA,), 200))  # the sibling's certificate
    assert not authorize("web-0", PeerIdentity(("spiffe://x/ns/a/sa/b",), 100))


def test_a_removed_workload_is_refused_and_forgotten() -> None:
    cp, authorize = _authorizer(mesh())
    peer = PeerIdentity((SA,), 100)
    assert authorize("web-0", peer)
    cp.state, _ = unregister(cp.state, "web-0", NOW)
    assert not authorize("web-0", peer)
    assert "web-0" not in authorize._memo
    assert not authorize("nobody", peer)
    assert "nobody" not in authorize._memo


_NODES = ("web-0", "web-1")
_PEERS = (
    *(PeerIdentity((SA,), serial) for serial in (100, 101, 200, 201)),
    PeerIdentity(("spiffe://x/ns/a/sa/b",), 100),
    PeerIdentity((SA,), None),
)


def _apply(state: MeshState, op: tuple[str, str, int]) -> MeshState:
    kind, node, serial = op
    now = NOW + timedelta(minutes=1)
    if node not in state.workloads:
        return attested(state, replace(reg(node, 15001, service="web"), service_account="web"),
                        serial)  # fmt: skip
    if kind == "quarantine":
        return quarantine(state, node, Trigger.OPERATOR, "x", now)[0]
    if kind == "release":
        return release(state, node, now)[0]
    if kind == "unregister":
        return unregister(state, node, now)[0]
    try:
        return record_attestation(
            state,
            node,
            AttestationRecord("sim", {}, "p", "00", now),
            IssuedCert(serial, now + timedelta(hours=1)),
            now + timedelta(hours=1),
            now,
        )[0]
    except Exception:  # not attestable now (quarantined): unchanged
        return state


_OPS = st.tuples(
    st.sampled_from(("quarantine", "release", "unregister", "attest", "check")),
    st.sampled_from(_NODES),
    st.sampled_from((100, 101, 200, 201)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_OPS, st.booleans(),
                          st.lists(st.tuples(st.sampled_from(_NODES),
                                             st.integers(0, len(_PEERS) - 1)),
                                   max_size=4)), max_size=25))  # fmt: skip
def test_the_memo_equals_node_may_fetch(steps: list[Any]) -> None:
    """For random changes and checks, the remembered answers are node_may_fetch's, whether a
    change is announced to it (``changed``, as the control plane's state listener) or not."""
    cp, authorize = _authorizer(mesh())
    for op, announce, checks in steps:
        if op[0] != "check":
            cp.state = _apply(cp.state, op)
            if announce:
                authorize.changed(cp.state, (op[1],))
        for node, k in checks:
            peer = _PEERS[k]
            assert authorize(node, peer) == node_may_fetch(cp.state, node, peer)


def test_after_an_announced_change_the_others_are_answered_without_a_look_up(
    monkeypatch: Any,
) -> None:
    """A quarantine announced as changing web-0 only: web-1's answer stands for the new state
    (no look-up of its record); web-0 is decided afresh. Unannounced, the next push of each
    looks its record up again (as before)."""
    cp, authorize = _authorizer(mesh())
    p0, p1 = PeerIdentity((SA,), 100), PeerIdentity((SA,), 200)
    assert authorize("web-0", p0) and authorize("web-1", p1)
    looked_up: list[str] = []
    pmap = type(cp.state.workloads)
    real_get = pmap.get

    def counting_get(self: Any, key: Any, *default: Any) -> Any:
        looked_up.append(key)
        return real_get(self, key, *default)

    monkeypatch.setattr(pmap, "get", counting_get)
    cp.state, _ = quarantine(cp.state, "web-0", Trigger.OPERATOR, "x", NOW + timedelta(minutes=1))
    authorize.changed(cp.state, ("web-0",))
    assert authorize("web-1", p1) and looked_up == []
    assert not authorize("web-0", p0) and looked_up == ["web-0", "web-0"]  # (and node_may_fetch)
    looked_up.clear()
    cp.state, _ = release(cp.state, "web-0", NOW + timedelta(minutes=2))  # not announced
    assert authorize("web-1", p1) and looked_up == ["web-1"]
    assert not authorize("web-0", p0)


def test_a_change_of_trust_domain_is_not_taken_on_announcement() -> None:
    cp, authorize = _authorizer(mesh())
    peer = PeerIdentity((SA,), 100)
    assert authorize("web-0", peer)
    other = replace(cp.state, trust_domain="elsewhere.test")
    cp.state = other
    authorize.changed(other, ())
    assert authorize("web-0", peer) == node_may_fetch(other, "web-0", peer) is False
