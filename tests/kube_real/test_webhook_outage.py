"""The injection webhook of manifests/base/webhook.yaml on a real kube-apiserver 1.20.2 (which
drops ``matchConditions`` and does not set ``kubernetes.io/metadata.name``): only opted-in pods
depend on the control plane.

With the webhook endpoint down (nothing listening on its port), pods that did not opt in are
created (201) in a plain namespace and in kube-system, and so is a pod labelled enabled in the
control-plane namespace (labelled ``attestmesh.dev/inject=disabled``); opted-in pods (pod label
or namespace label) are refused, fail closed. With the control plane up, the labelled pod in a
plain namespace is mutated by the real webhook call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.kube_real.cluster import Cluster
from tests.kube_real.install import Installed
from tests.kube_real.plane import (
    SHOP,
    STORE,
    WEBHOOK,
    Env,
    app_pod,
    control_plane,
    make_env,
    service_account_doc,
)
from tests.kube_real.rest import Rest

pytestmark = pytest.mark.integration

LABEL = "attestmesh.dev/inject"
SIM = {"attestmesh.dev/tee": "sim"}


@pytest.fixture(scope="module")
def env(
    cluster: Cluster, admin: Rest, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Env:
    out = make_env(cluster, admin, tmp_path_factory.mktemp("env"))
    for ns in ("kube-system", "attestmesh-system"):
        admin.apply(service_account_doc(ns, "web"))
    return out


async def create(admin: Rest, doc: dict[str, Any]) -> tuple[int, Any]:
    """POST through the server in a thread (it may call a webhook on this loop)."""
    return await asyncio.to_thread(
        admin.exact_status_of, "POST", admin.doc_path(doc, named=False), doc
    )


def labelled(name: str, ns: str, value: str = "enabled") -> dict[str, Any]:
    return app_pod(name, ns, labels={"app": "web", LABEL: value}, annotations=dict(SIM))


def test_the_stored_configuration_selects_by_labels_only(env: Env) -> None:
    hook = env.admin.get(
        "admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, WEBHOOK
    )
    by_name = {h["name"]: h for h in hook["webhooks"]}
    # 1.20 dropped matchConditions: what remains is what it evaluates
    assert all("matchConditions" not in h for h in hook["webhooks"])
    assert all(h["failurePolicy"] == "Fail" for h in hook["webhooks"])
    assert by_name["inject-pod.attestmesh.dev"]["objectSelector"] == {
        "matchExpressions": [{"key": LABEL, "operator": "In", "values": ["enabled"]}]
    }
    ns = env.admin.get("v1", "Namespace", None, "attestmesh-system")
    assert ns["metadata"]["labels"][LABEL] == "disabled"
    # what the kubernetes.io/metadata.name exclusion cannot do on 1.20
    assert "kubernetes.io/metadata.name" not in env.admin.get(
        "v1", "Namespace", None, "kube-system"
    )["metadata"].get("labels", {})


async def test_an_outage_refuses_only_opted_in_pods_and_up_it_mutates(
    env: Env, tmp_path: Path
) -> None:
    admin = env.admin
    # the webhook endpoint is down: make_env pointed it at a free port nobody listens on
    for doc in (
        app_pod("outage-plain", STORE),
        app_pod("outage-sys", "kube-system"),
        # annotation only: no longer an opt-in (lint flags it), the server does not call
        app_pod("outage-annotated", STORE, annotations={LABEL: "true", **SIM}),
        # the control-plane namespace, excluded by its label on every version
        labelled("outage-cp", "attestmesh-system"),
        # an opted-in namespace, the pod opted out by label
        labelled("outage-out", SHOP, "disabled"),
    ):
        status, body = await create(admin, doc)
        assert status == 201, (doc["metadata"], body)
        assert "initContainers" not in body["spec"], body

    for doc, webhook in (
        (labelled("outage-opted-pod", STORE), "inject-pod.attestmesh.dev"),
        (app_pod("outage-opted-ns", SHOP, annotations=dict(SIM)), "inject.attestmesh.dev"),
        # kube-system is excluded by kubernetes.io/metadata.name, a label 1.20 does not set:
        # there a pod that labels itself enabled is sent (and, the webhook down, refused)
        (labelled("outage-sys-opted", "kube-system"), "inject-pod.attestmesh.dev"),
    ):
        status, body = await create(admin, doc)
        assert status == 500, body
        assert f'failed calling webhook "{webhook}"' in body["message"], body["message"]
        name = doc["metadata"]["name"]
        ns = doc["metadata"]["namespace"]
        assert await asyncio.to_thread(admin.get_or_none, "v1", "Pod", ns, name) is None

    async with control_plane(env, tmp_path / "state"):
        status, body = await create(admin, labelled("outage-opted-up", STORE))
        # the webhook's patch reached the server: 1.20 validates the injected native sidecars
        # as run-to-completion init containers and refuses their probes (see
        # test_controlplane), which names containers only the webhook adds
        assert status == 422, body
        fields = sorted({c["field"] for c in body["details"]["causes"]})
        assert fields == [
            "spec.initContainers[1].startupProbe",
            "spec.initContainers[2].readinessProbe",
            "spec.initContainers[2].startupProbe",
        ], body
        # a plain pod is still not sent to it
        status, body = await create(admin, app_pod("outage-plain-up", STORE))
        assert status == 201 and "initContainers" not in body["spec"], body
        # on 1.20 a labelled kube-system pod is still sent (the namespaceSelector's
        # kubernetes.io/metadata.name exclusion needs 1.21), but the injector itself never
        # injects Kubernetes' own namespaces: allowed, stored unchanged
        status, body = await create(admin, labelled("outage-sys-up", "kube-system"))
        assert status == 201, body
        assert "initContainers" not in body["spec"], body
        assert "attestmesh.dev/injected" not in (body["metadata"].get("annotations") or {})
