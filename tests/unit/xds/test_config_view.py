"""A renewal changes nothing the snapshots are built from; a quarantine or a new measurement
does. The xDS publisher rebuilds only then."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from attestmesh.serve import XdsPublisher
from tests.unit.xds.meshfixture import NOW, TRUST, allow, two_workloads
from xds.build import config_view
from xds.cache import SnapshotCache
from xds.state import AttestationRecord, IssuedCert, Trigger, quarantine, record_attestation


def renewed(state, name: str = "frontend"):  # type: ignore[no-untyped-def]
    later = NOW + timedelta(minutes=30)
    new, _ = record_attestation(
        state, name, AttestationRecord("sim", {}, "p", "11", later),
        IssuedCert(99, later + timedelta(hours=1)), later + timedelta(hours=1), later,
    )  # fmt: skip
    return new


def test_renewal_keeps_the_view_quarantine_and_measurements_change_it() -> None:
    state = two_workloads()
    assert config_view(renewed(state)) == config_view(state)
    q, _ = quarantine(state, "backend", Trigger.OPERATOR, "x", NOW)
    assert config_view(q) != config_view(state)
    w = state.workloads["frontend"]
    assert w.attestation is not None
    other = replace(w.attestation, measurements={"measurement": "ab"})
    moved = replace(state, workloads={**state.workloads, "frontend": replace(w, attestation=other)})
    assert config_view(moved) != config_view(state)


class CountingCache(SnapshotCache):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set_snapshots(self, snapshots):  # type: ignore[no-untyped-def]
        self.sets += 1
        super().set_snapshots(snapshots)


def test_publisher_rebuilds_only_on_change() -> None:
    cache = CountingCache()
    pub = XdsPublisher(cache)
    policies = [allow("backend", "frontend")]
    state = two_workloads()
    pub.publish(state, policies, TRUST)
    pub.publish(renewed(state), policies, TRUST)  # a renewal
    assert cache.sets == 1
    pub.publish(state, policies, replace(TRUST, crl_pem=b"other"))  # a revocation
    assert cache.sets == 2
    pub.publish(state, [], replace(TRUST, crl_pem=b"other"))  # a mesh policy change
    assert cache.sets == 3
    assert cache.get("frontend") is not None
