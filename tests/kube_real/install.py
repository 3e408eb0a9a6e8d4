"""Apply the project's manifests/ to a real API server and report what it could not take.

What kube-apiserver 1.20 cannot store (README, "Testing against real API servers"; these stay
covered by the schema validation in tests/unit/manifests):

- kinds it does not serve: ValidatingAdmissionPolicy and its Binding (admissionregistration
  v1, Kubernetes 1.30), PodDisruptionBudget policy/v1 (1.21; 1.20 has policy/v1beta1);
- fields it drops silently (1.20 has no server-side field validation): the CRDs' CEL rules
  (``x-kubernetes-validations``, 1.25) and the webhooks' ``matchConditions`` (1.27).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from tests.kube_real.rest import Rest, load_docs
from tests.vectors import REPO

MANIFESTS = REPO / "manifests"
INSTALL_FILES = (
    MANIFESTS / "crds" / "attestationpolicies.attestmesh.dev.yaml",
    MANIFESTS / "crds" / "meshpolicies.attestmesh.dev.yaml",
    MANIFESTS / "base" / "namespace.yaml",
    MANIFESTS / "base" / "rbac.yaml",
    MANIFESTS / "base" / "controlplane.yaml",
    MANIFESTS / "base" / "webhook.yaml",
)
# (apiVersion, kind) kube-apiserver 1.20 does not serve
NOT_SERVED_BY_1_20 = {
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"),
    ("policy/v1", "PodDisruptionBudget"),
}
# the last key of every field path 1.20 drops
DROPPED_BY_1_20 = {"x-kubernetes-validations", "matchConditions"}


@dataclass
class Installed:
    applied: list[tuple[str, str, str]] = field(default_factory=list)  # (apiVersion, kind, name)
    not_served: set[tuple[str, str]] = field(default_factory=set)
    dropped: dict[str, list[str]] = field(default_factory=dict)  # "Kind/name" -> field paths


def dropped_fields(sent: Any, stored: Any, path: str = "") -> Iterator[str]:
    """Paths present in ``sent`` and absent from ``stored`` (what the server dropped)."""
    if isinstance(sent, Mapping):
        if not isinstance(stored, Mapping):
            return
        for key, value in sent.items():
            sub = f"{path}.{key}"
            if key not in stored:
                yield sub
            else:
                yield from dropped_fields(value, stored[key], sub)
    elif isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        for i, (a, b) in enumerate(zip(sent, stored, strict=True)):
            yield from dropped_fields(a, b, f"{path}[{i}]")


def install(rest: Rest, docs: list[dict[str, Any]] | None = None) -> Installed:
    out = Installed()
    for doc in docs if docs is not None else load_docs(INSTALL_FILES):
        key = (doc["apiVersion"], doc["kind"])
        try:
            stored = rest.apply(doc)
        except LookupError:
            out.not_served.add(key)
            continue
        except ApiException as exc:
            raise AssertionError(
                f"{key} {doc['metadata']['name']}: {exc.status} {exc.body}"
            ) from None
        out.applied.append((*key, doc["metadata"]["name"]))
        lost = list(dropped_fields(doc, stored))
        if lost:
            out.dropped[f"{doc['kind']}/{doc['metadata']['name']}"] = lost
        if doc["kind"] == "CustomResourceDefinition":
            rest.forget_discovery()
    return out
