"""manifests/ applied to a real kube-apiserver 1.20.2: every object it serves is stored, what it
cannot store is exactly what the README names, and the CRDs' structural schemas accept every
example resource and refuse schema mistakes with the server's own 422."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest

from tests.kube_real.install import (
    DROPPED_BY_1_20,
    MANIFESTS,
    NOT_SERVED_BY_1_20,
    Installed,
)
from tests.kube_real.rest import Rest, load_docs, wait_for

pytestmark = pytest.mark.integration


def test_manifests_install_and_only_the_named_gaps_remain(
    installed: Installed, admin: Rest
) -> None:
    assert installed.not_served == NOT_SERVED_BY_1_20
    kinds = {kind for _, kind, _ in installed.applied}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
        "Service",
        "MutatingWebhookConfiguration",
    } <= kinds
    # the fields 1.20 dropped are only the documented ones
    lost = {
        path.rsplit(".", 1)[-1].split("[")[0]
        for paths in installed.dropped.values()
        for path in paths
    }
    assert lost <= DROPPED_BY_1_20, installed.dropped
    assert set(installed.dropped) == {
        "CustomResourceDefinition/attestationpolicies.attestmesh.dev",
        "CustomResourceDefinition/meshpolicies.attestmesh.dev",
        "MutatingWebhookConfiguration/attestmesh-sidecar-injector",
    }, installed.dropped
    # the CRDs are established: their API is served
    for crd in ("attestationpolicies.attestmesh.dev", "meshpolicies.attestmesh.dev"):
        obj = admin.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, crd)
        conds = {c["type"]: c["status"] for c in obj["status"]["conditions"]}
        assert conds.get("Established") == "True" and conds.get("NamesAccepted") == "True"
    # the Deployment passes the server's validation of a pod template (it was stored)
    dep = admin.get("apps/v1", "Deployment", "attestmesh-system", "attestmesh-controlplane")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "attestmesh-controlplane"


def examples() -> list[dict[str, Any]]:
    return load_docs(
        [
            MANIFESTS / "examples" / "attestationpolicies.yaml",
            MANIFESTS / "examples" / "meshpolicies.yaml",
        ]
    )


def test_every_example_resource_is_accepted(installed: Installed, admin: Rest) -> None:
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
    for doc in examples():
        stored = wait_for(partial(admin.apply, doc), 10, f"{doc['kind']} {doc['metadata']['name']}")
        assert stored["spec"] == doc["spec"], doc["metadata"]["name"]  # nothing pruned


@pytest.mark.parametrize(
    ("kind", "mutate", "needle"),
    [
        ("AttestationPolicy", lambda s: s.update(mode="observe"), "spec.mode"),
        (
            "AttestationPolicy",
            lambda s: s.update(allowedTees=["sim", "quantum"]),
            "spec.allowedTees",
        ),
        ("AttestationPolicy", lambda s: s.pop("selector"), "spec.selector"),
        ("AttestationPolicy", lambda s: s.update(certificateTTL=3600), "spec.certificateTTL"),
        ("MeshPolicy", lambda s: s.pop("destination"), "spec.destination"),
    ],
)
def test_schema_mistakes_are_refused_by_the_server(
    installed: Installed, admin: Rest, kind: str, mutate: Any, needle: str
) -> None:
    admin.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
    doc = copy.deepcopy(next(d for d in examples() if d["kind"] == kind))
    doc["metadata"]["name"] = "broken"
    mutate(doc["spec"])
    status, body = admin.status_of("POST", admin.doc_path(doc, named=False), doc)
    assert status == 422, body
    assert body["reason"] == "Invalid" and needle in body["message"], body["message"]
