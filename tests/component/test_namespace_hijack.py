"""Issue 8, item 1: service hijack across namespaces, attempted through the real kube-mode
control plane against the fake API server.

Namespace ``shop`` has a Service ``web`` selecting its pods ``app=web`` and a caller calling
``web``. Namespace ``evil`` has a pod labelled ``app=web``, carrying the old
``attestmesh.dev/service: web`` annotation, selected by its own Service ``web``, attested. A mesh
service is (namespace, name): the caller's ``web`` pins only shop's identity and routes only to
shop's pod; evil's pod serves (evil, web) only, reached by a caller that names ``web.evil``, and
then only as far as evil's own mesh policy (its RBAC) allows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization

from tests.component.test_kube_mode import (
    GROUP,
    PLATFORM,
    WEB_TOKEN,
    WEBHOOKS,
    WORKLOAD,
    Plane,
    control_plane,
    eventually,
    pinned,
    pod_obj,
    policy_cr,
    seed,
    snapshot_of,
)
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS
from tests.unit.xds.test_xds_build import endpoints, principals
from xds.state import Status

TD = "attestmesh.local"
SHOP_WEB = f"spiffe://{TD}/ns/shop/sa/web"
EVIL_WEB = f"spiffe://{TD}/ns/evil/sa/web"
SHOP_FRONT = f"spiffe://{TD}/ns/shop/sa/front"
CALLER = "shop/front-0"
EVIL = "evil/web-0"  # the same pod name and service account name as shop's, another namespace
SHOP_IP, EVIL_IP, CALLER_IP = "10.1.0.5", "10.9.0.66", "10.1.0.7"


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_interval=0.1, extra_resources=(WEBHOOKS, CONFIGMAPS)) as k:
        yield k


@pytest.fixture(scope="module")
def sim_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "platform.pem"
    path.write_bytes(
        PLATFORM.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


def service(ns: str, name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": selector, "ports": [{"port": 80, "targetPort": 8080}]},
    }


def mesh_policy(ns: str, name: str, dest_sa: str, *sources: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "MeshPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"destination": {"serviceAccount": dest_sa}, "rules": [{"from": list(sources)}]},
    }


def evil_pod() -> dict[str, Any]:
    obj = pod_obj("web-0", EVIL_IP)
    obj["metadata"]["namespace"] = "evil"
    obj["metadata"]["annotations"]["attestmesh.dev/service"] = "web"  # the old hijack
    obj["metadata"]["annotations"]["attestmesh.dev/outbound"] = "web=15001"  # its own (evil, web)
    return obj


def caller_pod() -> dict[str, Any]:
    obj = pod_obj("front-0", CALLER_IP)
    obj["metadata"]["labels"] = {"app": "front"}  # no Service selects it: it serves nothing
    obj["spec"]["serviceAccountName"] = "front"
    obj["metadata"]["annotations"]["attestmesh.dev/outbound"] = "web=15001,web.evil=15002"
    return obj


async def attack(kube: FakeKube) -> None:
    """The cluster of the attack: shop (seeded: pod web-0, app=web, service account web) with
    its Service web and a caller; evil with its look-alike pod and its own Service web."""
    shop_policy = policy_cr("web", selector={"serviceAccounts": ["web", "front"]})
    await seed(kube, shop_policy)
    await kube.put_object("services", service("shop", "web", {"app": "web"}))
    await kube.put_object("meshpolicies", mesh_policy("shop", "front-to-web", "web", {
        "serviceAccount": "front"}), GROUP)  # fmt: skip
    await kube.put_object("pods", caller_pod())
    kube.add_token("tok-front", "shop", "front", pod="front-0")

    await kube.put_object("namespaces", {"metadata": {"name": "evil"}})
    evil_policy = policy_cr("web")
    evil_policy["metadata"]["namespace"] = "evil"
    await kube.put_object("attestationpolicies", evil_policy, GROUP)
    await kube.put_object("services", service("evil", "web", {"app": "web"}))
    await kube.put_object("pods", evil_pod())
    kube.add_token("tok-evil", "evil", "web", pod="web-0")


async def attest_all(plane: Plane) -> None:
    async with aiohttp.ClientSession() as session:
        for token, workload in ((WEB_TOKEN, WORKLOAD), ("tok-front", CALLER), ("tok-evil", EVIL)):
            await plane.agent(token=token, workload=workload).attest_once(session)
    cp = plane.running.cp
    assert {n: cp.status_of(n) for n in (WORKLOAD, CALLER, EVIL)} == dict.fromkeys(
        (WORKLOAD, CALLER, EVIL), Status.ATTESTED
    )


async def test_a_look_alike_in_another_namespace_gets_no_share_of_web(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await attack(kube)
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        regs = {n: cp.state.get(n).registration for n in (WORKLOAD, CALLER, EVIL)}
        assert {n: (r.namespace, r.service) for n, r in regs.items()} == {
            WORKLOAD: ("shop", "web"),
            CALLER: ("shop", ""),  # labels name no Service in shop
            EVIL: ("evil", "web"),  # its own namespace's Service, not shop's
        }
        await attest_all(plane)
        index = plane.running.publisher.index
        assert index is not None
        assert index.members == {("shop", "web"): {WORKLOAD}, ("evil", "web"): {EVIL}}
        # the caller's "web" means (shop, web); "web.evil" names evil explicitly; evil's own
        # "web" means (evil, web)
        assert index.callers == {("shop", "web"): {CALLER}, ("evil", "web"): {CALLER, EVIL}}

        # what ADS serves the caller: "web" pins shop's identity only and routes to web-0 only
        snap = snapshot_of(plane, CALLER)
        assert pinned(snap, "out|web") == [SHOP_WEB]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        # named explicitly, evil's service: evil's identity, evil's endpoint, nothing of shop
        assert pinned(snap, "out|web.evil") == [EVIL_WEB]
        assert endpoints(snap, "out|web.evil") == [(EVIL_IP, 15006)]
        # the evil pod calling "web" reaches its own namespace's service, never shop's
        evil_snap = snapshot_of(plane, EVIL)
        assert pinned(evil_snap, "out|web") == [EVIL_WEB]
        assert endpoints(evil_snap, "out|web") == [(EVIL_IP, 15006)]

        # whether the explicit call is allowed is the destination's business: evil's RBAC admits
        # nobody until a mesh policy in evil names the caller; shop's policies never apply there
        assert principals(snapshot_of(plane, WORKLOAD)) == [SHOP_FRONT, SHOP_WEB]
        assert principals(evil_snap) == []
        await kube.put_object("meshpolicies", mesh_policy("evil", "let-shop-in", "web", {
            "serviceAccount": "front", "namespace": "shop"}), GROUP)  # fmt: skip
        await eventually(lambda: principals(snapshot_of(plane, EVIL)) == [SHOP_FRONT])
        assert principals(snapshot_of(plane, WORKLOAD)) == [SHOP_FRONT, SHOP_WEB]  # shop unchanged

        # the attacker adds shop's other label and re-annotates naming shop explicitly: still
        # (evil, web), still nothing in the caller's "web"
        renamed = evil_pod()
        renamed["metadata"]["labels"]["app.kubernetes.io/name"] = "web"
        renamed["metadata"]["annotations"]["attestmesh.dev/service"] = "web.shop"
        await kube.put_object("pods", renamed)
        await eventually(lambda: "app.kubernetes.io/name" in cp.state.get(EVIL).registration.labels)
        moved = cp.state.get(EVIL).registration
        assert (moved.namespace, moved.service) == ("evil", "web")
        snap = snapshot_of(plane, CALLER)
        assert pinned(snap, "out|web") == [SHOP_WEB]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]

        # evil's Service goes: with only its annotation (the original attack) and labels left,
        # its pod serves nothing at all; shop's "web" is untouched
        await kube.delete_object("services", "evil", "web")
        await eventually(lambda: cp.state.get(EVIL).registration.service == "")
        await eventually(lambda: endpoints(snapshot_of(plane, CALLER), "out|web.evil") == [])
        snap = snapshot_of(plane, CALLER)
        assert pinned(snap, "out|web.evil") == [f"spiffe://{TD}/-/none"]
        assert pinned(snap, "out|web") == [SHOP_WEB]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        index = plane.running.publisher.index
        assert index is not None and index.members == {("shop", "web"): {WORKLOAD}}


async def test_a_service_in_another_namespace_selecting_shops_labels_names_no_shop_pod(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    """evil adds a Service selecting shop's pods' labels whose name sorts before shop's
    Service (it would win the lowest-name tie if namespaces were ignored): it selects nothing
    outside evil, and evil's own pod moves to it."""
    await attack(kube)
    await kube.put_object("services", service("evil", "aaa", {"app": "web"}))
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        assert cp.state.get(WORKLOAD).registration.service == "web"
        assert cp.state.get(EVIL).registration.service == "aaa"  # its own namespace's lowest
        await attest_all(plane)
        snap = snapshot_of(plane, CALLER)
        assert pinned(snap, "out|web") == [SHOP_WEB]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        assert endpoints(snap, "out|web.evil") == []  # (evil, web) has no member now
