from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest

from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.state import (
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    QuarantinedError,
    QuarantineRecord,
    Revocation,
    Status,
    Trigger,
    UnknownWorkloadError,
    ensure_may_issue,
    overdue,
    prune_revocations,
    quarantine,
    record_attestation,
    register,
    release,
    spiffe_id,
)

H = timedelta(hours=1)


def _registered(*names: str) -> MeshState:
    state = MeshState(TRUST_DOMAIN)
    for name in names:
        state, _ = register(state, registration(name), NOW)
    return state


def _attested(name: str = "web-1", serial: int = 1, due: object = NOW + H) -> MeshState:
    state = _registered(name)
    state, _ = record_attestation(
        state,
        name,
        record(),
        IssuedCert(serial, NOW + 2 * H),
        due,
        NOW,  # type: ignore[arg-type]
    )
    return state


def test_register_adds_pending_workload_once() -> None:
    reg = registration()
    state, events = register(MeshState(TRUST_DOMAIN), reg, NOW)
    w = state.get("web-1")
    assert w.status is Status.PENDING and w.registration == reg
    assert w.certificates == () and w.attestation is None and w.quarantine is None
    assert events == [Event(EventKind.REGISTERED, "web-1", NOW)]
    again, events = register(state, reg, NOW)
    assert again is state and events == []


def test_re_registration_updates_facts_but_keeps_status() -> None:
    state = _attested()
    moved = registration(port=16000)
    state2, events = register(state, moved, NOW)
    assert events == []
    w = state2.get("web-1")
    assert w.registration.inbound.port == 16000
    assert w.status is Status.ATTESTED and w.certificates == state.get("web-1").certificates


def test_spiffe_id() -> None:
    assert registration(namespace="shop", service_account="api").spiffe_id("td.example") == (
        "spiffe://td.example/ns/shop/sa/api"
    )
    assert spiffe_id("a", "b", "c") == "spiffe://a/ns/b/sa/c"


def test_unknown_workload() -> None:
    with pytest.raises(UnknownWorkloadError) as info:
        MeshState(TRUST_DOMAIN).get("ghost")
    assert info.value.reason == "unknown_identity"
    for transition in (
        lambda s: quarantine(s, "ghost", Trigger.OPERATOR, "x", NOW),
        lambda s: release(s, "ghost", NOW),
        lambda s: ensure_may_issue(s, "ghost"),
    ):
        with pytest.raises(UnknownWorkloadError):
            transition(MeshState(TRUST_DOMAIN))


def test_attestation_records_cert_and_deadline() -> None:
    state = _registered("web-1")
    rec = record()
    state, events = record_attestation(
        state, "web-1", rec, IssuedCert(7, NOW + 2 * H), NOW + H, NOW
    )
    w = state.get("web-1")
    assert w.status is Status.ATTESTED
    assert w.attestation == rec
    assert w.next_attestation_due == NOW + H
    assert w.certificates == (IssuedCert(7, NOW + 2 * H),)
    assert events == [Event(EventKind.ATTESTED, "web-1", NOW, "default/pol")]
    assert [x.registration.name for x in state.attested()] == ["web-1"]


def test_renewal_keeps_live_certificates_and_drops_expired_ones() -> None:
    state = _registered("web-1")
    state, _ = record_attestation(state, "web-1", record(), IssuedCert(1, NOW + H), NOW, NOW)
    later = NOW + 30 * 60 * timedelta(seconds=1)
    state, _ = record_attestation(state, "web-1", record(), IssuedCert(2, NOW + 3 * H), NOW, later)
    assert [c.serial for c in state.get("web-1").certificates] == [1, 2]
    much_later = NOW + 2 * H
    state, _ = record_attestation(
        state, "web-1", record(), IssuedCert(3, NOW + 4 * H), NOW, much_later
    )
    assert [c.serial for c in state.get("web-1").certificates] == [2, 3]


def test_quarantine_revokes_live_certs_and_blocks_issuance() -> None:
    state = _registered("web-1")
    state, _ = record_attestation(state, "web-1", record(), IssuedCert(1, NOW + H), NOW, NOW)
    state, _ = record_attestation(state, "web-1", record(), IssuedCert(2, NOW + 3 * H), NOW, NOW)
    at = NOW + 90 * timedelta(minutes=1)  # cert 1 has expired by now
    state, events = quarantine(state, "web-1", Trigger.APPRAISAL_FAILED, "measurement", at)
    w = state.get("web-1")
    assert w.status is Status.QUARANTINED
    assert w.certificates == () and w.next_attestation_due is None
    assert w.quarantine == QuarantineRecord(Trigger.APPRAISAL_FAILED, "measurement", at)
    assert state.revocations == (Revocation(2, NOW + 3 * H, at, "web-1"),)
    assert state.revoked_serials() == frozenset({2})
    assert events == [
        Event(EventKind.QUARANTINED, "web-1", at, "measurement", Trigger.APPRAISAL_FAILED)
    ]
    assert state.attested() == []
    with pytest.raises(QuarantinedError) as info:
        ensure_may_issue(state, "web-1")
    assert info.value.reason == "quarantined" and "measurement" in info.value.detail
    with pytest.raises(QuarantinedError):
        record_attestation(state, "web-1", record(), IssuedCert(9, NOW + 4 * H), NOW, at)


def test_quarantine_is_idempotent() -> None:
    state = _attested()
    state, _ = quarantine(state, "web-1", Trigger.OPERATOR, "first", NOW)
    again, events = quarantine(state, "web-1", Trigger.DEADLINE_MISSED, "second", NOW + H)
    assert again is state and events == []
    assert again.get("web-1").quarantine == QuarantineRecord(Trigger.OPERATOR, "first", NOW)
    assert len(again.revocations) == 1


def test_quarantine_of_a_pending_workload_revokes_nothing() -> None:
    state, events = quarantine(_registered("web-1"), "web-1", Trigger.OPERATOR, "x", NOW)
    assert state.get("web-1").status is Status.QUARANTINED
    assert state.revocations == () and len(events) == 1


def test_release_returns_to_pending_and_fresh_attestation_re_admits() -> None:
    state = _attested()
    state, _ = quarantine(state, "web-1", Trigger.OPERATOR, "x", NOW)
    released, events = release(state, "web-1", NOW + H)
    w = released.get("web-1")
    assert w.status is Status.PENDING
    assert w.quarantine is None and w.attestation is None and w.certificates == ()
    assert events == [Event(EventKind.RELEASED, "web-1", NOW + H)]
    assert released.revocations == state.revocations  # revoked certificates stay revoked
    ensure_may_issue(released, "web-1")
    again, events = record_attestation(
        released, "web-1", record(), IssuedCert(5, NOW + 3 * H), NOW + 2 * H, NOW + H
    )
    assert again.get("web-1").status is Status.ATTESTED
    assert [c.serial for c in again.get("web-1").certificates] == [5]
    assert events[0].kind is EventKind.ATTESTED


def test_release_of_a_workload_that_is_not_quarantined_changes_nothing() -> None:
    for state in (_registered("web-1"), _attested()):
        same, events = release(state, "web-1", NOW)
        assert same is state and events == []


def test_overdue_lists_attested_workloads_past_their_deadline() -> None:
    state = _attested("a", 1, NOW + H)
    state, _ = register(state, registration("b"), NOW)
    state, _ = record_attestation(
        state, "b", record(), IssuedCert(2, NOW + 2 * H), NOW + 2 * H, NOW
    )
    state, _ = register(state, registration("c"), NOW)  # pending: never overdue
    state, _ = register(state, registration("d"), NOW)
    state, _ = record_attestation(state, "d", record(), IssuedCert(3, NOW + 2 * H), NOW, NOW)
    state, _ = quarantine(state, "d", Trigger.OPERATOR, "x", NOW)  # quarantined: not overdue
    assert overdue(state, NOW) == []
    assert overdue(state, NOW + H) == ["a"]  # the deadline itself counts
    assert overdue(state, NOW + 3 * H) == ["a", "b"]


def test_prune_revocations_drops_only_expired_certificates() -> None:
    state = replace(
        MeshState(TRUST_DOMAIN),
        revocations=(
            Revocation(1, NOW + H, NOW, "a"),
            Revocation(2, NOW + 3 * H, NOW, "b"),
        ),
    )
    assert prune_revocations(state, NOW) is state
    pruned = prune_revocations(state, NOW + H)
    assert [r.serial for r in pruned.revocations] == [2]
    assert prune_revocations(state, NOW + 3 * H).revocations == ()
