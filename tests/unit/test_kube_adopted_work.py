"""xds.kube.work.adopted_work: the Kubernetes work of rows another replica decided (adopted
from the store, no events here) is the work ``build_work`` makes of the deciding replica's
events, for a workload that became or stopped being quarantined, and nothing else.
``stale_releases``: the labelled pods the re-apply releases."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from certs.policy import parse_policies
from xds.kube.work import Work, WorkKind, adopted_work, build_work, stale_releases
from xds.state import (
    Endpoint,
    MeshState,
    Registration,
    Trigger,
    quarantine,
    register,
    release,
    unregister,
)

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
EVICTING = {
    "apiVersion": "attestmesh.dev/v1alpha1",
    "kind": "AttestationPolicy",
    "metadata": {"name": "web", "namespace": "shop"},
    "spec": {
        "selector": {"serviceAccounts": ["web"]},
        "allowedTees": ["sim"],
        "referenceValues": {"sim": {"measurement": ["00" * 32]}},
        "onFailure": "quarantineAndEvict",
    },
}


def registered() -> MeshState:
    state = MeshState("attestmesh.local")
    for name in ("shop/web-0", "shop/web-1", "local-1"):
        ns = "default" if name == "local-1" else "shop"
        reg = Registration(name, ns, "web", "web", Endpoint("10.0.0.1", 15006), 8080)
        state, _ = register(state, reg, T0)
    return state


def test_a_quarantine_adopted_is_the_work_of_the_deciders_event() -> None:
    policies = parse_policies([EVICTING])
    before = registered()
    after, events = quarantine(
        before, "shop/web-0", Trigger.TCB_REVOKED, "tcb_status_not_accepted: Revoked", T0,
        code="tcb_status_not_accepted", platform=True,
    )  # fmt: skip
    work = adopted_work(before, after, ["shop/web-0", "shop/web-1"], policies)
    # the same item: same reason and trigger, so the same Event name (it aggregates)
    assert work == build_work(after, events, policies)
    assert work == [
        Work(
            WorkKind.QUARANTINE,
            "shop/web-0",
            "tcb_status_not_accepted: Revoked",
            Trigger.TCB_REVOKED,
            evict=True,
            platform_failed=True,
        )
    ]
    assert not adopted_work(before, after, ["shop/web-0"], [])[0].evict  # no governing policy


def test_only_a_change_of_quarantine_makes_work() -> None:
    before = registered()
    q, _ = quarantine(before, "shop/web-0", Trigger.OPERATOR, "compromised", T0)
    # already quarantined here (adopted again, or re-quarantined elsewhere): nothing new
    again, _ = quarantine(q, "shop/web-1", Trigger.OPERATOR, "x", T0 + timedelta(seconds=1))
    assert adopted_work(q, again, ["shop/web-0"], []) == []
    # released elsewhere: released here
    released, events = release(q, "shop/web-0", T0)
    assert adopted_work(q, released, ["shop/web-0"], []) == build_work(released, events, [])
    assert adopted_work(q, released, ["shop/web-0"], []) == [Work(WorkKind.RELEASE, "shop/web-0")]
    # a quarantined row that is gone (its pod deleted): nothing to write to
    gone, _ = unregister(q, "shop/web-0", T0)
    assert adopted_work(q, gone, ["shop/web-0"], []) == []
    # an unchanged or merely re-registered row, and a workload that is not a pod: nothing
    assert adopted_work(before, before, ["shop/web-0", "shop/web-1"], []) == []
    local_q, _ = quarantine(before, "local-1", Trigger.OPERATOR, "x", T0)
    assert adopted_work(before, local_q, ["local-1"], []) == []


def test_the_reapply_releases_only_labelled_pods_whose_workload_is_no_longer_quarantined() -> None:
    state = registered()
    state, _ = quarantine(state, "shop/web-0", Trigger.OPERATOR, "compromised", T0)
    state, _ = quarantine(state, "local-1", Trigger.OPERATOR, "x", T0)
    state, _ = release(state, "local-1", T0)
    labelled = ["shop/web-1", "shop/web-0", "shop/gone-0", "local-1", "shop/web-1"]
    # web-0 is quarantined (kept); gone-0 is unknown (left alone); local-1 is not a pod
    assert stale_releases(state, labelled) == ["shop/web-1"]
    assert stale_releases(state, []) == []
