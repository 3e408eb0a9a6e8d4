"""The SecretPolicy CRD and xds/secretpolicy.py accept the same documents and reject the same
mistakes: the example validates against the CRD's schema and satisfies its CEL rules (offline,
cel-python) and its list semantics (map keys and sets unique), and parses; every mutation is
refused by the CRD (schema, CEL or list semantics) *and* by the parser."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from certs.errors import PolicyError
from tests.unit.manifests.helpers import (
    MANIFESTS,
    load_yaml_docs,
    project_validators,
    schema_errors,
)
from tests.unit.manifests.test_cel_rules import CRDS, cel_violations
from xds.secretpolicy import KvSource, Operation, TransitSource, parse_secret_policies

EXAMPLES = load_yaml_docs(MANIFESTS / "examples" / "secretpolicies.yaml")
SCHEMA = CRDS["SecretPolicy"]


def _list_problems(schema: Mapping[str, Any], value: Any, where: str) -> Iterator[str]:
    """x-kubernetes-list-type map (keys unique) and set (items unique), as the API server
    enforces them (jsonschema does not know them)."""
    if isinstance(value, list):
        kind = schema.get("x-kubernetes-list-type")
        if kind == "set" and len({repr(v) for v in value}) != len(value):
            yield f"{where}: duplicate set item"
        if kind == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen = [tuple(v.get(k) for k in keys) for v in value if isinstance(v, dict)]
            if len(set(seen)) != len(seen):
                yield f"{where}: duplicate map key"
        if isinstance(schema.get("items"), Mapping):
            for i, item in enumerate(value):
                yield from _list_problems(schema["items"], item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                yield from _list_problems(sub, value[name], f"{where}.{name}")


def crd_problems(doc: dict[str, Any]) -> list[str]:
    _, validator = project_validators()[(doc["apiVersion"], doc["kind"])]
    problems = schema_errors(validator, doc)
    if not problems:  # CEL runs only on objects that pass the schema (as in the API server)
        problems += cel_violations(doc) + list(_list_problems(SCHEMA, doc, "<root>"))
    return problems


def test_the_example_is_accepted_by_crd_and_parser() -> None:
    assert EXAMPLES
    for doc in EXAMPLES:
        assert crd_problems(doc) == []
    (policy,) = parse_secret_policies(EXAMPLES)
    assert (policy.namespace, policy.name) == ("demo", "payments")
    db, model = policy.secrets["db"], policy.secrets["model-key"]
    assert db.source == KvSource("secret", "payments/db", None)
    assert db.kbs_resource == "payments/key/db"
    assert model.source == TransitSource("transit", "model", frozenset({Operation.UNWRAP}))
    assert [sorted(r.secrets) for r in policy.rules] == [["db", "model-key"], ["db"]]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return apply


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        del node[last]

    return apply


MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "no-spec": _drop("spec"),
    "no-secrets": _set("spec.secrets", []),
    "no-rules": _set("spec.rules", []),
    "secret-bad-name": _set("spec.secrets.0.name", "DB"),
    "secret-twice": _set("spec.secrets.1", {"name": "db", "kv": {"mount": "s", "path": "x"}}),
    "kv-and-transit": _set(
        "spec.secrets.0.transit", {"mount": "transit", "key": "k", "operations": ["wrap"]}
    ),
    "neither-kv-nor-transit": _drop("spec.secrets.1.transit"),
    "kbs-on-transit": _set("spec.secrets.1.kbsResource", "a/b/c"),
    "kbs-two-segments": _set("spec.secrets.0.kbsResource", "a/b"),
    "kv-no-path": _drop("spec.secrets.0.kv.path"),
    "kv-path-dotdot-start": _set("spec.secrets.0.kv.path", "../etc"),
    "kv-path-trailing-slash": _set("spec.secrets.0.kv.path", "payments/"),
    "kv-path-17-segments": _set("spec.secrets.0.kv.path", "/".join(["s"] * 17)),
    "kv-path-too-long": _set("spec.secrets.0.kv.path", "/".join(["x" * 128] * 16) + "y"),
    "kv-version-zero": _set("spec.secrets.0.kv.version", 0),
    "transit-bad-op": _set("spec.secrets.1.transit.operations", ["sign"]),
    "transit-no-ops": _set("spec.secrets.1.transit.operations", []),
    "transit-op-twice": _set("spec.secrets.1.transit.operations", ["wrap", "wrap"]),
    "rule-unknown-secret": _set("spec.rules.1.secrets", ["cache"]),
    "rule-no-secrets": _set("spec.rules.1.secrets", []),
    "rule-no-from": _set("spec.rules.0.from", []),
    "identity-and-namespace": _set(
        "spec.rules.1.from.0", {"identity": "spiffe://a/b", "namespace": "x"}
    ),
    "identity-not-spiffe": _set("spec.rules.1.from.0", {"identity": "https://x"}),
    "claims-empty": _set("spec.rules.0.whenClaims", {}),
    "claims-bad-tee": _set("spec.rules.0.whenClaims.tees", ["sev"]),
    "claims-not-hex": _set("spec.rules.0.whenClaims.measurements", {"measurement": ["xyz"]}),
    "claims-bad-tcb-status": _set("spec.rules.0.whenClaims.tcbStatuses", ["Fine"]),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_crd_and_parser_reject_the_same_mistakes(case: str) -> None:
    doc = copy.deepcopy(EXAMPLES[0])
    MUTATIONS[case](doc)
    assert crd_problems(doc), f"the CRD accepted {case}"
    with pytest.raises(PolicyError):
        parse_secret_policies([doc])
