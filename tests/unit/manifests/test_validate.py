"""Every manifest validates: core kinds against the Kubernetes schemas (kubernetes-validate,
strict), Karpenter kinds against ../shared/schemas/karpenter, the project's CRs against its
own CRDs, NFD rules against a small local schema; and the examples parse with the project's
policy parsers."""

from __future__ import annotations

import copy
import socket
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from certs.errors import PolicyError
from certs.evidence.claims import Tee
from certs.policy import parse_policies, policies_for
from tests.unit.manifests.helpers import (
    KUBE_VERSION,
    MANIFESTS,
    group_of,
    is_core,
    karpenter_validators,
    load_yaml_docs,
    manifest_docs,
    patched_device_plugin,
    project_validators,
    schema_errors,
    upstream_device_plugin,
)
from tests.unit.manifests.kube_schemas import build_json_schema, parse_crd, structural_problems
from xds.meshpolicy import parse_mesh_policies

DOCS = list(manifest_docs())
KARPENTER_GROUPS = {"karpenter.sh", "karpenter.k8s.aws"}
PROJECT_GROUP = "attestmesh.dev"
NFD_GROUP = "nfd.k8s-sigs.io"


def _ids(docs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in docs]


CORE = [(n, d) for n, d in DOCS if is_core(d["apiVersion"])]
KARPENTER = [(n, d) for n, d in DOCS if group_of(d["apiVersion"]) in KARPENTER_GROUPS]
PROJECT = [(n, d) for n, d in DOCS if group_of(d["apiVersion"]) == PROJECT_GROUP]
NFD = [(n, d) for n, d in DOCS if group_of(d["apiVersion"]) == NFD_GROUP]
MONITORING_GROUP = "monitoring.coreos.com"
MONITORING = [(n, d) for n, d in DOCS if group_of(d["apiVersion"]) == MONITORING_GROUP]

_LABEL_KEY = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)

# NodeFeatureRule (nfd.k8s-sigs.io/v1alpha1): no CRD is shipped in ../shared/schemas, so this
# is the subset of its API the project uses, written from NFD's documentation.
_NFD_EXPRESSION = {
    "type": "object",
    "required": ["op"],
    "additionalProperties": False,
    "properties": {
        "op": {
            "enum": [
                "In",
                "NotIn",
                "InRegexp",
                "Exists",
                "DoesNotExist",
                "Gt",
                "Lt",
                "GtLt",
                "IsTrue",
                "IsFalse",
            ]
        },
        "value": {"type": "array", "items": {"type": "string"}},
    },
    "allOf": [
        {
            "if": {"properties": {"op": {"enum": ["Exists", "DoesNotExist", "IsTrue", "IsFalse"]}}},
            "then": {"not": {"required": ["value"]}},
            "else": {"required": ["value"]},
        }
    ],
}
NFD_RULE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "nfd.k8s-sigs.io/v1alpha1"},
        "kind": {"const": "NodeFeatureRule"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"}
            },
        },
        "spec": {
            "type": "object",
            "required": ["rules"],
            "additionalProperties": False,
            "properties": {
                "rules": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "matchFeatures"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "labels": {
                                "type": "object",
                                "minProperties": 1,
                                "propertyNames": {"pattern": _LABEL_KEY},
                                "additionalProperties": {"type": "string", "maxLength": 63},
                            },
                            "taints": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["key", "effect"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "key": {"type": "string", "pattern": _LABEL_KEY},
                                        "value": {"type": "string", "maxLength": 63},
                                        "effect": {
                                            "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]
                                        },
                                    },
                                },
                            },
                            "matchFeatures": {
                                "type": "array",
                                "minItems": 1,
                                "items": {
                                    "type": "object",
                                    "required": ["feature", "matchExpressions"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "feature": {
                                            "enum": [
                                                "cpu.cpuid",
                                                "cpu.security",
                                                "kernel.config",
                                                "kernel.loadedmodule",
                                                "kernel.enabledmodule",
                                                "pci.device",
                                            ]
                                        },
                                        "matchExpressions": {
                                            "type": "object",
                                            "minProperties": 1,
                                            "additionalProperties": _NFD_EXPRESSION,
                                        },
                                    },
                                },
                            },
                        },
                    },
                }
            },
        },
    },
}


# ------------------------------------------------------------------------------------------
# coverage and the validators themselves


def test_every_document_is_covered_by_a_validator() -> None:
    assert DOCS, "no manifests found"
    covered = {n for n, _ in CORE + KARPENTER + PROJECT + NFD + MONITORING}
    assert covered == {n for n, _ in DOCS}
    kinds = {d["kind"] for _, d in DOCS}
    assert {
        "CustomResourceDefinition",
        "Namespace",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "ClusterRole",
        "MutatingWebhookConfiguration",
        "EC2NodeClass",
        "NodePool",
        "NodeOverlay",
        "NodeFeatureRule",
        "AttestationPolicy",
        "MeshPolicy",
        "PrometheusRule",
    } <= kinds


def test_kubernetes_validate_bundles_the_pinned_version() -> None:
    latest = kubernetes_validate.latest_version()
    assert latest.startswith(KUBE_VERSION + ".") or latest == KUBE_VERSION


def test_kubernetes_validate_works_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    _, doc = next((n, d) for n, d in CORE if d["kind"] == "Deployment")
    assert kubernetes_validate.validate(doc, KUBE_VERSION, strict=True) == KUBE_VERSION


# ------------------------------------------------------------------------------------------
# core kinds


@pytest.mark.parametrize("doc", [d for _, d in CORE], ids=_ids(CORE))
def test_core_kind_validates_strictly(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_strict_core_validation_rejects_unknown_fields() -> None:
    _, doc = next((n, d) for n, d in CORE if d["kind"] == "Deployment")
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_patched_device_plugin_validates_and_carries_the_guide_patch() -> None:
    upstream = upstream_device_plugin()
    assert "tolerations" not in upstream["spec"]["template"]["spec"]
    ds = patched_device_plugin()
    kubernetes_validate.validate(ds, KUBE_VERSION, strict=True)
    spec = ds["spec"]["template"]["spec"]
    assert spec["tolerations"] == [
        {
            "key": "aws-nitro-enclaves-k8s-dp",
            "operator": "Equal",
            "value": "enabled",
            "effect": "NoSchedule",
        }
    ]
    (container,) = spec["containers"]
    assert {"name": "ENCLAVE_CPU_ADVERTISEMENT", "value": "true"} in container["env"]
    # The merge kept everything upstream had (image, mounts, node selector).
    assert container["image"] == upstream["spec"]["template"]["spec"]["containers"][0]["image"]
    assert spec["nodeSelector"] == {"aws-nitro-enclaves-k8s-dp": "enabled"}
    assert len(container["volumeMounts"]) == 3


# ------------------------------------------------------------------------------------------
# Karpenter kinds


@pytest.mark.parametrize("doc", [d for _, d in KARPENTER], ids=_ids(KARPENTER))
def test_karpenter_kind_validates_against_its_crd(doc: dict[str, Any]) -> None:
    version, validator = karpenter_validators()[(doc["apiVersion"], doc["kind"])]
    assert not version.namespaced
    assert "namespace" not in doc["metadata"]
    assert schema_errors(validator, doc) == []


def _karpenter(kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for _, d in KARPENTER if d["kind"] == kind))


@pytest.mark.parametrize(
    ("kind", "mutate", "where"),
    [
        (
            "EC2NodeClass",
            lambda d: d["spec"]["enclaveOptions"].pop("enabled"),
            "spec.enclaveOptions",
        ),
        ("EC2NodeClass", lambda d: d["spec"]["enclaveOptions"].update(enabled="yes"), "enabled"),
        ("EC2NodeClass", lambda d: d["spec"].pop("subnetSelectorTerms"), "spec"),
        (
            "NodeOverlay",
            lambda d: d["spec"]["capacity"].update({"hugepages-1Gi": "4 GiB"}),
            "capacity",
        ),
        (
            "NodeOverlay",
            lambda d: d["spec"]["requirements"][0].update(operator="Above"),
            "operator",
        ),
        ("NodeOverlay", lambda d: d["spec"].update(capacities={}), "spec"),
        (
            "NodePool",
            lambda d: d["spec"]["template"]["spec"]["taints"][0].update(effect="Never"),
            "effect",
        ),
        ("NodePool", lambda d: d["spec"]["template"]["spec"].pop("nodeClassRef"), "spec"),
    ],
)
def test_karpenter_schemas_reject_broken_objects(kind: str, mutate: Any, where: str) -> None:
    doc = _karpenter(kind)
    mutate(doc)
    _, validator = karpenter_validators()[(doc["apiVersion"], kind)]
    errors = schema_errors(validator, doc)
    assert errors and any(where in e for e in errors), errors


# ------------------------------------------------------------------------------------------
# the project's CRDs and CRs


def _crds() -> list[dict[str, Any]]:
    return [d for _, d in CORE if d["kind"] == "CustomResourceDefinition"]


def test_project_crds_are_structural_with_status_and_printer_columns() -> None:
    crds = {d["spec"]["names"]["kind"]: d for d in _crds()}
    assert set(crds) == {"AttestationPolicy", "MeshPolicy", "SecretPolicy"}
    for kind, crd in crds.items():
        assert crd["spec"]["group"] == PROJECT_GROUP
        assert crd["spec"]["scope"] == "Namespaced"
        (version,) = crd["spec"]["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
        assert version["subresources"] == {"status": {}}
        columns = {c["name"] for c in version["additionalPrinterColumns"]}
        assert {"Accepted", "Age"} <= columns, kind
        assert "Mode" in columns or kind == "SecretPolicy", kind  # a SecretPolicy has no mode
        schema = version["schema"]["openAPIV3Schema"]
        assert structural_problems(schema) == []
        condition = schema["properties"]["status"]["properties"]["conditions"]["items"]
        assert set(condition["properties"]) == {
            "type",
            "status",
            "reason",
            "message",
            "lastTransitionTime",
            "observedGeneration",
        }
        assert parse_crd(crd)[0].cel_rules  # server-side cross-field rules exist


@pytest.mark.parametrize("doc", [d for _, d in PROJECT], ids=_ids(PROJECT))
def test_project_cr_validates_against_its_crd(doc: dict[str, Any]) -> None:
    version, validator = project_validators()[(doc["apiVersion"], doc["kind"])]
    assert version.namespaced and doc["metadata"].get("namespace")
    assert schema_errors(validator, doc) == []


def _policies() -> list[dict[str, Any]]:
    return [d for _, d in PROJECT if d["kind"] == "AttestationPolicy"]


def _mesh_policies() -> list[dict[str, Any]]:
    return [d for _, d in PROJECT if d["kind"] == "MeshPolicy"]


def test_example_attestation_policies_parse_and_cover_every_tee() -> None:
    parsed = parse_policies(_policies())
    assert {t for p in parsed for t in p.allowed_tees} == set(Tee)
    by_name = {p.name: p for p in parsed}
    nitro = by_name["demo/nitro-enclave"].reference_values[Tee.NITRO]
    assert set(nitro.measurements) == {"pcr0", "pcr1", "pcr2", "pcr8"}
    snp = by_name["demo/sev-snp-cvm"].reference_values[Tee.SEV_SNP]
    assert snp.minimum_tcb == {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115}
    gpu = by_name["demo/nvidia-gpu"].reference_values[Tee.NVIDIA_GPU]
    assert set(gpu.measurements) == {"measurement_2", "measurement_3"}


def test_example_mesh_policies_parse() -> None:
    parsed = parse_mesh_policies(_mesh_policies())
    assert {p.destination_service_account for p in parsed} == {"enclave-app", "snp-app"}


def test_every_example_workload_is_governed_by_an_attestation_policy() -> None:
    parsed = parse_policies(_policies())
    workloads = [
        d for _, d in CORE if d["kind"] == "Deployment" and d["metadata"].get("namespace") == "demo"
    ]
    assert len(workloads) == 6
    for w in workloads:
        template = w["spec"]["template"]
        governing = policies_for(
            parsed,
            w["metadata"]["namespace"],
            template["spec"]["serviceAccountName"],
            template["metadata"].get("labels", {}),
        )
        assert governing, w["metadata"]["name"]


def _set(path: str, value: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


def _drop(path: str) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = doc
        for p in parents:
            node = node[p]
        del node[last]

    return mutate


# Mutations of the example policies that both the CRD schema and the parser must reject:
# the CRD and certs/policy.py describe the same document.
POLICY_MUTATIONS = {
    "unknown-spec-field": ("nitro-enclave", _set("spec.allowDebugging", True)),
    "unknown-tee": ("nitro-enclave", _set("spec.allowedTees", ["sev"])),
    "empty-tees": ("nitro-enclave", _set("spec.allowedTees", [])),
    "odd-hex": ("nitro-enclave", _set("spec.referenceValues.nitro.pcr0", ["abc"])),
    "non-hex": ("nitro-enclave", _set("spec.referenceValues.nitro.pcr0", ["zz"])),
    "empty-hex-list": ("nitro-enclave", _set("spec.referenceValues.nitro.pcr1", [])),
    "unknown-pcr": ("nitro-enclave", _set("spec.referenceValues.nitro.pcr7", ["00"])),
    "bad-mode": ("nitro-enclave", _set("spec.mode", "permissive")),
    "bad-on-failure": ("nitro-enclave", _set("spec.onFailure", "evict")),
    "bad-duration": ("nitro-enclave", _set("spec.certificateTTL", "1d")),
    "debug-not-bool": ("nitro-enclave", _set("spec.allowDebug", "no")),
    "empty-selector": ("nitro-enclave", _set("spec.selector", {})),
    "selector-unknown": ("nitro-enclave", _set("spec.selector", {"namespaces": ["x"]})),
    "labels-not-strings": ("sev-snp-cvm", _set("spec.selector.matchLabels", {"a": 1})),
    "unknown-section": ("nitro-enclave", _set("spec.referenceValues.sev", {"x": ["00"]})),
    "snp-tcb-unknown": ("sev-snp-cvm", _set("spec.referenceValues.sevSnp.minimumTcb.fmc", 1)),
    "snp-tcb-negative": ("sev-snp-cvm", _set("spec.referenceValues.sevSnp.minimumTcb.snp", -1)),
    "snp-svn-string": ("sev-snp-cvm", _set("spec.referenceValues.sevSnp.minimumGuestSvn", "4")),
    "snp-smt-string": ("sev-snp-cvm", _set("spec.referenceValues.sevSnp.allowSmt", "true")),
    "tdx-status": ("tdx-td", _set("spec.referenceValues.tdx.acceptedTcbStatuses", ["Fine"])),
    "tdx-mrowner": ("tdx-td", _set("spec.referenceValues.tdx.mrowner", ["00"])),
    "sgx-product-string": ("sgx-enclave", _set("spec.referenceValues.sgx.productId", "0")),
    "sgx-in-tdx-field": ("sgx-enclave", _set("spec.referenceValues.sgx.mrtd", ["00"])),
    "sim-no-measurement": ("sim-dev", _set("spec.referenceValues.sim", {})),
    "gpu-no-measurements": ("nvidia-gpu", _set("spec.referenceValues.nvidiaGpu", {})),
    "gpu-bad-values": (
        "nvidia-gpu",
        _set("spec.referenceValues.nvidiaGpu.measurements", {"2": "00"}),
    ),
    "no-spec": ("nitro-enclave", _drop("spec")),
    "bad-on-tcb-change": ("tdx-td", _set("spec.onTcbChange", "evict")),
    "grace-bad-duration": ("tdx-td", _set("spec.tcbChangeGracePeriod", "2d")),
    "requires-unknown-tee": ("tdx-td", _set("spec.requires", ["h100"])),
    "requires-empty": ("tdx-td", _set("spec.requires", [])),
    "requires-not-a-list": ("tdx-td", _set("spec.requires", "tdx")),
}


@pytest.mark.parametrize("case", sorted(POLICY_MUTATIONS))
def test_policy_crd_and_parser_reject_the_same_mistakes(case: str) -> None:
    name, mutate = POLICY_MUTATIONS[case]
    doc = copy.deepcopy(next(d for d in _policies() if d["metadata"]["name"] == name))
    mutate(doc)
    _, validator = project_validators()[(doc["apiVersion"], doc["kind"])]
    assert schema_errors(validator, doc), f"CRD schema accepted {case}"
    with pytest.raises(PolicyError):
        parse_policies([doc])


MESH_MUTATIONS = {
    "no-destination": ("enclave-app-callers", _drop("spec.destination")),
    "no-rules": ("enclave-app-callers", _set("spec.rules", [])),
    "empty-from": ("enclave-app-callers", _set("spec.rules.0.from", [])),
    "identity-not-spiffe": (
        "enclave-app-callers",
        _set("spec.rules.1.from.0.identity", "https://x"),
    ),
    "identity-and-sa": (
        "enclave-app-callers",
        _set("spec.rules.1.from.0", {"identity": "spiffe://a/b", "serviceAccount": "x"}),
    ),
    "source-unknown-field": ("enclave-app-callers", _set("spec.rules.0.from.0", {"sa": "x"})),
    "bad-method": ("enclave-app-callers", _set("spec.rules.0.to.0.methods", ["FETCH"])),
    "bad-port": ("enclave-app-callers", _set("spec.rules.0.to.0.ports", [0])),
    "relative-path": ("enclave-app-callers", _set("spec.rules.0.to.0.paths", ["v1/"])),
    "bad-tee": ("enclave-app-callers", _set("spec.rules.0.whenClaims.tees", ["sev"])),
    "empty-claims": ("enclave-app-callers", _set("spec.rules.0.whenClaims", {})),
    "claims-not-hex": (
        "enclave-app-callers",
        _set("spec.rules.0.whenClaims.measurements", {"measurement": ["xyz"]}),
    ),
    "bad-mode": ("snp-app-callers", _set("spec.mode", "dry-run")),
    "unknown-rule-field": ("snp-app-callers", _set("spec.rules.0.when", {})),
}


@pytest.mark.parametrize("case", sorted(MESH_MUTATIONS))
def test_mesh_crd_and_parser_reject_the_same_mistakes(case: str) -> None:
    name, mutate = MESH_MUTATIONS[case]
    doc = copy.deepcopy(next(d for d in _mesh_policies() if d["metadata"]["name"] == name))
    mutate(doc)
    _, validator = project_validators()[(doc["apiVersion"], doc["kind"])]
    assert schema_errors(validator, doc), f"CRD schema accepted {case}"
    with pytest.raises(PolicyError):
        parse_mesh_policies([doc])


# ------------------------------------------------------------------------------------------
# Node Feature Discovery


def test_nfd_rules_validate_and_label_each_tee_host() -> None:
    jsonschema.Draft202012Validator.check_schema(NFD_RULE_SCHEMA)
    validator = jsonschema.Draft202012Validator(NFD_RULE_SCHEMA)
    labels: set[str] = set()
    for _, doc in NFD:
        assert schema_errors(validator, doc) == []
        for rule in doc["spec"]["rules"]:
            labels |= set(rule["labels"])
    assert labels == {
        "attestmesh.dev/tee-host.sev-snp",
        "attestmesh.dev/tee-host.tdx",
        "attestmesh.dev/tee-host.sgx",
    }
    # The CVM and SGX examples select exactly these labels.
    selected = {
        k
        for _, d in CORE
        if d["kind"] == "Deployment"
        for k in d["spec"]["template"]["spec"].get("nodeSelector", {})
    }
    assert selected <= labels | {"attestmesh.dev/tee-host.nitro"}


def test_nfd_schema_rejects_a_broken_rule() -> None:
    validator = jsonschema.Draft202012Validator(NFD_RULE_SCHEMA)
    _, doc = NFD[0]
    bad = copy.deepcopy(doc)
    bad["spec"]["rules"][0]["matchFeatures"][0]["matchExpressions"] = {
        "sev.snp.enabled": {"op": "IsTrue", "value": ["true"]}
    }
    assert schema_errors(validator, bad)
    bad["spec"]["rules"][0]["matchAll"] = []
    assert any("matchAll" in e for e in schema_errors(validator, bad))


# ------------------------------------------------------------------------------------------
# the schema conversion itself


def test_conversion_handles_nullable_int_or_string_and_unknown_fields() -> None:
    schema = build_json_schema(
        {
            "type": "object",
            "properties": {
                "metadata": {"type": "object"},
                "a": {"type": "string", "nullable": True},
                "b": {"x-kubernetes-int-or-string": True, "pattern": "^[0-9]+%?$"},
                "c": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "d": {"type": "integer", "minimum": 0, "exclusiveMinimum": True},
            },
        }
    )
    v = jsonschema.Draft202012Validator(schema)
    assert not list(v.iter_errors({"metadata": {"x": 1}, "a": None, "b": 3, "c": {"z": 1}}))
    assert not list(v.iter_errors({"b": "50%", "d": 1}))
    assert list(v.iter_errors({"unknown": 1}))
    assert list(v.iter_errors({"d": 0}))


def test_every_manifest_file_loads_as_yaml() -> None:
    files = {p.relative_to(MANIFESTS).as_posix() for p in MANIFESTS.rglob("*.yaml")}
    assert "nodes/nitro/patches/device-plugin.yaml" in files
    for f in files:
        assert load_yaml_docs(MANIFESTS / f)


# ------------------------------------------------------------------------------------------
# PrometheusRule (monitoring.coreos.com/v1): no CRD is shipped in ../shared/schemas, so this is
# the subset of the Prometheus Operator's API the project uses, written from its documentation.
# The expressions themselves are checked by promtool (tests/unit/test_observability.py).

_PROM_RULE = {
    "type": "object",
    "required": ["expr"],
    "additionalProperties": False,
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string", "minLength": 1},
        "record": {"type": "string", "minLength": 1},
        "expr": {"type": "string", "minLength": 1},
        "for": {"type": "string", "pattern": r"^(\d+[smhdwy])+$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["groups"],
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["name", "rules"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": {"type": "string"},
                            "rules": {"type": "array", "minItems": 1, "items": _PROM_RULE},
                        },
                    },
                }
            },
        },
    },
}


def test_prometheus_rules_validate_and_a_broken_one_does_not() -> None:
    jsonschema.Draft202012Validator.check_schema(PROMETHEUS_RULE_SCHEMA)
    validator = jsonschema.Draft202012Validator(PROMETHEUS_RULE_SCHEMA)
    assert MONITORING, "no PrometheusRule under manifests/"
    for _, doc in MONITORING:
        assert schema_errors(validator, doc) == []
    broken = copy.deepcopy(MONITORING[0][1])
    broken["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    del broken["spec"]["groups"][0]["rules"][1]["expr"]
    assert len(schema_errors(validator, broken)) >= 2
