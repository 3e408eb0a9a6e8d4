"""The control plane in Kubernetes mode in this process, so tests can read its state: the one
set-up of it for every test (tests/kube_real against the real API servers, and the few
tests/component tests that keep tests/fakekube for faults a real server cannot be made to
produce).

``kube_plane`` runs what ``attestmesh controlplane --kubernetes`` runs against any API server
(a ``KubeClient``); ``make_env`` (namespaces, service accounts, the control plane's kubeconfig
holding a real TokenRequest token of the manifests' ServiceAccount, the webhook configuration
pointed at loopback) and ``control_plane`` do it against the real one, plus pod and policy
builders."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from kubernetes import client

from attestmesh.controlplane.secrets import SecretPolicies
from attestmesh.kube_mode import KubeMode, KubeSettings, connect
from attestmesh.metrics import Metrics
from attestmesh.secret_release import SecretReleaseSettings
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.inject import InjectConfig, SimInjection
from tests.kube_real.cluster import Cluster, free_port
from tests.kube_real.rest import Rest, until, wait_for
from tests.unit.xds.test_xds_build import decoded
from xds.build import Snapshot
from xds.kube import TAINT_PLATFORM_UNTRUSTED, KubeClient
from xds.resources import TypeUrl

GOOD = bytes.fromhex("a1" * 48)
BAD = bytes.fromhex("b2" * 48)
PLATFORM = ec.generate_private_key(ec.SECP256R1())
GROUP_VERSION = "attestmesh.dev/v1alpha1"
SHOP = "shop"  # labelled attestmesh.dev/inject=enabled: the webhook injects here
STORE = "store"  # not labelled: pods here are stored as sent (pre-injected fixtures)
WEBHOOK = "attestmesh-sidecar-injector"


@dataclass
class Env:
    cluster: Cluster
    admin: Rest
    kubeconfig: Path  # the control plane's: its ServiceAccount's token
    webhook_port: int
    sim_key: Path


def namespace_doc(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }


def service_account_doc(ns: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns},
        "automountServiceAccountToken": False,
    }


def service_account_token(admin: Rest, ns: str, sa: str, **spec: Any) -> str:
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {"expirationSeconds": 3600, **spec},
    }
    out = admin.call("POST", f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", body)
    return str(out["status"]["token"])


def pod_token(admin: Rest, pod: dict[str, Any], audience: str = "attestmesh") -> str:
    """A real TokenRequest token of the pod's service account bound to the pod (what the
    kubelet projects into an injected pod)."""
    meta = pod["metadata"]
    ref = {"kind": "Pod", "apiVersion": "v1", "name": meta["name"], "uid": meta["uid"]}
    return service_account_token(
        admin, meta["namespace"], pod["spec"]["serviceAccountName"],
        audiences=[audience], expirationSeconds=600, boundObjectRef=ref,
    )  # fmt: skip


def make_env(cluster: Cluster, admin: Rest, workdir: Path) -> Env:
    """Namespaces, service accounts, the control plane's token kubeconfig, and the webhook
    configuration pointed at a free loopback port (manifests/ must be installed)."""
    admin.apply(namespace_doc(SHOP, {"attestmesh.dev/inject": "enabled"}))
    admin.apply(namespace_doc(STORE))
    for ns in (SHOP, STORE):
        admin.apply(service_account_doc(ns, "web"))
        admin.apply(service_account_doc(ns, "other"))
    token = service_account_token(admin, "attestmesh-system", "attestmesh-controlplane")
    kubeconfig = cluster.token_kubeconfig("controlplane", token)
    port = free_port()
    hook = admin.get(
        "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, WEBHOOK
    )
    for h in hook["webhooks"]:
        h["clientConfig"] = {"url": f"https://127.0.0.1:{port}/mutate/pods"}
    admin.call(
        "PUT",
        admin.path(
            "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, WEBHOOK
        ),
        hook,
    )
    return Env(cluster, admin, kubeconfig, port, sim_key_file(workdir))


@dataclass
class Plane:
    running: Running
    mode: KubeMode
    settings: ControlPlaneSettings
    task: asyncio.Task[None]  # the control plane's: done only if it ended

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.settings.api_port}"

    def agent(
        self,
        workload: str,
        token: str,
        measurement: bytes = GOOD,
        source: SimEvidenceSource | None = None,
    ) -> Agent:
        class Sink:
            def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
                pass

        return Agent(
            url=self.url,
            workload=workload,
            source=source or SimEvidenceSource(PLATFORM, measurement),
            sink=Sink(),
            ssl_context=client_ssl_context(self.running.bundle_pem),
            token=lambda: token,
        )


def sim_key_file(directory: Path) -> Path:
    """The simulated platform's public key, as the control plane's trust anchor."""
    directory.mkdir(parents=True, exist_ok=True)
    key = directory / "platform.pem"
    key.write_bytes(
        PLATFORM.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key


def fake_client(configuration: Any) -> KubeClient:
    """A ``KubeClient`` for tests/fakekube (``FakeKube.configuration()``)."""
    return KubeClient(client.ApiClient(configuration), request_timeout=5)


@contextlib.asynccontextmanager
async def kube_plane(
    kc: KubeClient,
    sim_key: Path,
    state_dir: Path,
    identity: str = "cp-0",
    *,
    webhook_port: int | None = None,
    metrics: Metrics | None = None,
    secrets: SecretReleaseSettings | None = None,
    **kube_settings: Any,
) -> AsyncIterator[Plane]:
    """What ``attestmesh controlplane --kubernetes`` runs, against the server ``kc`` talks to,
    until it has synced. ``kube_settings`` override ``KubeSettings`` (e.g. the webhook
    certificate's lifetime); ``secrets``: secret release on, fed from SecretPolicy CRs."""
    settings = ControlPlaneSettings(
        state_dir=state_dir,
        sim_platform_keys=(sim_key,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
        deadline_check=timedelta(seconds=1),
        secrets=secrets,
    )
    metrics = metrics or Metrics()
    options: dict[str, Any] = {
        "identity": identity,
        "webhook_host": "127.0.0.1",
        "webhook_port": webhook_port or free_port(),
        "webhook_configuration": WEBHOOK,
        "probe_host": "127.0.0.1",
        "probe_port": free_port(),
        "retry_period": timedelta(seconds=0.5),
        "watch_timeout": 30,
        "inject": InjectConfig(sim=SimInjection(GOOD.hex())),  # a test cluster
    }
    mode = KubeMode(
        kc,
        KubeSettings(**(options | kube_settings)),
        metrics,
        state_dir=state_dir,
        secret_policies=SecretPolicies() if secrets is not None else None,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_control_plane(settings, stop, ready, metrics=metrics, hooks=mode.hooks())
    )
    try:
        running = await asyncio.wait_for(ready, 20)
        await asyncio.wait_for(mode.synced.wait(), 20)
        yield Plane(running, mode, settings, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)


@contextlib.asynccontextmanager
async def control_plane(
    env: Env, state_dir: Path, identity: str = "cp-0", *, lead: bool = True, **kube_settings: Any
) -> AsyncIterator[Plane]:
    """The control plane against the real server, as the manifests' ServiceAccount (a
    kubeconfig as ``controlplane --kubernetes --kubeconfig`` reads it). ``lead``: wait until
    this replica holds the Lease and wrote the webhook's caBundle (else: only until it has
    synced)."""
    async with kube_plane(
        connect(env.kubeconfig, 10),
        env.sim_key,
        state_dir,
        identity,
        webhook_port=env.webhook_port,
        **kube_settings,
    ) as plane:
        bundle = base64.b64encode(plane.running.cp.ca.bundle_pem).decode()

        def bundled() -> bool:
            hook = env.admin.get(
                "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, WEBHOOK
            )
            return all(h["clientConfig"].get("caBundle") == bundle for h in hook["webhooks"])

        # the tests expect this replica to act: the Lease may still be held by a replica
        # killed without handing it over (until it expires)
        if lead:
            await until(lambda: plane.mode.elector.is_leader or None, timeout=40, what="leadership")
            await until(bundled, what="caBundle written")
        yield plane


def app_pod(
    name: str,
    ns: str,
    *,
    annotations: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels or {"app": "web"},
            "annotations": annotations or {},
        },
        "spec": {
            "serviceAccountName": "web",
            "automountServiceAccountToken": False,
            "containers": [{"name": "app", "image": "web:1", "ports": [{"containerPort": 8080}]}],
            **spec,
        },
    }


def injected_fixture_pod(
    name: str, ip: str = "", *, ns: str = STORE, sa: str = "web", **spec: Any
) -> dict[str, Any]:
    """A pod as the injector leaves it (annotations), stored as sent in a namespace without
    injection (``ip``: documentation; ``running_pod`` gives it)."""
    return app_pod(
        name,
        ns,
        annotations={
            "attestmesh.dev/injected": "true",
            "attestmesh.dev/inbound-port": "15006",
            "attestmesh.dev/app-port": "8080",
        },
        labels={"app": sa},
        serviceAccountName=sa,
        **spec,
    )


async def create(rest: Rest, doc: dict[str, Any]) -> tuple[int, Any]:
    """POST through the server in a thread: the server may call our webhook on this loop."""
    return await asyncio.to_thread(rest.status_of, "POST", rest.doc_path(doc, named=False), doc)


async def running_pod(admin: Rest, doc: dict[str, Any], ip: str) -> dict[str, Any]:
    """Create ``doc`` and give it the status a kubelet would (Running, pod IP)."""
    status, body = await create(admin, doc)
    assert status == 200, body.get("message")
    ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
    return dict(
        await asyncio.to_thread(
            admin.patch,
            "v1",
            "Pod",
            ns,
            name,
            {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}},
            subresource="status",
        )
    )


def policy(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"serviceAccounts": ["web"]},
            "allowedTees": ["sim"],
            "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
            **spec,
        },
    }


CONTROL_PLANE_USER = "system:serviceaccount:attestmesh-system:attestmesh-controlplane"


def audited(env: Env) -> list[dict[str, Any]]:
    """Every request the control plane (the manifests' ServiceAccount) made so far, per the
    server's audit log (ResponseComplete: verb, requestURI, objectRef, responseStatus); first a
    sentinel request as the control plane, whose entry shows the log has caught up."""
    sentinel = f"sentinel-{len(env.cluster.audit_events(CONTROL_PLANE_USER))}"
    rest = Rest(env.kubeconfig)
    try:
        rest.status_of("GET", f"/api/v1/namespaces/{sentinel}")
    finally:
        rest.close()

    def caught_up() -> list[dict[str, Any]] | None:
        found = env.cluster.audit_events(CONTROL_PLANE_USER)
        return found if any(sentinel in e["requestURI"] for e in found) else None

    return wait_for(caught_up, what="audit log caught up")


WRITES = ("create", "update", "patch", "delete")


def writes_to(env: Env, prefix: str) -> list[tuple[str, str]]:
    """(verb, path) of the control plane's writes whose path starts with ``prefix``."""
    return [
        (e["verb"], e["requestURI"].split("?")[0])
        for e in audited(env)
        if e["verb"] in WRITES and e["requestURI"].startswith(prefix)
    ]


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


def ours(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The node's taints attestmesh sets (the server adds node.kubernetes.io/not-ready to a
    Node no kubelet reports)."""
    return [t for t in node["spec"].get("taints") or [] if t["key"] == TAINT_PLATFORM_UNTRUSTED]
