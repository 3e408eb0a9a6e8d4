"""manifests/ applied to a real kube-apiserver 1.20.2: every object it serves is stored, what it
cannot store is exactly what the README names (and is validated against the current schemas
instead), and the CRDs' structural schemas accept every example resource and refuse schema
mistakes with the server's own 422."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import kubernetes_validate
import pytest

from sidecar.inject import Decision, InjectConfig, SimInjection, mutate
from tests.component.test_kube_adapter import slice_obj
from tests.component.test_kube_mode import endpoint_slice
from tests.kube_real.install import (
    DROPPED_BY_1_20,
    INSTALL_FILES,
    MANIFESTS,
    NOT_SERVED_BY_1_20,
    Installed,
)
from tests.kube_real.plane import GOOD, SHOP, app_pod
from tests.kube_real.rest import Rest, load_docs, wait_for
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.manifests.helpers import KUBE_VERSION

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


def test_what_1_20_cannot_store_is_covered_by_schema_validation(installed: Installed) -> None:
    """The three gaps README names (Testing against real Kubernetes API servers), each validated
    strictly against the current Kubernetes schemas instead: the kinds 1.20 does not serve
    (exactly those ``install`` found unserved), the injected pod's native sidecars (1.20 drops
    ``restartPolicy: Always``), and the discovery.k8s.io/v1 EndpointSlices the fake-server
    tests feed the control plane."""
    assert installed.not_served == NOT_SERVED_BY_1_20
    unserved = [d for d in load_docs(INSTALL_FILES) if (d["apiVersion"], d["kind"]) in
                NOT_SERVED_BY_1_20]  # fmt: skip
    assert {(d["apiVersion"], d["kind"]) for d in unserved} == NOT_SERVED_BY_1_20
    for doc in unserved:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)

    pod = app_pod("web-0", SHOP, annotations={"attestmesh.dev/tee": "sim"})
    cfg = InjectConfig(sim=SimInjection(GOOD.hex()), trust_domain="attestmesh.local")
    result = mutate(pod, {"attestmesh.dev/inject": "enabled"}, cfg)
    assert result.decision is Decision.INJECTED, result.message
    injected = apply_patch(pod, [dict(op) for op in result.patch])
    sidecars = [c["name"] for c in injected["spec"]["initContainers"]
                if c.get("restartPolicy") == "Always"]  # fmt: skip
    assert len(sidecars) == 2, sidecars  # the agent and Envoy
    kubernetes_validate.validate(injected, KUBE_VERSION, strict=True)

    slices = [
        endpoint_slice(True),
        endpoint_slice(False),
        slice_obj("billing-a", "billing", {"web-0": {"ready": True, "terminating": True}}),
    ]
    for doc in slices:
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)

    # and the validation does refuse: an unknown field in each
    for doc in (unserved[0], injected, slices[0]):
        broken = copy.deepcopy(doc)
        broken["spec" if "spec" in broken else "endpoints"] = (
            {**broken["spec"], "bogusField": 1} if "spec" in broken else [{"addresses": 1}]
        )
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)
