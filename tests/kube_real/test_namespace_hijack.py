"""Issue 8, item 1: service hijack across namespaces, attempted through the kube-mode control
plane against a real kube-apiserver 1.20.2 (moved here from tests/component, which ran it
against tests/fakekube).

Namespace ``<t>-shop`` has a Service ``web`` selecting its pods ``app=web`` and a caller
calling ``web``. Namespace ``<t>-evil`` has a pod labelled ``app=web``, carrying the old
``attestmesh.dev/service: web`` annotation, selected by its own Service ``web``, attested. A
mesh service is (namespace, name): the caller's ``web`` pins only shop's identity and routes
only to shop's pod; evil's pod serves (evil, web) only, reached by a caller that names
``web.<t>-evil``, and then only as far as evil's own mesh policy (its RBAC) allows. Pods, tokens
(TokenRequest bound to each pod), Services and policies are real objects of the server; each
test has namespaces of its own (the cluster is shared by the session).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.kube_real.plane import (
    GROUP_VERSION,
    Env,
    Plane,
    control_plane,
    injected_fixture_pod,
    namespace_doc,
    pinned,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
    snapshot_of,
)
from tests.kube_real.rest import Rest, until
from tests.unit.xds.test_xds_build import endpoints, principals
from xds.state import Status

pytestmark = pytest.mark.integration

TD = "attestmesh.local"
SHOP_IP, EVIL_IP, CALLER_IP = "10.4.0.5", "10.9.0.66", "10.4.0.7"


@dataclass(frozen=True)
class Names:
    shop: str
    evil: str

    @property
    def web(self) -> str:
        return f"{self.shop}/web-0"

    @property
    def caller(self) -> str:
        return f"{self.shop}/front-0"

    @property
    def look_alike(self) -> str:  # the same pod and service account name, another namespace
        return f"{self.evil}/web-0"

    def spiffe(self, ns: str, sa: str) -> str:
        return f"spiffe://{TD}/ns/{ns}/sa/{sa}"


def service(ns: str, name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"selector": selector, "ports": [{"port": 80, "targetPort": 8080}]},
    }


def mesh_policy(ns: str, name: str, dest_sa: str, *sources: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "MeshPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"destination": {"serviceAccount": dest_sa}, "rules": [{"from": list(sources)}]},
    }


def evil_pod(n: Names) -> dict[str, Any]:
    obj = injected_fixture_pod("web-0", ns=n.evil)
    obj["metadata"]["annotations"]["attestmesh.dev/service"] = "web"  # the old hijack
    obj["metadata"]["annotations"]["attestmesh.dev/outbound"] = "web=15001"  # its own (evil, web)
    return obj


def caller_pod(n: Names) -> dict[str, Any]:
    obj = injected_fixture_pod("front-0", ns=n.shop, sa="front")
    obj["metadata"]["labels"] = {"app": "front"}  # no Service selects it: it serves nothing
    outbound = f"web=15001,web.{n.evil}=15002"
    obj["metadata"]["annotations"]["attestmesh.dev/outbound"] = outbound
    return obj


async def attack(admin: Rest, n: Names, *extra: dict[str, Any]) -> dict[str, str]:
    """The cluster of the attack: shop (pod web-0, app=web, service account web) with its
    Service web and a caller; evil with its look-alike pod and its own Service web. Returns
    each pod's bound token."""
    docs: list[dict[str, Any]] = []
    for ns in (n.shop, n.evil):
        docs += [
            namespace_doc(ns),
            service_account_doc(ns, "web"),
            service_account_doc(ns, "front"),
        ]
    docs += [
        policy("web", n.shop, selector={"serviceAccounts": ["web", "front"]}),
        service(n.shop, "web", {"app": "web"}),
        mesh_policy(n.shop, "front-to-web", "web", {"serviceAccount": "front"}),
        mesh_policy(n.shop, "web-callers", "web", {"serviceAccount": "web"}),
        policy("web", n.evil),
        service(n.evil, "web", {"app": "web"}),
        *extra,
    ]
    for doc in docs:
        await asyncio.to_thread(admin.apply, doc)
    tokens = {}
    for workload, doc, ip in (
        (n.web, injected_fixture_pod("web-0", ns=n.shop), SHOP_IP),
        (n.caller, caller_pod(n), CALLER_IP),
        (n.look_alike, evil_pod(n), EVIL_IP),
    ):
        stored = await running_pod(admin, doc, ip)
        tokens[workload] = await asyncio.to_thread(pod_token, admin, stored)
    return tokens


async def attest_all(plane: Plane, n: Names, tokens: dict[str, str]) -> None:
    cp = plane.running.cp
    mine = (n.web, n.caller, n.look_alike)
    await until(lambda: all(w in cp.state.workloads for w in mine) or None, what="registered")
    await until(lambda: len([p for p in cp.policies if p.name.endswith("/web") and
                             p.name.split("/")[0] in (n.shop, n.evil)]) == 2 or None)  # fmt: skip
    async with aiohttp.ClientSession() as session:
        for workload in mine:
            await plane.agent(workload, tokens[workload]).attest_once(session)
    assert {w: cp.status_of(w) for w in mine} == dict.fromkeys(mine, Status.ATTESTED)


def members(plane: Plane, n: Names) -> dict[tuple[str, str], set[str]]:
    """The mesh-service index's members in this test's namespaces (the session's cluster holds
    other tests' pods)."""
    index = plane.running.publisher.index
    assert index is not None
    return {k: set(v) for k, v in index.members.items() if k[0] in (n.shop, n.evil)}


async def test_a_look_alike_in_another_namespace_gets_no_share_of_web(
    env: Env, tmp_path: Path
) -> None:
    admin, n = env.admin, Names("hj1-shop", "hj1-evil")
    shop_web, evil_web, shop_front = (
        n.spiffe(n.shop, "web"), n.spiffe(n.evil, "web"), n.spiffe(n.shop, "front"),
    )  # fmt: skip
    tokens = await attack(admin, n)
    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        await attest_all(plane, n, tokens)
        regs = {w: cp.state.get(w).registration for w in (n.web, n.caller, n.look_alike)}
        assert {w: (r.namespace, r.service) for w, r in regs.items()} == {
            n.web: (n.shop, "web"),
            n.caller: (n.shop, ""),  # labels name no Service in shop
            n.look_alike: (n.evil, "web"),  # its own namespace's Service, not shop's
        }
        await until(lambda: len(members(plane, n)) == 2 or None, what="index")
        assert members(plane, n) == {(n.shop, "web"): {n.web}, (n.evil, "web"): {n.look_alike}}
        index = plane.running.publisher.index
        assert index is not None
        callers = {k: set(v) for k, v in index.callers.items() if k[0] in (n.shop, n.evil)}
        # the caller's "web" means (shop, web); "web.<evil>" names evil explicitly; evil's own
        # "web" means (evil, web)
        assert callers == {(n.shop, "web"): {n.caller}, (n.evil, "web"): {n.caller, n.look_alike}}

        # what ADS serves the caller: "web" pins shop's identity only and routes to web-0 only
        snap = snapshot_of(plane, n.caller)
        assert pinned(snap, "out|web") == [shop_web]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        # named explicitly, evil's service: evil's identity, evil's endpoint, nothing of shop
        assert pinned(snap, f"out|web.{n.evil}") == [evil_web]
        assert endpoints(snap, f"out|web.{n.evil}") == [(EVIL_IP, 15006)]
        # the evil pod calling "web" reaches its own namespace's service, never shop's
        evil_snap = snapshot_of(plane, n.look_alike)
        assert pinned(evil_snap, "out|web") == [evil_web]
        assert endpoints(evil_snap, "out|web") == [(EVIL_IP, 15006)]

        # whether the explicit call is allowed is the destination's business: evil's RBAC
        # admits nobody until a mesh policy in evil names the caller; shop's never apply there
        assert principals(snapshot_of(plane, n.web)) == [shop_front, shop_web]
        assert principals(evil_snap) == []
        let_in = mesh_policy(n.evil, "let-shop-in", "web", {"serviceAccount": "front",
                             "namespace": n.shop})  # fmt: skip
        await asyncio.to_thread(admin.apply, let_in)
        await until(lambda: principals(snapshot_of(plane, n.look_alike)) == [shop_front] or None)
        assert principals(snapshot_of(plane, n.web)) == [shop_front, shop_web]  # shop unchanged

        # the attacker adds shop's other label and re-annotates naming shop explicitly: still
        # (evil, web), still nothing in the caller's "web"
        relabel = {"metadata": {"labels": {"app.kubernetes.io/name": "web"},
                                "annotations": {"attestmesh.dev/service": f"web.{n.shop}"}}}  # fmt: skip
        await asyncio.to_thread(admin.patch, "v1", "Pod", n.evil, "web-0", relabel)
        await until(
            lambda: (
                "app.kubernetes.io/name" in cp.state.get(n.look_alike).registration.labels or None
            )
        )
        moved = cp.state.get(n.look_alike).registration
        assert (moved.namespace, moved.service) == (n.evil, "web")
        snap = snapshot_of(plane, n.caller)
        assert pinned(snap, "out|web") == [shop_web]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]

        # evil's Service goes: with only its annotation (the original attack) and labels left,
        # its pod serves nothing at all; shop's "web" is untouched
        await asyncio.to_thread(admin.delete, "v1", "Service", n.evil, "web")
        await until(lambda: cp.state.get(n.look_alike).registration.service == "" or None)
        await until(
            lambda: endpoints(snapshot_of(plane, n.caller), f"out|web.{n.evil}") == [] or None
        )
        snap = snapshot_of(plane, n.caller)
        assert pinned(snap, f"out|web.{n.evil}") == [f"spiffe://{TD}/-/none"]
        assert pinned(snap, "out|web") == [shop_web]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        assert members(plane, n) == {(n.shop, "web"): {n.web}}


async def test_a_service_in_another_namespace_selecting_shops_labels_names_no_shop_pod(
    env: Env, tmp_path: Path
) -> None:
    """evil adds a Service selecting shop's pods' labels whose name sorts before shop's
    Service (it would win the lowest-name tie if namespaces were ignored): it selects nothing
    outside evil, and evil's own pod moves to it."""
    admin, n = env.admin, Names("hj2-shop", "hj2-evil")
    tokens = await attack(admin, n, service(n.evil, "aaa", {"app": "web"}))
    async with control_plane(env, tmp_path / "state") as plane:
        cp = plane.running.cp
        await attest_all(plane, n, tokens)
        assert cp.state.get(n.web).registration.service == "web"
        assert cp.state.get(n.look_alike).registration.service == "aaa"  # its namespace's lowest
        snap = snapshot_of(plane, n.caller)
        assert pinned(snap, "out|web") == [n.spiffe(n.shop, "web")]
        assert endpoints(snap, "out|web") == [(SHOP_IP, 15006)]
        assert endpoints(snap, f"out|web.{n.evil}") == []  # (evil, web) has no member now
