"""The CEL rules (x-kubernetes-validations) of the project's CRDs, evaluated offline with
cel-python: every example CR satisfies them, and each cross-field mistake they exist for is
rejected by both the rule and the parser (certs/policy.py, xds/meshpolicy.py)."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import celpy  # a declared test dependency: missing means failing, never skipping
import pytest

from certs.errors import PolicyError
from certs.policy import parse_policies
from tests.unit.manifests.helpers import MANIFESTS, load_yaml_docs
from xds.meshpolicy import parse_mesh_policies

CRDS = {
    d["spec"]["names"]["kind"]: d["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for p in sorted((MANIFESTS / "crds").glob("*.yaml"))
    for d in load_yaml_docs(p)
}
EXAMPLES = [
    d
    for name in ("attestationpolicies.yaml", "meshpolicies.yaml")
    for d in load_yaml_docs(MANIFESTS / "examples" / name)
]
_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def _rules_at(schema: Mapping[str, Any], value: Any, where: str) -> Iterator[tuple[str, str, Any]]:
    for rule in schema.get("x-kubernetes-validations", ()):
        yield where, rule["rule"], value
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield from _rules_at(sub, value[name], f"{where}.{name}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name, item in value.items():
                yield from _rules_at(extra, item, f"{where}.{name}")
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(value):
            yield from _rules_at(schema["items"], item, f"{where}[{i}]")


def cel_violations(doc: Mapping[str, Any]) -> list[str]:
    out = []
    for where, rule, value in _rules_at(CRDS[doc["kind"]], doc, "<root>"):
        result = _program(rule).evaluate({"self": celpy.json_to_cel(value)})
        if not isinstance(result, celpy.celtypes.BoolType) or not bool(result):
            out.append(f"{where}: {rule}")
    return out


def test_every_crd_rule_compiles() -> None:
    count = 0
    for schema in CRDS.values():
        stack: list[Any] = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, Mapping):
                for rule in node.get("x-kubernetes-validations", ()):
                    _program(rule["rule"])
                    count += 1
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    assert count >= 10


@pytest.mark.parametrize("doc", EXAMPLES, ids=[d["metadata"]["name"] for d in EXAMPLES])
def test_examples_satisfy_every_cel_rule(doc: dict[str, Any]) -> None:
    assert cel_violations(doc) == []


def _policy(name: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for d in EXAMPLES if d["metadata"]["name"] == name))


def test_allowed_tee_without_reference_values_is_rejected_by_rule_and_parser() -> None:
    doc = _policy("nitro-enclave")
    doc["spec"]["allowedTees"].append("tdx")
    assert any("tdx" in v for v in cel_violations(doc))
    with pytest.raises(PolicyError, match="required because tdx is allowed"):
        parse_policies([doc])


@pytest.mark.parametrize(
    ("ttl", "interval", "ok"),
    [("1h", "30m", True), ("10m", "30m", False), (None, "2h", False), (None, "1h", True)],
)
def test_reattestation_interval_within_ttl(ttl: str | None, interval: str, ok: bool) -> None:
    doc = _policy("nitro-enclave")
    doc["spec"].pop("certificateTTL")
    if ttl is not None:
        doc["spec"]["certificateTTL"] = ttl
    doc["spec"]["reattestationInterval"] = interval
    assert (cel_violations(doc) == []) is ok
    if ok:
        parse_policies([doc])
    else:
        with pytest.raises(PolicyError, match="must not exceed certificateTTL"):
            parse_policies([doc])


@pytest.mark.parametrize(
    ("name", "section", "keep"),
    [
        ("sev-snp-cvm", "sevSnp", {"minimumTcb", "minimumGuestSvn"}),
        ("tdx-td", "tdx", {"acceptedTcbStatuses"}),
        ("sgx-enclave", "sgx", {"productId", "acceptedTcbStatuses"}),
    ],
)
def test_section_without_measurements_is_rejected(name: str, section: str, keep: set[str]) -> None:
    doc = _policy(name)
    ref = doc["spec"]["referenceValues"][section]
    doc["spec"]["referenceValues"][section] = {k: v for k, v in ref.items() if k in keep}
    assert cel_violations(doc)
    with pytest.raises(PolicyError, match="at least one reference measurement"):
        parse_policies([doc])


def test_gpu_measurement_keys_must_be_indexes() -> None:
    doc = _policy("nvidia-gpu")
    doc["spec"]["referenceValues"]["nvidiaGpu"]["measurements"]["fw"] = ["00"]
    assert cel_violations(doc)
    with pytest.raises(PolicyError, match="index must be a number"):
        parse_policies([doc])


def test_identity_with_namespace_is_rejected_by_rule_and_parser() -> None:
    doc = _policy("enclave-app-callers")
    doc["spec"]["rules"][1]["from"][0]["namespace"] = "demo"
    assert cel_violations(doc)
    with pytest.raises(PolicyError, match="identity must stand alone"):
        parse_mesh_policies([doc])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tcbChangeGracePeriod": "10m"}, "only applies with onTcbChange: quarantine"),
        ({"onTcbChange": "audit", "tcbChangeGracePeriod": "1h"}, "only applies with"),
        ({"onTcbChange": "quarantine", "tcbChangeGracePeriod": "721h"}, "must not exceed 720h"),
        ({"requires": ["tdx", "nvidia-gpu"]}, "nvidia-gpu is required but not in allowedTees"),
        ({"allowedTees": ["tdx", "sgx"], "requires": ["tdx", "sgx"]}, "at most one CPU TEE"),
        ({"allowedTees": ["tdx", "nvidia-gpu"], "requires": ["nvidia-gpu"]}, "needs a CPU TEE"),
    ],
)
def test_tcb_change_and_requires_rules(changes: dict[str, Any], message: str) -> None:
    doc = _policy("tdx-td")
    if "nvidia-gpu" in changes.get("allowedTees", ()):
        doc["spec"]["referenceValues"]["nvidiaGpu"] = {"measurements": {"2": ["00" * 48]}}
    if "sgx" in changes.get("allowedTees", ()):
        doc["spec"]["referenceValues"]["sgx"] = {"mrenclave": ["00" * 32]}
    doc["spec"].update(changes)
    assert cel_violations(doc)
    with pytest.raises(PolicyError, match=message):
        parse_policies([doc])


@pytest.mark.parametrize(
    "changes",
    [
        {"onTcbChange": "quarantine", "tcbChangeGracePeriod": "24h"},
        {"onTcbChange": "audit"},
        {"allowedTees": ["tdx", "nvidia-gpu"], "requires": ["tdx", "nvidia-gpu"]},
    ],
)
def test_tcb_change_and_requires_accepted_by_rule_and_parser(changes: dict[str, Any]) -> None:
    doc = _policy("tdx-td")
    if "nvidia-gpu" in changes.get("allowedTees", ()):
        doc["spec"]["referenceValues"]["nvidiaGpu"] = {"measurements": {"2": ["00" * 48]}}
    doc["spec"].update(changes)
    assert cel_violations(doc) == []
    (policy,) = parse_policies([doc])
    assert policy.on_tcb_change.value == changes.get("onTcbChange", "audit")
