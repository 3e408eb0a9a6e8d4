"""Shared helpers for the manifest tests: loading, schema validators, the device-plugin patch."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from tests.unit.manifests.kube_schemas import CrdVersion, parse_crd
from tests.vectors import REPO

MANIFESTS = REPO / "manifests"
SHARED_SCHEMAS = REPO.parent / "shared" / "schemas"
KARPENTER_CRDS = SHARED_SCHEMAS / "karpenter"
UPSTREAM_DEVICE_PLUGIN = SHARED_SCHEMAS / "nitro-device-plugin" / "aws-nitro-enclaves-k8s-ds.yaml"
DEVICE_PLUGIN_PATCH = MANIFESTS / "nodes" / "nitro" / "patches" / "device-plugin.yaml"
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# The newest Kubernetes schema set kubernetes-validate bundles (checked in a test).
KUBE_VERSION = "1.37"


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]


def manifest_files() -> list[Path]:
    """Every Kubernetes object file under manifests/ (kustomizations and patches excluded)."""
    return sorted(
        p
        for p in MANIFESTS.rglob("*.yaml")
        if p.name != "kustomization.yaml" and "patches" not in p.relative_to(MANIFESTS).parts
    )


def manifest_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in manifest_files():
        for i, doc in enumerate(load_yaml_docs(path)):
            meta = doc.get("metadata", {})
            yield f"{path.relative_to(MANIFESTS)}#{i}:{doc['kind']}/{meta.get('name')}", doc


def group_of(api_version: str) -> str:
    return api_version.rsplit("/", 1)[0] if "/" in api_version else ""


def is_core(api_version: str) -> bool:
    group = group_of(api_version)
    return group == "" or "." not in group or group.endswith(".k8s.io")


def _validators(paths: list[Path]) -> dict[tuple[str, str], tuple[CrdVersion, Any]]:
    out: dict[tuple[str, str], tuple[CrdVersion, Any]] = {}
    for path in paths:
        for doc in load_yaml_docs(path):
            for version in parse_crd(doc):
                jsonschema.Draft202012Validator.check_schema(version.schema)
                validator = jsonschema.Draft202012Validator(version.schema)
                out[(version.api_version, version.kind)] = (version, validator)
    return out


@cache
def karpenter_validators() -> dict[tuple[str, str], tuple[CrdVersion, Any]]:
    return _validators(sorted(KARPENTER_CRDS.glob("*.yaml")))


@cache
def project_validators() -> dict[tuple[str, str], tuple[CrdVersion, Any]]:
    return _validators(sorted((MANIFESTS / "crds").glob("*.yaml")))


def schema_errors(validator: Any, doc: Mapping[str, Any]) -> list[str]:
    return sorted(
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    )


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """The part of Kubernetes strategic-merge-patch semantics the device-plugin patch uses:
    maps merge recursively; containers, env, volumes and volumeMounts merge by ``name``;
    other lists (tolerations, args...) are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and key in {"containers", "initContainers", "env", "volumes", "volumeMounts"}
    ):
        merged = [copy.deepcopy(x) for x in base]
        for item in patch:
            names = [m.get("name") for m in merged]
            if item.get("name") in names:
                i = names.index(item["name"])
                merged[i] = strategic_merge(merged[i], item)
            else:
                merged.append(copy.deepcopy(item))
        return merged
    return copy.deepcopy(patch)


def upstream_device_plugin() -> dict[str, Any]:
    (ds,) = [d for d in load_yaml_docs(UPSTREAM_DEVICE_PLUGIN) if d["kind"] == "DaemonSet"]
    return ds


def patched_device_plugin(patch_path: Path = DEVICE_PLUGIN_PATCH) -> dict[str, Any]:
    (patch,) = load_yaml_docs(patch_path)
    merged: dict[str, Any] = strategic_merge(upstream_device_plugin(), patch)
    return merged
