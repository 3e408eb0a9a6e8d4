"""The pure decisions of the Kubernetes adapter that moved out of its I/O code: a recreated pod,
pods gone while no replica watched, a namespace event, the Lease spec, the Event name, what a
node still lacks for a platform quarantine, and when the next re-apply runs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from xds.kube.actions import node_quarantine_patch
from xds.kube.events import event_body, event_name
from xds.kube.lease import LeaseAction, decide_lease, lease_spec
from xds.kube.names import COMPONENT, LABEL_PLATFORM_UNTRUSTED, TAINT_PLATFORM_UNTRUSTED
from xds.kube.work import resync_wait
from xds.kube.workloads import departed, is_recreated, object_key, parse_namespace
from xds.state import Endpoint, Registration

T0 = datetime(2026, 12, 2, 1, 0, 0, 123456, tzinfo=UTC)


def reg(uid: str | None) -> Registration:
    return Registration(
        name="shop/web-0", namespace="shop", service_account="web", service="web",
        inbound=Endpoint("10.0.0.7", 15006), app_port=8080, pod_uid=uid,
    )  # fmt: skip


def test_a_known_pod_name_under_another_uid_is_a_new_pod() -> None:
    assert is_recreated("uid-1", reg("uid-2"))
    assert is_recreated("uid-1", reg(None))  # the new registration cannot be the old pod
    assert not is_recreated("uid-1", reg("uid-1"))
    assert not is_recreated(None, reg("uid-2"))  # nothing known of the previous pod


def test_pods_gone_unwatched_are_departed_and_local_registrations_stay() -> None:
    known = ["shop/web-0", "shop/web-1", "local-worker", "billing/api-0"]
    assert departed(known, {"shop/web-1"}) == ["billing/api-0", "shop/web-0"]
    assert departed(known, set(known)) == []


def test_a_namespace_event_yields_its_labels_and_a_deletion_none() -> None:
    obj = {"metadata": {"name": "shop", "labels": {"attestmesh.dev/inject": "enabled", "n": 1}}}
    assert parse_namespace("ADDED", obj) == (
        "shop", {"attestmesh.dev/inject": "enabled", "n": "1"}
    )  # fmt: skip
    assert parse_namespace("DELETED", obj) == ("shop", {})
    assert parse_namespace("ADDED", {"metadata": {}}) is None
    assert object_key({"metadata": {"name": "x"}}) == ("default", "x")


def test_the_lease_spec_keeps_the_acquire_time_on_renewal_and_counts_takeovers() -> None:
    created = lease_spec("cp-a", timedelta(seconds=15), T0, None, False)
    assert created == {
        "holderIdentity": "cp-a",
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-12-02T01:00:00.123456Z",
        "renewTime": "2026-12-02T01:00:00.123456Z",
        "leaseTransitions": 0,
    }
    later = T0 + timedelta(seconds=5)
    renewed = lease_spec("cp-a", timedelta(seconds=15), later, {"spec": created}, False)
    assert renewed["acquireTime"] == created["acquireTime"]
    assert renewed["renewTime"] == "2026-12-02T01:00:05.123456Z"
    taken = lease_spec("cp-b", timedelta(seconds=15), later, {"spec": created}, True)
    assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("cp-b", 1)
    assert taken["acquireTime"] == "2026-12-02T01:00:05.123456Z"
    # the spec written is one the other replicas read as held until it expires
    lease = {"spec": taken}
    assert decide_lease(lease, "cp-a", later + timedelta(seconds=14)) == (LeaseAction.WAIT, "cp-b")
    assert decide_lease(lease, "cp-a", later + timedelta(seconds=15))[0] is LeaseAction.TAKEOVER


def test_the_same_object_reason_and_message_name_the_same_event() -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "namespace": "shop"}
    name = event_name(pod, "Quarantined", "quarantined (operator): x")
    assert name.startswith("web-0.") and len(name) == len("web-0.") + 16
    assert event_name(pod, "Quarantined", "quarantined (operator): x") == name
    assert event_name(pod, "Quarantined", "quarantined (operator): y") != name
    assert event_name({**pod, "kind": "Node"}, "Quarantined", "quarantined (operator): x") != name
    body = event_body(pod, "Quarantined", "m" * 2000, T0, "cp-a", warning=False)
    assert body["metadata"] == {
        "name": event_name(pod, "Quarantined", "m" * 2000),
        "namespace": "shop",
    }
    assert len(body["message"]) == 1024 and body["type"] == "Normal" and body["count"] == 1
    assert body["firstTimestamp"] == body["lastTimestamp"] == "2026-12-02T01:00:00Z"
    assert body["source"] == {"component": COMPONENT, "host": "cp-a"}


TAINT = {"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}


def test_a_node_gets_only_what_it_lacks_of_label_and_taint() -> None:
    bare = {"metadata": {"name": "n1"}, "spec": {}}
    assert node_quarantine_patch(bare) == {
        "metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}},
        "spec": {"taints": [TAINT]},
    }
    tainted = {"metadata": {"name": "n1"}, "spec": {"taints": [TAINT]}}
    assert node_quarantine_patch(tainted) == {
        "metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}}
    }
    done = {"metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}}, "spec": {"taints": [TAINT]}}
    assert node_quarantine_patch(done) is None
    # the same key with another effect is not the quarantine taint
    other = {**done, "spec": {"taints": [{**TAINT, "effect": "PreferNoSchedule"}]}}
    assert node_quarantine_patch(other) == {
        "metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}},
        "spec": {"taints": [TAINT]},
    }


def test_the_reapply_runs_every_resync_and_backs_off_from_one_second_after_a_failure() -> None:
    resync = timedelta(minutes=5)
    assert resync_wait(False, resync, 8.0) == (300.0, 1.0)
    waits, backoff = [], 1.0
    for _ in range(10):
        wait, backoff = resync_wait(True, resync, backoff)
        waits.append(wait)
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 300.0]
    assert resync_wait(True, timedelta(seconds=3), 8.0) == (3.0, 3.0)
