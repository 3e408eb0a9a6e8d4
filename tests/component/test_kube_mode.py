"""``attestmesh controlplane --kubernetes`` end to end, in process, against the fake API server
with the real ``kubernetes`` client: pods become registrations, agents attest with their
service-account token, quarantine becomes pod label + condition + Event, invalid policy
resources are refused, and a restart re-applies idempotently. (Quarantine-and-evict, audit
mode, the node watch and leader-only actions run against a real API server:
tests/kube_real/test_kube_mode_actions.py.)"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from kubernetes import client

from attestmesh.cli import _check_mode, build_parser
from attestmesh.cli import main as cli_main
from attestmesh.demo import free_port as free_port  # one port picker (see there)
from attestmesh.kube_mode import KubeMode, KubeSettings, Work, WorkKind, build_work
from attestmesh.metrics import Metrics
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from certs.policy import parse_policies
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context
from sidecar.inject import (
    AGENT_CONTAINER,
    BOOTSTRAP_CONTAINER,
    TRUST_BUNDLE,
    InjectConfig,
    SimInjection,
    decode_patch,
)
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS, ResourceType
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.xds.test_xds_build import decoded, endpoints
from xds.build import Snapshot
from xds.kube import (
    CONDITION_ACCEPTED,
    CONDITION_ATTESTED,
    LABEL_QUARANTINED,
    KubeClient,
)
from xds.resources import TypeUrl
from xds.state import Endpoint, Event, EventKind, MeshState, Registration, Status, Trigger, register

GOOD = bytes.fromhex("a1" * 48)
BAD = bytes.fromhex("b2" * 48)
PLATFORM = ec.generate_private_key(ec.SECP256R1())
WEBHOOKS = ResourceType(
    "admissionregistration.k8s.io",
    "v1",
    "mutatingwebhookconfigurations",
    "MutatingWebhookConfiguration",
    False,
)
GROUP = "attestmesh.dev"
WEB_TOKEN = "tok-web"  # web-0's projected token (bound to the pod) the fake TokenReview knows
WORKLOAD = "shop/web-0"
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def policy_cr(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "selector": {"serviceAccounts": ["web"]},
        "allowedTees": ["sim"],
        "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
    }
    base.update(spec)
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": base,
    }


MESH_POLICY = {
    "apiVersion": "attestmesh.dev/v1alpha1",
    "kind": "MeshPolicy",
    "metadata": {"name": "web-callers", "namespace": "shop"},
    "spec": {
        "destination": {"serviceAccount": "web"},
        "rules": [{"from": [{"serviceAccount": "web"}]}],
    },
}


def pod_obj(name: str = "web-0", ip: str = "10.1.0.5") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "labels": {"app": "web"},
            "annotations": {
                "attestmesh.dev/injected": "true",
                "attestmesh.dev/inbound-port": "15006",
                "attestmesh.dev/app-port": "8080",
            },
        },
        "spec": {
            "serviceAccountName": "web",
            "nodeName": "n1",
            "containers": [{"name": "app", "image": "web:1"}],
        },
        "status": {"phase": "Running", "podIP": ip},
    }


async def eventually(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5.0):
        while not check():
            await asyncio.sleep(0.02)


async def seed(kube: FakeKube, *policies: dict[str, Any]) -> None:
    await kube.put_object(
        "namespaces",
        {"metadata": {"name": "shop", "labels": {"attestmesh.dev/inject": "enabled"}}},
    )
    await kube.put_object("nodes", {"metadata": {"name": "n1"}, "spec": {}})
    for p in policies:
        await kube.put_object("attestationpolicies", p, GROUP)
    await kube.put_object("meshpolicies", MESH_POLICY, GROUP)
    await kube.put_object("pods", pod_obj())
    await kube.put_object(
        "mutatingwebhookconfigurations",
        {
            "metadata": {"name": "attestmesh-sidecar-injector"},
            "webhooks": [
                {
                    "name": "inject.attestmesh.dev",
                    "admissionReviewVersions": ["v1"],
                    "sideEffects": "None",
                    "clientConfig": {
                        "service": {"name": "attestmesh-controlplane", "namespace": "x"}
                    },
                }
            ],
        },
        WEBHOOKS.group,
    )
    kube.add_token(WEB_TOKEN, "shop", "web", pod="web-0")
    kube.add_token("tok-other", "shop", "other")


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


@dataclass
class Plane:
    running: Running
    mode: KubeMode
    settings: ControlPlaneSettings

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.settings.api_port}"

    def agent(
        self,
        token: str = WEB_TOKEN,
        source: SimEvidenceSource | None = None,
        workload: str = WORKLOAD,
    ) -> Agent:
        class Sink:
            def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
                pass

        return Agent(
            url=self.url,
            workload=workload,
            source=source or SimEvidenceSource(PLATFORM, GOOD),
            sink=Sink(),
            ssl_context=client_ssl_context(self.running.bundle_pem),
            token=lambda: token,
        )


@contextlib.asynccontextmanager
async def control_plane(
    kube: FakeKube, state_dir: Path, sim_key: Path, identity: str = "cp-0"
) -> AsyncIterator[Plane]:
    settings = ControlPlaneSettings(
        state_dir=state_dir,
        sim_platform_keys=(sim_key,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
        deadline_check=timedelta(seconds=1),
    )
    metrics = Metrics()
    kc = KubeClient(client.ApiClient(kube.configuration()), request_timeout=5)
    mode = KubeMode(
        kc,
        KubeSettings(
            identity=identity,
            webhook_host="127.0.0.1",
            webhook_port=free_port(),
            webhook_configuration="attestmesh-sidecar-injector",
            probe_host="127.0.0.1",
            probe_port=free_port(),
            retry_period=timedelta(seconds=0.5),
            watch_timeout=5,
            inject=InjectConfig(sim=SimInjection(GOOD.hex())),  # a test cluster
        ),
        metrics,
        state_dir=state_dir,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_control_plane(settings, stop, ready, metrics=metrics, hooks=mode.hooks())
    )
    try:
        running = await asyncio.wait_for(ready, 10)
        await asyncio.wait_for(mode.synced.wait(), 5)
        yield Plane(running, mode, settings)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def pod(kube: FakeKube, name: str = "web-0") -> dict[str, Any]:
    obj = kube.get("pods", "shop", name)
    assert obj is not None
    return obj


def attested_conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in obj["status"].get("conditions", []) if c["type"] == CONDITION_ATTESTED]


def events(kube: FakeKube, reason: str) -> list[dict[str, Any]]:
    return [e for e in kube.list("events", "shop") if e["reason"] == reason]


def accepted(kube: FakeKube, name: str) -> dict[str, Any]:
    obj = kube.get("attestationpolicies", "shop", name, GROUP) or {}
    conds = (obj.get("status") or {}).get("conditions") or []
    return next((c for c in conds if c["type"] == CONDITION_ACCEPTED), {})


async def test_pod_attests_with_its_service_account_token(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await seed(kube, policy_cr("web"))
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        reg = cp.state.get(WORKLOAD).registration
        assert (reg.namespace, reg.service_account, reg.app_port) == ("shop", "web", 8080)
        assert (reg.inbound.address, reg.inbound.port) == ("10.1.0.5", 15006)
        assert [p.name for p in cp.mesh_policies] == ["web-callers"]
        assert plane.mode.elector.is_leader

        async with aiohttp.ClientSession() as session:
            cert = await plane.agent().attest_once(session)
            assert cert.spiffe_id == "spiffe://attestmesh.local/ns/shop/sa/web"
            leaf = x509.load_pem_x509_certificate(cert.chain_pem)
            san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert san.get_values_for_type(x509.UniformResourceIdentifier) == [cert.spiffe_id]
            assert cp.status_of(WORKLOAD) is Status.ATTESTED

            # another service account's token, an unknown token, no token: 401, no quarantine
            for token in ("tok-other", "forged", ""):
                with pytest.raises(AgentError) as exc:
                    await plane.agent(token=token).attest_once(session)
                assert (exc.value.status, exc.value.reason) == (401, "identity_invalid")
            assert cp.status_of(WORKLOAD) is Status.ATTESTED

            # the webhook in the same process, trusted through the caBundle it wrote
            hook = kube.get(
                "mutatingwebhookconfigurations", "", "attestmesh-sidecar-injector", WEBHOOKS.group
            )
            assert hook is not None
            bundle = base64.b64decode(hook["webhooks"][0]["clientConfig"]["caBundle"])
            assert bundle == cp.ca.bundle_pem
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "u1",
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": "shop",
                    "operation": "CREATE",
                    "object": {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": "web-1",
                            "namespace": "shop",
                            "annotations": {"attestmesh.dev/tee": "sim"},
                        },
                        "spec": {
                            "serviceAccountName": "web",
                            "containers": [
                                {"name": "app", "image": "web:1", "ports": [{"containerPort": 80}]}
                            ],
                        },
                    },
                },
            }
            assert plane.mode.webhook_url is not None
            async with session.post(
                plane.mode.webhook_url + "/mutate/pods",
                data=json.dumps(review),
                ssl=client_ssl_context(bundle),
            ) as resp:
                assert resp.status == 200
                answer = (await resp.json())["response"]
            # injected because namespace shop is labelled attestmesh.dev/inject=enabled
            assert answer["allowed"] is True and decode_patch(answer)
            injected = apply_patch(review["request"]["object"], decode_patch(answer))  # type: ignore[index]
            inits = {c["name"]: c for c in injected["spec"]["initContainers"]}
            boot = inits[BOOTSTRAP_CONTAINER]["command"]
            # the xDS server's SPIFFE ID is checked in the running control plane's domain
            assert boot[boot.index("--trust-domain") + 1] == cp.state.trust_domain
            assert boot[boot.index("--xds-ca") + 1] == TRUST_BUNDLE
            agent_cmd = inits[AGENT_CONTAINER]["command"]
            assert agent_cmd[agent_cmd.index("--sim-measurement") + 1] == GOOD.hex()

            # the bundle those paths mount is in the pod's namespace: the one the API serves
            await plane.mode.drained()
            async with session.get(
                plane.url + "/v1/trust", ssl=client_ssl_context(cp.ca.bundle_pem)
            ) as resp:
                served = (await resp.json())["trust_bundle"]
            cm = kube.get("configmaps", "shop", "attestmesh-trust-bundle")
            assert cm is not None and cm["data"] == {"root.pem": served}
            assert served.encode() == cp.ca.bundle_pem

            probe = f"http://127.0.0.1:{plane.mode.settings.probe_port}"
            async with session.get(probe + "/readyz") as resp:
                assert resp.status == 200
            async with session.get(probe + "/metrics") as resp:
                assert "attestmesh_kube_actions_total" in await resp.text()
            async with session.get(probe + "/v1/admin/workloads") as resp:
                assert resp.status == 404  # no admin API on the pod network

        # the pod goes away: so does its registration
        await kube.delete_object("pods", "shop", "web-0")
        await eventually(lambda: WORKLOAD not in cp.state.workloads)


async def test_tampered_reattestation_quarantines_and_restart_reapplies_idempotently(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await seed(kube, policy_cr("web"))
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        async with aiohttp.ClientSession() as session:
            source = SimEvidenceSource(PLATFORM, GOOD)
            agent = plane.agent(source=source)
            await agent.attest_once(session)
            source.measurement = BAD  # a tampered image
            with pytest.raises(AgentError) as exc:
                await agent.attest_once(session)
            assert exc.value.status == 403
        assert cp.status_of(WORKLOAD) is Status.QUARANTINED
        await plane.mode.drained()
        obj = pod(kube)
        assert obj["metadata"]["labels"][LABEL_QUARANTINED] == "true"
        (cond,) = attested_conditions(obj)
        assert cond["status"] == "False" and cond["reason"] == "AppraisalFailed"
        (event,) = events(kube, "Quarantined")
        assert "measurement" in event["message"] and event["count"] == 1
        assert kube.get("pods", "shop", "web-0") is not None  # onFailure: quarantine, no eviction
        node = kube.get("nodes", "", "n1")
        assert node is not None and not node["spec"].get("taints")  # the platform is fine
    pod_writes = [r for r in kube.requests if r[0] in ("PATCH", "PUT") and "/pods/web-0" in r[1]]

    # restart with the same state: the quarantine is re-derived and re-applied, changing nothing
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        assert plane.running.cp.status_of(WORKLOAD) is Status.QUARANTINED
        await eventually(lambda: any(w.kind is WorkKind.REAPPLY for w in plane.mode.completed))
        await plane.mode.drained()
        obj = pod(kube)
        assert obj["metadata"]["labels"][LABEL_QUARANTINED] == "true"
        assert len(attested_conditions(obj)) == 1
        (event,) = events(kube, "Quarantined")
        assert event["count"] == 2  # the same Event, aggregated
        again = [r for r in kube.requests if r[0] in ("PATCH", "PUT") and "/pods/web-0" in r[1]]
        assert again == pod_writes  # nothing written to the pod
        # still quarantined: no certificate
        async with aiohttp.ClientSession() as session:
            with pytest.raises(AgentError) as exc:
                await plane.agent().attest_once(session)
            assert exc.value.reason == "quarantined"

            # the operator releases it: label gone, condition True; a fresh attestation admits
            assert plane.running.cp.release(WORKLOAD)
            await plane.mode.drained()
            obj = pod(kube)
            assert LABEL_QUARANTINED not in obj["metadata"]["labels"]
            (cond,) = attested_conditions(obj)
            assert cond["status"] == "True"
            await plane.agent().attest_once(session)
            assert plane.running.cp.status_of(WORKLOAD) is Status.ATTESTED
    lease = kube.get(
        "leases", "attestmesh-system", "attestmesh-controlplane-leader", "coordination.k8s.io"
    )
    assert lease is not None and lease["spec"].get("holderIdentity") is None  # handed over


async def test_invalid_policy_resource_is_refused_and_the_previous_stays(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await seed(kube, policy_cr("web"))
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        await eventually(lambda: accepted(kube, "web").get("status") == "True")
        broken = policy_cr("web", allowedTees=["quantum"], certificateTTL="forever")
        await kube.put_object("attestationpolicies", broken, GROUP)
        await eventually(lambda: accepted(kube, "web").get("status") == "False")
        cond = accepted(kube, "web")
        assert cond["reason"] == "Invalid"
        assert "quantum" in cond["message"] and "forever" in cond["message"]
        assert "previous valid version stays in force" in cond["message"]
        # the Event is written after the condition: wait for it, then it is the only one
        await eventually(lambda: bool(events(kube, "Invalid")))
        (event,) = events(kube, "Invalid")
        assert event["involvedObject"]["kind"] == "AttestationPolicy"
        assert [p.name for p in plane.mode.policies] == ["shop/web"]
        assert plane.mode.policies[0].allowed_tees  # the old, valid spec
        async with aiohttp.ClientSession() as session:
            cert = await plane.agent().attest_once(session)  # still admitted by the old policy
        assert cert.spiffe_id.endswith("/ns/shop/sa/web")


def trust_cm(kube: FakeKube, namespace: str) -> dict[str, Any] | None:
    return kube.get("configmaps", namespace, "attestmesh-trust-bundle")


def configmap_writes(kube: FakeKube) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _ in kube.requests if m != "GET" and "/configmaps" in p]


def rbac_allows(verb: str, resource: str, name: str | None) -> bool:
    """Whether manifests/base/rbac.yaml's ClusterRole grants this core-group request."""
    root = Path(__file__).resolve().parents[2]
    docs = yaml.safe_load_all((root / "manifests" / "base" / "rbac.yaml").read_text())
    (role,) = [d for d in docs if d and d["kind"] == "ClusterRole"]
    return any(
        "" in r["apiGroups"]
        and resource in r["resources"]
        and verb in r["verbs"]
        and ("resourceNames" not in r or name in r["resourceNames"])
        for r in role["rules"]
    )


def configmap_requests_are_allowed(kube: FakeKube) -> None:
    verbs = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch"}
    seen = [(m, p.split("?")[0]) for m, p, _ in kube.requests if "/configmaps" in p]
    assert seen
    for method, path in seen:
        name = None if path.endswith("/configmaps") else path.rsplit("/", 1)[1]
        assert rbac_allows(verbs[method], "configmaps", name), (method, path)
    assert not rbac_allows("get", "configmaps", "some-app-config")
    assert not rbac_allows("update", "configmaps", "some-app-config")
    assert not rbac_allows("list", "configmaps", None)


async def test_trust_bundle_configmap_follows_injected_pods_and_is_repaired(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await seed(kube, policy_cr("web"))
    await kube.put_object("namespaces", {"metadata": {"name": "pay"}})  # not labelled
    await kube.put_object("namespaces", {"metadata": {"name": "quiet"}})
    # someone's stale or forged bundle under our name: replaced, their other keys kept
    await kube.put_object(
        "configmaps",
        {
            "metadata": {"name": "attestmesh-trust-bundle", "namespace": "shop"},
            "data": {"root.pem": "forged", "note": "kept"},
        },
    )
    async with (
        control_plane(kube, tmp_path / "a", sim_key, "cp-a") as plane,
        control_plane(kube, tmp_path / "b", sim_key, "cp-b") as follower,
    ):
        bundle = plane.running.cp.ca.bundle_pem.decode()
        await plane.mode.drained()
        cm = trust_cm(kube, "shop")  # a labelled namespace, before any pod needs it
        assert cm is not None and cm["data"] == {"root.pem": bundle, "note": "kept"}
        assert cm["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "attestmesh"
        assert trust_cm(kube, "pay") is None and trust_cm(kube, "quiet") is None
        assert trust_cm(kube, "attestmesh-system") is None

        # a pod opted in by annotation in an unlabelled namespace, not yet started (no IP: it
        # waits for this very volume): the ConfigMap appears without a registration
        pending = pod_obj("api-0")
        pending["metadata"]["namespace"] = "pay"
        del pending["status"]
        await kube.put_object("pods", pending)
        await eventually(lambda: trust_cm(kube, "pay") is not None)
        cm = trust_cm(kube, "pay")
        assert cm is not None and cm["data"] == {"root.pem": bundle}
        assert "pay/api-0" not in plane.running.cp.state.workloads

        # idempotent: pod churn and re-applies write nothing more
        writes = configmap_writes(kube)
        assert writes == [
            ("PUT", "/api/v1/namespaces/shop/configmaps/attestmesh-trust-bundle"),
            ("POST", "/api/v1/namespaces/pay/configmaps"),
        ]
        pending["metadata"]["labels"] = {"app": "api", "v": "2"}
        await kube.put_object("pods", pending)
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        assert configmap_writes(kube) == writes

        # drift is repaired on the next re-apply: an edit, a deletion
        edited = trust_cm(kube, "shop")
        assert edited is not None
        edited["data"]["root.pem"] = "edited"
        await kube.put_object("configmaps", edited)
        await kube.delete_object("configmaps", "pay", "attestmesh-trust-bundle")
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        for ns in ("shop", "pay"):
            cm = trust_cm(kube, ns)
            assert cm is not None and cm["data"]["root.pem"] == bundle
        # only the leader writes; it touches no other ConfigMap name
        await follower.mode.drained()
        assert not [w for w in follower.mode.completed if w.kind is WorkKind.TRUST_BUNDLE]
        assert all(
            p.endswith("/configmaps") or p.endswith("/configmaps/attestmesh-trust-bundle")
            for _, p in configmap_writes(kube)
        )
        # a failed read is retried by the re-apply; a create that lost a race reads again
        kube.fail("GET", "/namespaces/quiet/configmaps/attestmesh-trust-bundle", 503)
        kube.fail("POST", "/namespaces/quiet/configmaps", 409)
        await kube.put_object("namespaces", {"metadata": {"name": "quiet", "labels": {
            "attestmesh.dev/inject": "enabled"}}})  # fmt: skip
        await eventually(lambda: len(kube.fail_next) == 1)
        await plane.mode.drained()
        assert trust_cm(kube, "quiet") is None
        plane.mode.submit(Work(WorkKind.REAPPLY))
        await plane.mode.drained()
        assert not kube.fail_next
        cm = trust_cm(kube, "quiet")
        assert cm is not None and cm["data"] == {"root.pem": bundle}
    configmap_requests_are_allowed(kube)  # every call the manifests' RBAC permits


LEDGER = "shop/ledger-0"


def ledger_pod(ip: str = "10.1.0.9") -> dict[str, Any]:
    """A pod of the billing Service. Its service account is web and it keeps the annotations
    of ``pod_obj``: neither makes it a member of any mesh service, only the Service does."""
    obj = pod_obj("ledger-0", ip)
    obj["metadata"]["labels"] = {"tier": "billing"}
    return obj


def endpoint_slice(ready: bool) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "billing-x7k2p",
            "namespace": "shop",
            "labels": {"kubernetes.io/service-name": "billing"},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": ["10.1.0.9"],
                "conditions": {"ready": ready, "serving": ready, "terminating": False},
                "targetRef": {"kind": "Pod", "name": "ledger-0", "namespace": "shop"},
            }
        ],
        "ports": [{"port": 8080, "protocol": "TCP"}],
    }


def snapshot_of(plane: Plane, node: str) -> Snapshot:
    cache = plane.running.publisher._cache  # what ADS serves this node
    snap = cache.get(node)
    assert snap is not None
    return snap


def pinned(snap: Snapshot, cluster: str) -> list[str]:
    """The SPIFFE IDs cluster ``cluster`` accepts from upstream peers (its SAN matchers)."""
    tls = decoded(snap, TypeUrl.CLUSTER, cluster)["transportSocket"]["typedConfig"]
    ctx = tls["commonTlsContext"]["combinedValidationContext"]["defaultValidationContext"]
    return sorted(m["matcher"]["exact"] for m in ctx.get("matchTypedSubjectAltNames", []))


async def test_service_and_endpoint_slices_shape_the_callers_endpoints(
    kube: FakeKube, tmp_path: Path, sim_key: Path
) -> None:
    await seed(kube, policy_cr("web"))
    caller = pod_obj()
    caller["metadata"]["annotations"]["attestmesh.dev/outbound"] = "billing=15001"
    await kube.put_object("pods", caller)
    await kube.put_object("pods", ledger_pod())
    billing = {
        "metadata": {"name": "billing", "namespace": "shop"},
        "spec": {"selector": {"tier": "billing"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    await kube.put_object("services", billing)
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        cp = plane.running.cp
        assert cp.state.get(LEDGER).registration.service == "billing"
        async with aiohttp.ClientSession() as session:
            await plane.agent().attest_once(session)
            kube.add_token("tok-ledger", "shop", "web", pod="ledger-0")
            await plane.agent(token="tok-ledger", workload=LEDGER).attest_once(session)

        def billing_endpoints() -> list[tuple[str, int]]:
            return endpoints(snapshot_of(plane, WORKLOAD), "out|billing")

        assert billing_endpoints() == [("10.1.0.9", 15006)]
        assert pinned(snapshot_of(plane, WORKLOAD), "out|billing") == [
            "spiffe://attestmesh.local/ns/shop/sa/web"
        ]

        # its EndpointSlice says not ready: out of the caller's EDS; ready again: back
        group = "discovery.k8s.io"
        await kube.put_object("endpointslices", endpoint_slice(False), group)
        await eventually(lambda: billing_endpoints() == [])
        assert cp.status_of(LEDGER) is Status.ATTESTED  # still attested, only not routed to
        await kube.put_object("endpointslices", endpoint_slice(True), group)
        await eventually(lambda: billing_endpoints() == [("10.1.0.9", 15006)])

        # its IP changes through the pod watch
        await kube.put_object("pods", ledger_pod("10.1.0.19"))
        await eventually(lambda: billing_endpoints() == [("10.1.0.19", 15006)])

        # the Service goes: the pod serves no mesh service at all (not its service account's
        # name, not a label); it stays registered and attested, and leaves the caller's EDS
        # and CDS pins
        await kube.delete_object("services", "shop", "billing")
        await eventually(lambda: cp.state.get(LEDGER).registration.service == "")
        assert billing_endpoints() == []
        assert cp.status_of(LEDGER) is Status.ATTESTED
        nobody = ["spiffe://attestmesh.local/-/none"]  # a service with no attested member
        await eventually(lambda: pinned(snapshot_of(plane, WORKLOAD), "out|billing") == nobody)
        index = plane.running.publisher.index
        assert index is not None
        assert not any(LEDGER in members for members in index.members.values())

    # a restart keeps readiness from the cluster, not from the persisted state
    await kube.put_object("services", billing)
    await kube.put_object("endpointslices", endpoint_slice(False), "discovery.k8s.io")
    async with control_plane(kube, tmp_path / "state", sim_key) as plane:
        reg = plane.running.cp.state.get(LEDGER).registration
        assert (reg.service, reg.ready) == ("billing", False)
        assert endpoints(snapshot_of(plane, WORKLOAD), "out|billing") == []


def test_build_work_is_pure_and_only_for_pods() -> None:
    reg = Registration("shop/web-0", "shop", "web", "web", Endpoint("10.0.0.1", 15006), 8080)
    state, _ = register(MeshState("attestmesh.local"), reg, T0)
    local = Registration("local-1", "default", "x", "x", Endpoint("127.0.0.1", 1), 2)
    state, _ = register(state, local, T0)
    (evicting,) = parse_policies([policy_cr("web", onFailure="quarantineAndEvict")])
    (auditing,) = parse_policies(
        [policy_cr("web-audit", mode="audit", onFailure="quarantineAndEvict")]
    )
    evs = [
        Event(
            EventKind.QUARANTINED,
            "shop/web-0",
            T0,
            "tcb_status_not_accepted: Revoked",
            Trigger.TCB_REVOKED,
            "tcb_status_not_accepted",
            platform=True,
        ),
        Event(EventKind.QUARANTINED, "local-1", T0, "x", Trigger.OPERATOR),
        Event(EventKind.RELEASED, "shop/web-0", T0),
        Event(EventKind.AUDIT, "shop/web-0", T0, "measurement_not_allowed: m"),
        Event(EventKind.ATTESTED, "shop/web-0", T0),
    ]
    work = build_work(state, evs, [evicting])
    assert [(w.kind, w.workload) for w in work] == [
        (WorkKind.QUARANTINE, "shop/web-0"),
        (WorkKind.RELEASE, "shop/web-0"),
        (WorkKind.AUDIT, "shop/web-0"),
    ]
    assert work[0].evict and work[0].platform_failed  # typed: authentic platform evidence
    # the reason text decides nothing: a platform-sounding text without the flag taints nothing
    text_only = Event(EventKind.QUARANTINED, "shop/web-0", T0, "tcb_status_not_accepted: x",
                      Trigger.APPRAISAL_FAILED)  # fmt: skip
    assert not build_work(state, [text_only], [evicting])[0].platform_failed
    # an audit-mode policy never evicts; no governing policy: quarantine only
    assert not build_work(state, evs[:1], [auditing])[0].evict
    assert not build_work(state, evs[:1], [])[0].evict


def test_cli_mode_specific_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["controlplane", "--state-dir", str(tmp_path)]) == 2
    assert "--policy is required in local mode" in capsys.readouterr().err
    argv = ["controlplane", "--state-dir", str(tmp_path), "--kubernetes", "--policy", "p.yaml"]
    assert cli_main([*argv, "--webhook-cert", "c.pem"]) == 2
    err = capsys.readouterr().err
    assert "--policy is for local mode" in err
    assert "--webhook-cert and --webhook-key go together" in err
    assert cli_main(["controlplane", "--state-dir", str(tmp_path), "--policy", "p.yaml",
                     "--lease-name", "x"]) == 2  # fmt: skip
    assert "--lease-name needs --kubernetes" in capsys.readouterr().err
    missing = tmp_path / "missing-kubeconfig"
    k = ["controlplane", "--state-dir", str(tmp_path / "s"), "--kubernetes"]
    assert cli_main([*k, "--kubeconfig", str(missing)]) == 2
    assert "kube_config_invalid" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before any state was opened


def test_deployment_args_are_cli_flags() -> None:
    """manifests/base/controlplane.yaml runs exactly what the CLI accepts in Kubernetes mode."""
    root = Path(__file__).resolve().parents[2]
    docs = yaml.safe_load_all((root / "manifests" / "base" / "controlplane.yaml").read_text())
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["attestmesh", "controlplane"]
    env = {"POD_NAMESPACE": "attestmesh-system", "POD_NAME": "attestmesh-controlplane-abc"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    parsed = build_parser().parse_args(["controlplane", *args])
    _check_mode(parsed)  # no mode-specific problem
    assert parsed.kubernetes and parsed.identity == "attestmesh-controlplane-abc"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert parsed.api_port == ports["https-attest"] and parsed.xds_port == ports["grpc-xds"]
    assert parsed.webhook_port == ports["https-webhook"]
    assert parsed.probe_port == ports["http-metrics"]
    probe_ports = {container[p]["httpGet"]["port"] for p in ("livenessProbe", "readinessProbe")}
    assert probe_ports == {"http-metrics"}
