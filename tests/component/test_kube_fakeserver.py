"""The fake API server speaks the protocol the real kubernetes client expects, for the slice
the remaining fake-server tests use (tests/fakekube/server.py says which and why)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from tests.fakekube import FakeKube


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as k:
        yield k


def core(k: FakeKube) -> client.CoreV1Api:
    return client.CoreV1Api(client.ApiClient(k.configuration()))


def pod_body(name: str, ns: str = "shop", **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {"app": "web"}},
        "spec": {"containers": [{"name": "app", "image": "web:1"}]},
    }


async def test_create_get_list_with_resource_versions(kube: FakeKube) -> None:
    api = core(kube)
    created = await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    assert created.metadata.uid and created.metadata.creation_timestamp is not None
    rv_a = int(created.metadata.resource_version)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("b", app="db"))
    await asyncio.to_thread(api.create_namespaced_pod, "other", pod_body("c", "other"))
    got = await asyncio.to_thread(api.read_namespaced_pod, "a", "shop")
    assert got.spec.containers[0].image == "web:1"
    listed = await asyncio.to_thread(api.list_namespaced_pod, "shop")
    assert [p.metadata.name for p in listed.items] == ["a", "b"]
    assert int(listed.metadata.resource_version) == rv_a + 2
    selected = await asyncio.to_thread(
        api.list_pod_for_all_namespaces, label_selector="app in (web)"
    )
    assert sorted(p.metadata.name for p in selected.items) == ["a", "c"]
    by_field = await asyncio.to_thread(
        api.list_pod_for_all_namespaces, field_selector="metadata.namespace=other"
    )
    assert [p.metadata.name for p in by_field.items] == ["c"]
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    assert exc.value.status == 409 and "AlreadyExists" in str(exc.value.body)
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.read_namespaced_pod, "zzz", "shop")
    assert exc.value.status == 404


async def test_generate_name(kube: FakeKube) -> None:
    body = pod_body("x")
    del body["metadata"]["name"]
    body["metadata"]["generateName"] = "web-"
    created = await asyncio.to_thread(core(kube).create_namespaced_pod, "shop", body)
    assert created.metadata.name.startswith("web-") and len(created.metadata.name) == 9


async def test_json_patch_and_merge_patch(kube: FakeKube) -> None:
    api = core(kube)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    ops = [{"op": "add", "path": "/metadata/labels/x~1y", "value": "z"}]
    patched = await asyncio.to_thread(api.patch_namespaced_pod, "a", "shop", ops)
    assert patched.metadata.labels["x/y"] == "z"
    assert kube.requests[-1][2] == "application/json-patch+json"
    merged = await asyncio.to_thread(
        api.patch_namespaced_pod,
        "a",
        "shop",
        {"metadata": {"labels": {"m": "1"}}},
        _content_type="application/merge-patch+json",
    )
    assert merged.metadata.labels["m"] == "1"


async def test_update_conflict_on_stale_resource_version(kube: FakeKube) -> None:
    api = core(kube)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    first = await asyncio.to_thread(api.read_namespaced_pod, "a", "shop")
    first.metadata.labels["v"] = "1"
    await asyncio.to_thread(api.replace_namespaced_pod, "a", "shop", first)
    first.metadata.labels["v"] = "2"  # still carries the old resourceVersion
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.replace_namespaced_pod, "a", "shop", first)
    assert exc.value.status == 409


async def test_core_events_and_only_json_and_merge_patches(kube: FakeKube) -> None:
    api = core(kube)
    ev = client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="a.", namespace="shop"),
        involved_object=client.V1ObjectReference(kind="Pod", name="a", namespace="shop"),
        reason="Quarantined",
        message="m",
        type="Warning",
    )
    await asyncio.to_thread(api.create_namespaced_event, "shop", ev)
    listed = await asyncio.to_thread(api.list_namespaced_event, "shop")
    assert [e.reason for e in listed.items] == ["Quarantined"]
    # what no remaining fake-server test needs is not served: events.k8s.io, strategic merge
    # patch (the client's default for built-in kinds), evictions
    events_v1 = client.EventsV1Api(client.ApiClient(kube.configuration()))
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(events_v1.list_namespaced_event, "shop")
    assert exc.value.status == 404
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(
            api.patch_namespaced_pod, "a", "shop", {"metadata": {"labels": {"q": "1"}}}
        )
    assert exc.value.status == 415
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name="a", namespace="shop"))
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.create_namespaced_pod_eviction, "a", "shop", body)
    assert exc.value.status == 404


async def test_leases_conflict(kube: FakeKube) -> None:
    co = client.CoordinationV1Api(client.ApiClient(kube.configuration()))
    lease = client.V1Lease(
        metadata=client.V1ObjectMeta(name="cp", namespace="attestmesh-system"),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15),
    )
    created = await asyncio.to_thread(co.create_namespaced_lease, "attestmesh-system", lease)
    created.spec.holder_identity = "b"
    await asyncio.to_thread(co.replace_namespaced_lease, "cp", "attestmesh-system", created)
    created.spec.holder_identity = "c"
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(co.replace_namespaced_lease, "cp", "attestmesh-system", created)
    assert exc.value.status == 409
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(co.create_namespaced_lease, "attestmesh-system", lease)
    assert exc.value.status == 409


async def test_token_review(kube: FakeKube) -> None:
    kube.add_token("tok-1", "shop", "web")
    auth = client.AuthenticationV1Api(client.ApiClient(kube.configuration()))

    def review(token: str, audiences: list[str]) -> Any:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=audiences))
        return auth.create_token_review(body)

    ok = await asyncio.to_thread(review, "tok-1", ["attestmesh"])
    assert ok.status.authenticated is True
    assert ok.status.user.username == "system:serviceaccount:shop:web"
    assert ok.status.audiences == ["attestmesh"]
    wrong_aud = await asyncio.to_thread(review, "tok-1", ["vault"])
    assert not wrong_aud.status.authenticated and "audiences" in wrong_aud.status.error
    unknown = await asyncio.to_thread(review, "nope", ["attestmesh"])
    assert not unknown.status.authenticated and unknown.status.error


async def test_custom_resources_status_and_generation(kube: FakeKube) -> None:
    co = client.CustomObjectsApi(client.ApiClient(kube.configuration()))
    body = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "MeshPolicy",
        "metadata": {"name": "p"},
        "spec": {"mode": "enforce"},
        "status": {"ignored": True},
    }
    args = ("attestmesh.dev", "v1alpha1", "shop", "meshpolicies")
    created = await asyncio.to_thread(co.create_namespaced_custom_object, *args, body)
    assert created["metadata"]["generation"] == 1 and "status" not in created
    st = {"status": {"conditions": [{"type": "Accepted", "status": "True"}]}}
    after = await asyncio.to_thread(co.patch_namespaced_custom_object_status, *args, "p", st)
    assert after["metadata"]["generation"] == 1
    assert after["status"]["conditions"][0]["type"] == "Accepted"
    spec = {"spec": {"mode": "audit"}}
    changed = await asyncio.to_thread(co.patch_namespaced_custom_object, *args, "p", spec)
    assert changed["metadata"]["generation"] == 2 and changed["status"] == after["status"]
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(
            co.patch_namespaced_custom_object,
            *args,
            "p",
            spec,
            _content_type="application/strategic-merge-patch+json",
        )
    assert exc.value.status == 415
    all_ns = await asyncio.to_thread(
        co.list_cluster_custom_object, "attestmesh.dev", "v1alpha1", "meshpolicies"
    )
    assert [i["metadata"]["name"] for i in all_ns["items"]] == ["p"]


def _collect(
    kube: FakeKube, rv: str | None, n: int, events: list[dict[str, Any]], stop: threading.Event
) -> None:
    api = core(kube)
    w = watch.Watch()
    kwargs: dict[str, Any] = {"timeout_seconds": 5, "allow_watch_bookmarks": True}
    if rv is not None:
        kwargs["resource_version"] = rv
    try:
        for ev in w.stream(api.list_namespaced_pod, "shop", **kwargs):
            if ev["type"] != "BOOKMARK":
                events.append(ev)
            if len(events) >= n or stop.is_set():
                w.stop()
    except ApiException as exc:
        events.append({"type": "EXC", "status": exc.status})


async def test_watch_from_resource_version_streams_changes(kube: FakeKube) -> None:
    api = core(kube)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    listed = await asyncio.to_thread(api.list_namespaced_pod, "shop")
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    task = asyncio.create_task(
        asyncio.to_thread(_collect, kube, listed.metadata.resource_version, 3, events, stop)
    )
    await asyncio.sleep(0.1)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("b"))
    await asyncio.to_thread(
        api.patch_namespaced_pod,
        "b",
        "shop",
        {"metadata": {"labels": {"x": "y"}}},
        _content_type="application/merge-patch+json",
    )
    await asyncio.to_thread(api.delete_namespaced_pod, "a", "shop")
    await asyncio.wait_for(task, 5)
    assert [(e["type"], e["object"].metadata.name) for e in events] == [
        ("ADDED", "b"),
        ("MODIFIED", "b"),
        ("DELETED", "a"),
    ]


async def test_watch_without_resource_version_starts_with_synthetic_adds(kube: FakeKube) -> None:
    api = core(kube)
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    events: list[dict[str, Any]] = []
    await asyncio.wait_for(asyncio.to_thread(_collect, kube, None, 1, events, threading.Event()), 5)
    assert events[0]["type"] == "ADDED" and events[0]["object"].metadata.name == "a"


async def test_watch_too_old_resource_version_is_410(kube: FakeKube) -> None:
    api = core(kube)
    created = await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))
    await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("b"))
    kube.compact()
    events: list[dict[str, Any]] = []
    rv = created.metadata.resource_version
    await asyncio.wait_for(asyncio.to_thread(_collect, kube, rv, 1, events, threading.Event()), 5)
    assert events == [{"type": "EXC", "status": 410}]


async def test_bookmarks(kube: FakeKube) -> None:
    api = core(kube)
    created = await asyncio.to_thread(api.create_namespaced_pod, "shop", pod_body("a"))

    def first_bookmark() -> dict[str, Any]:
        w = watch.Watch()
        for ev in w.stream(
            api.list_namespaced_pod,
            "shop",
            resource_version=created.metadata.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=5,
        ):
            if ev["type"] == "BOOKMARK":
                w.stop()
                return dict(ev["raw_object"])
        raise AssertionError("no bookmark")

    bm = await asyncio.wait_for(asyncio.to_thread(first_bookmark), 5)
    assert bm["metadata"]["resourceVersion"] == created.metadata.resource_version


async def test_injected_failures_and_unknown_paths(kube: FakeKube) -> None:
    api = core(kube)
    kube.fail("GET", "/api/v1/namespaces/shop/pods", 500)
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.list_namespaced_pod, "shop")
    assert exc.value.status == 500
    listed = await asyncio.to_thread(api.list_namespaced_pod, "shop")
    assert listed.items == []
    with pytest.raises(ApiException) as exc:
        await asyncio.to_thread(api.list_namespaced_config_map, "shop")
    assert exc.value.status == 404
