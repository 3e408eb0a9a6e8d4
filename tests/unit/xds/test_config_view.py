"""A renewal changes nothing the snapshots are built from; a quarantine or a new measurement
does. The xDS publisher rebuilds only then, and only the nodes that depend on the change."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from tests.unit.xds.meshfixture import NOW, TD, TRUST, allow, two_workloads
from xds.cache import SnapshotCache
from xds.index import affected_by
from xds.publisher import XdsPublisher
from xds.resources import TypeUrl
from xds.state import AttestationRecord, IssuedCert, Trigger, quarantine, record_attestation


def renewed(state, name: str = "frontend"):  # type: ignore[no-untyped-def]
    later = NOW + timedelta(minutes=30)
    new, _ = record_attestation(
        state, name, AttestationRecord("sim", {}, "p", "11", later),
        IssuedCert(99, later + timedelta(hours=1)), later + timedelta(hours=1), later,
    )  # fmt: skip
    return new


def test_renewal_affects_nothing_quarantine_and_measurements_do() -> None:
    state = two_workloads()
    old = state.workloads["frontend"]
    a = affected_by(old, renewed(state).workloads["frontend"], TD)
    assert (a.own, a.services, a.principals) == (False, frozenset(), frozenset())
    q, _ = quarantine(state, "backend", Trigger.OPERATOR, "x", NOW)
    a = affected_by(state.workloads["backend"], q.workloads["backend"], TD)
    assert (
        a.own
        and a.services == {("default", "backend")}
        and a.principals == {("default", "backend")}
    )
    assert old.attestation is not None
    other = replace(old, attestation=replace(old.attestation, measurements={"measurement": "ab"}))
    a = affected_by(old, other, TD)
    # a caller's claims feed claims-based rules only: its own config and services stay
    assert (a.own, a.services, a.principals) == (False, frozenset(), {("default", "frontend")})


def test_publisher_rebuilds_only_on_change() -> None:
    cache = SnapshotCache()
    pub = XdsPublisher(cache)
    policies = [allow("backend", "frontend")]
    state = two_workloads()
    pub.publish(state, policies, TRUST)
    with cache.watch("frontend"), cache.watch("backend"):
        assert cache.get("frontend") is not None  # built on demand, once
        assert cache.get("backend") is not None
        built = cache.built
        held = {n: cache.get(n) for n in ("frontend", "backend")}
        pub.publish(renewed(state), policies, TRUST, changed={"frontend"})  # a renewal
        assert cache.built == built
        assert all(cache.get(n) is s for n, s in held.items())
        secrets = {n: s.get(TypeUrl.SECRET) for n, s in held.items() if s is not None}
        pub.publish(state, policies, replace(TRUST, crl_pem=b"other"))  # a revocation
        # the secret is the trust layer's: nothing patched, both woken (no loop: at once),
        # the snapshots they hold read the new one
        assert cache.built == built and (pub.patched_nodes, pub.woken_nodes) == (0, 2)
        for n, s in held.items():
            assert cache.get(n) is s and s is not None
            assert s.get(TypeUrl.SECRET) is not secrets[n]
        pub.publish(state, [], replace(TRUST, crl_pem=b"other"))  # a mesh policy change
        assert cache.built == built and pub.patched_nodes == 1  # backend's RBAC
        q, _ = quarantine(state, "backend", Trigger.OPERATOR, "x", NOW)
        pub.publish(q, [], replace(TRUST, crl_pem=b"other"), changed={"backend"})
        # backend itself is rebuilt; frontend, a caller of its service, gets the new cluster
        assert (cache.built, pub.patched_nodes) == (built + 1, 1)
    assert cache.get("frontend") is not None
