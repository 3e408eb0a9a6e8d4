"""The injection webhook over real HTTPS: AdmissionReview v1 in, JSON patch out."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import kubernetes_validate
import pytest
import trustme
from prometheus_client import CollectorRegistry

from certs.evidence.claims import Tee
from sidecar.inject import (
    InjectConfig,
    NamespaceLabels,
    SimInjection,
    build_app,
    decode_patch,
    start_webhook,
    webhook_counter,
)
from tests.unit.inject.jsonpatch import apply_patch


def pod(name: str, **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "shop", "annotations": annotations},
        "spec": {
            "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "web:1", "ports": [{"containerPort": 8080}]}],
        },
    }


def review(obj: dict[str, Any], uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": obj["metadata"].get("namespace", "shop"),
            "operation": "CREATE",
            "object": obj,
        },
    }


class Webhook:
    def __init__(self, url: str, session: aiohttp.ClientSession, registry: CollectorRegistry):
        self.url, self.session, self.registry = url, session, registry

    async def post(self, body: Any, *, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else json.dumps(body).encode()
        async with self.session.post(
            f"{self.url}/mutate", data=data, headers={"Content-Type": "application/json"}
        ) as resp:
            return resp.status, await resp.json()

    def count(self, decision: str) -> float:
        value = self.registry.get_sample_value(
            "attestmesh_webhook_requests_total", {"decision": decision}
        )
        return value or 0.0


@pytest.fixture
async def webhook() -> AsyncIterator[Webhook]:
    ca = trustme.CA()
    cert = ca.issue_cert("attestmesh-webhook.attestmesh-system.svc", "127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    registry = CollectorRegistry()
    namespaces = NamespaceLabels({"shop": {"attestmesh.dev/inject": "enabled"}})
    # a test cluster: sim enabled and the default; production refuses it (test_production_...)
    cfg = InjectConfig(default_tee=Tee.SIM, sim=SimInjection("a1" * 48))
    app = build_app(cfg, namespaces, webhook_counter(registry))
    runner = await start_webhook(app, "127.0.0.1", 0, server_ctx)
    port = runner.addresses[0][1]
    connector = aiohttp.TCPConnector(ssl=client_ctx)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield Webhook(f"https://127.0.0.1:{port}", session, registry)
    await runner.cleanup()


async def test_healthz_and_manifest_path(webhook: Webhook) -> None:
    async with webhook.session.get(f"{webhook.url}/healthz") as resp:
        assert resp.status == 200 and await resp.text() == "ok"
    async with webhook.session.post(
        f"{webhook.url}/mutate/pods", json=review(pod("p"), "u-path")
    ) as resp:
        body = await resp.json()
    assert body["response"]["uid"] == "u-path" and body["response"]["patchType"] == "JSONPatch"


@pytest.mark.parametrize("tee", ["sim", "nitro", "sev-snp", "tdx", "sgx"])
async def test_inject_over_https_per_tee(webhook: Webhook, tee: str) -> None:
    annotations = {"attestmesh.dev/tee": tee}
    if tee == "nitro":  # the enclave image is required: a Nitro pod runs its EIF
        annotations["attestmesh.dev/enclave-image"] = "registry.example/app-eif:1"
    src = pod("web-0", **annotations)
    status, body = await webhook.post(review(src, f"uid-{tee}"))
    assert status == 200
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    resp = body["response"]
    assert resp["uid"] == f"uid-{tee}" and resp["allowed"] is True
    assert resp["patchType"] == "JSONPatch"
    out = apply_patch(src, decode_patch(resp))
    kubernetes_validate.validate(out, "1.37", strict=True)
    names = [c["name"] for c in out["spec"]["initContainers"]]
    if tee == "nitro":  # agent and Envoy run inside the enclave, the parent launches it
        assert names == ["attestmesh-nitro-parent"]
    else:
        assert names == ["attestmesh-bootstrap", "attestmesh-agent", "attestmesh-envoy"]
    # the second admission of the injected pod changes nothing
    status, again = await webhook.post(review(out, "uid-again"))
    assert status == 200 and again["response"]["allowed"] is True
    assert "patch" not in again["response"]
    assert webhook.count("injected") == 1 and webhook.count("already_injected") == 1


async def test_opt_out_control_plane_and_denial(webhook: Webhook) -> None:
    status, body = await webhook.post(review(pod("x", **{"attestmesh.dev/inject": "false"}), "u1"))
    assert status == 200 and body["response"] == {"uid": "u1", "allowed": True}
    cp = pod("cp")
    cp["metadata"]["namespace"] = "attestmesh-system"
    cp["metadata"].setdefault("labels", {})["attestmesh.dev/inject"] = "enabled"
    status, body = await webhook.post(review(cp, "u2"))
    assert body["response"] == {"uid": "u2", "allowed": True}
    host = pod("h")
    host["spec"]["hostNetwork"] = True
    status, body = await webhook.post(review(host, "u3"))
    assert status == 200
    assert body["response"]["allowed"] is False
    assert body["response"]["status"]["code"] == 403
    assert "hostNetwork" in body["response"]["status"]["message"]
    assert webhook.count("opted_out") == 1
    assert webhook.count("control_plane") == 1
    assert webhook.count("host_network") == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}',
        b'{"apiVersion": "v1", "kind": "Pod"}',
    ],
)
async def test_bad_requests_are_400(webhook: Webhook, raw: bytes) -> None:
    status, body = await webhook.post(None, raw=raw)
    assert status == 400 and body["error"]
    assert webhook.count("bad_request") == 1


async def test_production_config_refuses_sim_over_https() -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    registry = CollectorRegistry()
    namespaces = NamespaceLabels({"shop": {"attestmesh.dev/inject": "enabled"}})
    runner = await start_webhook(
        build_app(InjectConfig(), namespaces, webhook_counter(registry)),
        "127.0.0.1",
        0,
        server_ctx,
    )
    try:
        url = f"https://127.0.0.1:{runner.addresses[0][1]}/mutate"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx)) as s:
            for tee, decision in (("sim", "tee_disabled"), (None, "no_tee")):
                obj = pod("web-0", **({"attestmesh.dev/tee": tee} if tee else {}))
                async with s.post(url, json=review(obj, "u")) as resp:
                    answer = (await resp.json())["response"]
                assert answer["allowed"] is False and answer["status"]["code"] == 403
                value = registry.get_sample_value(
                    "attestmesh_webhook_requests_total", {"decision": decision}
                )
                assert value == 1.0
    finally:
        await runner.cleanup()
