"""SecretPolicy resources in Kubernetes mode against a real kube-apiserver 1.20.2 (moved here
from tests/component/test_kube_secretpolicies.py and test_kube_secret_release.py, which ran them
against tests/fakekube). The CRD of manifests/crds and the secrets component's RBAC
(manifests/secrets/rbac.yaml: list/watch SecretPolicies, patch their status) are installed for
this module and removed after it: watched only when secret release is on, each CR parsed on its
own (an invalid one refused, Accepted=False, its previous version kept), changes handed over
whole; and end to end, with a real OpenBao, the CR decides what an attested pod's agent gets."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from attestmesh.kube_mode import connect
from attestmesh.secret_release import SecretReleaseSettings
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.secrets import FanOut, SecretFetcher
from tests.bao_harness import start_bao
from tests.component.test_kube_adapter import Recorder, running
from tests.kube_real.cluster import free_port
from tests.kube_real.install import MANIFESTS
from tests.kube_real.plane import (
    GOOD,
    GROUP_VERSION,
    PLATFORM,
    Env,
    control_plane,
    injected_fixture_pod,
    namespace_doc,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
)
from tests.kube_real.rest import Rest, load_docs, until, wait_for
from xds.kube import CONDITION_ACCEPTED, KubeSource, SourceCallbacks
from xds.secretpolicy import SecretPolicy

pytestmark = pytest.mark.integration

CRD = MANIFESTS / "crds" / "secretpolicies.attestmesh.dev.yaml"
RBAC = MANIFESTS / "secrets" / "rbac.yaml"
CRD_NAME = "secretpolicies.attestmesh.dev"


@pytest.fixture(scope="module")
def secrets_rbac(env: Env) -> Iterator[None]:
    """The secrets component's RBAC (it grants SecretPolicies whether the CRD exists or not)."""
    docs = load_docs([RBAC])
    for doc in docs:
        env.admin.apply(doc)
    try:
        yield
    finally:
        for doc in reversed(docs):
            env.admin.delete(doc["apiVersion"], doc["kind"], None, doc["metadata"]["name"])


@pytest.fixture(scope="module")
def secret_crd(env: Env, secrets_rbac: None) -> Iterator[None]:
    admin = env.admin
    docs = load_docs([CRD])
    for doc in docs:
        admin.apply(doc)

    def established() -> bool:
        obj = admin.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, CRD_NAME)
        conds = {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}
        return conds.get("Established") == "True"

    wait_for(established, 30, "SecretPolicy CRD established")

    def served() -> bool:
        # Established is not yet served everywhere: discovery and the resource's handler
        # follow a moment later
        admin.forget_discovery()
        admin.items(GROUP_VERSION, "SecretPolicy")
        return True

    wait_for(served, 30, "SecretPolicies served")
    try:
        yield
    finally:
        for doc in reversed(docs):
            admin.delete(doc["apiVersion"], doc["kind"], None, doc["metadata"]["name"])
        admin.forget_discovery()


def secret_cr(name: str, ns: str, secret: str = "db", **rule: Any) -> dict[str, Any]:  # noqa: S107
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "SecretPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "secrets": [{"name": secret, "kv": {"mount": "secret", "path": f"{ns}/{secret}"}}],
            "rules": [{"from": [{"serviceAccount": "web"}], "secrets": [secret], **rule}],
        },
    }


def condition(admin: Rest, ns: str, name: str) -> dict[str, Any] | None:
    obj = admin.get(GROUP_VERSION, "SecretPolicy", ns, name)
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


def own_namespace(admin: Rest, ns: str) -> None:
    admin.apply(namespace_doc(ns))
    admin.apply(service_account_doc(ns, "web"))


async def test_a_cluster_without_the_crd_has_no_secret_policies(
    env: Env, secrets_rbac: None
) -> None:
    # (runs before this module installs the CRD)
    assert await asyncio.to_thread(
        env.admin.get_or_none, "apiextensions.k8s.io/v1", "CustomResourceDefinition", None,
        CRD_NAME,
    ) is None  # fmt: skip
    seen: list[list[SecretPolicy]] = []
    source = KubeSource(connect(env.kubeconfig, 10), callbacks(Recorder(), seen), watch_timeout=30)
    async with running(source):
        await until(lambda: seen == [[]] or None, what="no secret policies")


async def test_secret_policies_are_watched_validated_and_handed_over(
    env: Env, secret_crd: None
) -> None:
    """The invalid edits are ones only the CRD's CEL rules forbid (a rule naming a secret the
    policy does not declare): 1.20 drops the rules and stores them, the parser refuses them."""
    admin, ns = env.admin, "sp-watch"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, secret_cr("good", ns))
    bad = secret_cr("bad", ns, secret="cache")
    bad["spec"]["rules"][0]["secrets"].append("nope")
    await asyncio.to_thread(admin.apply, bad)
    seen: list[list[SecretPolicy]] = []
    source = KubeSource(connect(env.kubeconfig, 10), callbacks(Recorder(), seen), watch_timeout=30)

    def mine() -> list[SecretPolicy]:
        return [p for p in seen[-1] if p.namespace == ns] if seen else []

    async with running(source):
        await until(lambda: [p.name for p in mine()] == ["good"] or None)
        cond = await until(lambda: condition(admin, ns, "bad"), what="bad's condition")
        assert cond["status"] == "False" and "nope" in cond["message"]
        await until(lambda: (condition(admin, ns, "good") or {}).get("status") == "True" or None)

        # a change reaches the holder; an invalid edit keeps the previous version in force
        changed = secret_cr("good", ns, whenClaims={"tees": ["tdx"]})
        await asyncio.to_thread(admin.apply, changed)
        await until(lambda: (mine() and mine()[0].rules[0].when_claims is not None) or None)
        broken = copy.deepcopy(changed)
        broken["spec"]["rules"][0]["secrets"].append("missing")
        await asyncio.to_thread(admin.apply, broken)
        await until(lambda: (condition(admin, ns, "good") or {}).get("status") == "False" or None)
        assert mine()[0].rules[0].when_claims is not None

        await asyncio.to_thread(admin.delete, GROUP_VERSION, "SecretPolicy", ns, "good")
        await until(lambda: mine() == [] or None)


async def test_not_watched_when_secret_release_is_off(env: Env, secret_crd: None) -> None:
    admin, ns = env.admin, "sp-off"
    await asyncio.to_thread(own_namespace, admin, ns)
    await asyncio.to_thread(admin.apply, secret_cr("good", ns))
    source = KubeSource(connect(env.kubeconfig, 10), Recorder().callbacks(), watch_timeout=30)
    assert "secretpolicies" not in {w.spec.resource for w in source.watchers}
    async with running(source):
        pass
    assert await asyncio.to_thread(condition, admin, ns, "good") is None  # nobody touched it


class Sink:
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        pass


async def test_secret_policy_resources_decide_release_in_kubernetes_mode(
    env: Env, secret_crd: None, tmp_path: Path
) -> None:
    """The control plane with secret release on (``--openbao-url``, no policy file) against a
    real OpenBao: the injected pod's agent, attested with its pod-bound token, gets the secret
    sealed to its key; deleting the CR stops the release at once."""
    admin, ns = env.admin, "sp-release"
    await asyncio.to_thread(own_namespace, admin, ns)
    for doc in (policy("web", ns), secret_cr("db", ns)):
        await asyncio.to_thread(admin.apply, doc)
    bao = await start_bao(tmp_path / "bao")
    try:
        await bao.kv_put(f"{ns}/db", {"password": "pw-kube"})
        (tmp_path / "tok").write_text(bao.root_token)
        secrets = SecretReleaseSettings(
            policy_file=None, openbao_url=bao.url, port=free_port(), token_file=tmp_path / "tok"
        )
        async with control_plane(env, tmp_path / "state", secrets=secrets) as plane:
            cp, workload = plane.running.cp, f"{ns}/web-0"
            stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.7.0.5")
            await until(lambda: cp.state.workloads.get(workload), what="registered")
            await until(lambda: [p for p in cp.policies if p.name == f"{ns}/web"] or None)
            token = await asyncio.to_thread(pod_token, admin, stored)
            fetcher = SecretFetcher(
                url=f"https://127.0.0.1:{secrets.port}",
                workload=workload,
                secrets=["db"],
                bundle_pem=plane.running.bundle_pem,
                directory=tmp_path / "secrets",
                tls_dir=tmp_path / "tls",
            )
            agent = Agent(
                url=plane.url,
                workload=workload,
                source=SimEvidenceSource(PLATFORM, GOOD),
                sink=FanOut(Sink(), fetcher),
                ssl_context=client_ssl_context(plane.running.bundle_pem),
                token=lambda: token,
            )
            async with aiohttp.ClientSession() as session:
                await agent.attest_once(session)
                async with asyncio.timeout(20):  # the CR reaches the holder
                    while "db" not in fetcher.held:
                        await fetcher.fetch_all(session)
                        await asyncio.sleep(0.05)
                assert (tmp_path / "secrets" / "db" / "password").read_text() == "pw-kube"
                await asyncio.to_thread(admin.delete, GROUP_VERSION, "SecretPolicy", ns, "db")
                async with asyncio.timeout(20):
                    while "db" in fetcher.held:
                        await fetcher.fetch_all(session)
                        await asyncio.sleep(0.05)
            assert fetcher.last_error["db"].reason == "not_allowed"
            assert not (tmp_path / "secrets" / "db").exists()
    finally:
        bao.stop()
