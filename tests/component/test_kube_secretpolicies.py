"""SecretPolicy resources in Kubernetes mode, through the real kubernetes client against the
fake API server: watched only when secret release is on, each CR parsed on its own (an invalid
one refused with every problem, Accepted=False, its previous version kept), changes handed over
whole, and the cross-policy rule (one secret, one policy) applied by SecretPolicies."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from typing import Any

import pytest

from attestmesh.controlplane.secrets import SecretPolicies
from tests.component.test_kube_adapter import Recorder, eventually, kc, running
from tests.fakekube import FakeKube
from tests.fakekube.server import ResourceType
from xds.kube import CONDITION_ACCEPTED, KubeSource, SourceCallbacks
from xds.secretpolicy import SecretPolicy

GROUP = "attestmesh.dev"
# served as the CRD in manifests/crds/secretpolicies.attestmesh.dev.yaml declares it
SECRETPOLICIES = ResourceType(
    GROUP, "v1alpha1", "secretpolicies", "SecretPolicy", True, True, False
)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_interval=0.1, extra_resources=(SECRETPOLICIES,)) as k:
        yield k


def secret_cr(name: str, secret: str = "db", ns: str = "shop", **rule: Any) -> dict[str, Any]:  # noqa: S107
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "SecretPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "secrets": [{"name": secret, "kv": {"mount": "secret", "path": f"shop/{secret}"}}],
            "rules": [{"from": [{"serviceAccount": "web"}], "secrets": [secret], **rule}],
        },
    }


def condition(kube: FakeKube, name: str) -> dict[str, Any] | None:
    obj = kube.get("secretpolicies", "shop", name, GROUP)
    assert obj is not None
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == CONDITION_ACCEPTED:
            return dict(c)
    return None


def callbacks(rec: Recorder, seen: list[list[SecretPolicy]]) -> SourceCallbacks:
    cb = rec.callbacks()

    async def on_secret_policies(p: list[SecretPolicy]) -> None:
        seen.append(p)

    cb.on_secret_policies = on_secret_policies
    return cb


async def test_secret_policies_are_watched_validated_and_handed_over(kube: FakeKube) -> None:
    await kube.put_object("secretpolicies", secret_cr("good"), GROUP)
    bad = secret_cr("bad", secret="cache", whenClaims={"tees": ["quantum"]})
    bad["spec"]["rules"][0]["secrets"].append("nope")
    await kube.put_object("secretpolicies", bad, GROUP)
    seen: list[list[SecretPolicy]] = []
    source = KubeSource(kc(kube), callbacks(Recorder(), seen), watch_timeout=2)
    async with running(source):
        await eventually(lambda: bool(seen) and [p.name for p in seen[-1]] == ["good"])
        await eventually(lambda: condition(kube, "bad") is not None)
        cond = condition(kube, "bad") or {}
        assert cond["status"] == "False"
        assert "quantum" in cond["message"] and "nope" in cond["message"]
        await eventually(lambda: (condition(kube, "good") or {}).get("status") == "True")

        # a change reaches the holder; an invalid edit keeps the previous version in force
        changed = secret_cr("good", whenClaims={"tees": ["tdx"]})
        await kube.put_object("secretpolicies", changed, GROUP)
        await eventually(lambda: seen[-1][0].rules[0].when_claims is not None)
        broken = copy.deepcopy(changed)
        broken["spec"]["secrets"] = []
        await kube.put_object("secretpolicies", broken, GROUP)
        await eventually(lambda: (condition(kube, "good") or {}).get("status") == "False")
        assert seen[-1][0].rules[0].when_claims is not None

        await kube.delete_object("secretpolicies", "shop", "good", GROUP)
        await eventually(lambda: seen[-1] == [])


async def test_a_cluster_without_the_crd_has_no_secret_policies() -> None:
    seen: list[list[SecretPolicy]] = []
    async with FakeKube(bookmark_interval=0.1) as bare:  # secretpolicies not served
        source = KubeSource(kc(bare), callbacks(Recorder(), seen), watch_timeout=2)
        async with running(source):
            await eventually(lambda: seen == [[]])


async def test_not_watched_when_secret_release_is_off(kube: FakeKube) -> None:
    await kube.put_object("secretpolicies", secret_cr("good"), GROUP)
    source = KubeSource(kc(kube), Recorder().callbacks(), watch_timeout=2)
    assert "secretpolicies" not in {w.spec.resource for w in source.watchers}
    async with running(source):
        pass
    assert condition(kube, "good") is None  # nobody touched it


def test_one_secret_one_policy_across_resources() -> None:
    from xds.secretpolicy import parse_secret_policies

    (a,) = parse_secret_policies([secret_cr("a")])
    (b,) = parse_secret_policies([secret_cr("b")])  # the same secret shop/db again
    (c,) = parse_secret_policies([secret_cr("c", secret="cache")])
    holder = SecretPolicies()
    kept = holder.set_policies([c, b, a])
    assert [p.name for p in kept] == ["a", "c"] and holder.current == kept
