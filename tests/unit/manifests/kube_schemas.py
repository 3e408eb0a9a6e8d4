"""CustomResourceDefinition structural schemas as JSON Schema, for offline validation. Pure.
(Test support: the manifest tests validate every example against the CRDs with it; it was
``attestmesh.kube_schemas``, which nothing in the product used.)

The API server validates custom resources against a CRD's ``openAPIV3Schema`` (OpenAPI 3.0
with Kubernetes extensions). ``build_json_schema`` turns the subset that CRDs use into a JSON
Schema (draft 2020-12) that any JSON Schema validator can apply, with the server's strict
field validation (unknown fields are errors, as with ``kubectl apply --validate=strict``):

- ``nullable: true`` -> the type also admits ``null``;
- ``x-kubernetes-int-or-string: true`` -> integer or string;
- ``x-kubernetes-preserve-unknown-fields: true`` -> unknown fields allowed at that level;
- an object with ``properties`` and neither ``additionalProperties`` nor preserve-unknown-fields
  -> ``additionalProperties: false``;
- ``exclusiveMinimum``/``exclusiveMaximum`` booleans (OpenAPI 3.0) -> draft 2020-12 numbers;
- ``metadata`` at the root is left to the caller (the server fills most of it).

Not evaluated: ``x-kubernetes-validations`` (CEL rules), defaults and list-type uniqueness;
``cel_rules`` lists the CEL rules so a test can at least account for them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Keywords copied unchanged (value validations and structure).
_COPY = frozenset(
    {
        "enum",
        "pattern",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "multipleOf",
        "uniqueItems",
        "required",
        "format",
    }
)
_NESTED_LISTS = ("oneOf", "anyOf", "allOf")


class SchemaConversionError(ValueError):
    """The CRD is not a structural apiextensions.k8s.io/v1 CRD this module understands."""


@dataclass(frozen=True, slots=True)
class CrdVersion:
    group: str
    kind: str
    version: str
    namespaced: bool
    schema: Mapping[str, Any]
    """The JSON Schema (draft 2020-12) for one served version."""
    cel_rules: tuple[str, ...]

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def build_json_schema(openapi: Mapping[str, Any], *, root: bool = True) -> dict[str, Any]:
    """Convert one structural ``openAPIV3Schema`` node (recursively) to JSON Schema."""
    if not isinstance(openapi, Mapping):
        raise SchemaConversionError(f"schema node must be an object, not {type(openapi)}")
    out: dict[str, Any] = {}
    if root:
        out["$schema"] = JSON_SCHEMA_DIALECT
    preserve = openapi.get("x-kubernetes-preserve-unknown-fields") is True
    if openapi.get("x-kubernetes-int-or-string") is True:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    elif "type" in openapi:
        kind = openapi["type"]
        if openapi.get("nullable") is True:
            out["type"] = [kind, "null"]
        else:
            out["type"] = kind
    for key in _COPY:
        if key in openapi:
            out[key] = openapi[key]
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = openapi.get(key)
        if flag is True and bound in openapi:
            out[key] = openapi[bound]
            out.pop(bound, None)
    if "properties" in openapi:
        props = openapi["properties"]
        if not isinstance(props, Mapping):
            raise SchemaConversionError("properties must be an object")
        out["properties"] = {
            name: (
                {"type": "object"}
                if root and name == "metadata"
                else build_json_schema(sub, root=False)
            )
            for name, sub in props.items()
        }
    if "items" in openapi:
        out["items"] = build_json_schema(openapi["items"], root=False)
    additional = openapi.get("additionalProperties")
    if isinstance(additional, Mapping):
        out["additionalProperties"] = build_json_schema(additional, root=False)
    elif isinstance(additional, bool):
        out["additionalProperties"] = additional
    elif "properties" in openapi and not preserve:
        out["additionalProperties"] = False
    for key in _NESTED_LISTS:
        if key in openapi:
            out[key] = [build_json_schema(s, root=False) for s in openapi[key]]
    if "not" in openapi:
        out["not"] = build_json_schema(openapi["not"], root=False)
    return out


def _cel_rules(node: Any) -> Iterator[str]:
    if isinstance(node, Mapping):
        for rule in node.get("x-kubernetes-validations", ()) or ():
            if isinstance(rule, Mapping) and isinstance(rule.get("rule"), str):
                yield rule["rule"]
        for key, value in node.items():
            if key != "x-kubernetes-validations":
                yield from _cel_rules(value)
    elif isinstance(node, list):
        for item in node:
            yield from _cel_rules(item)


def parse_crd(doc: Mapping[str, Any]) -> tuple[CrdVersion, ...]:
    """Every served version of a CRD document, with its JSON Schema."""
    if doc.get("apiVersion") != "apiextensions.k8s.io/v1" or doc.get("kind") != (
        "CustomResourceDefinition"
    ):
        raise SchemaConversionError("not an apiextensions.k8s.io/v1 CustomResourceDefinition")
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        raise SchemaConversionError("spec is required")
    group, names = spec.get("group"), spec.get("names")
    if not isinstance(group, str) or not isinstance(names, Mapping):
        raise SchemaConversionError("spec.group and spec.names are required")
    kind = names.get("kind")
    if not isinstance(kind, str):
        raise SchemaConversionError("spec.names.kind is required")
    out: list[CrdVersion] = []
    for version in spec.get("versions", ()):
        if not isinstance(version, Mapping) or not version.get("served", False):
            continue
        raw = (version.get("schema") or {}).get("openAPIV3Schema")
        if not isinstance(raw, Mapping):
            raise SchemaConversionError(f"{kind} {version.get('name')}: no openAPIV3Schema")
        out.append(
            CrdVersion(
                group=group,
                kind=kind,
                version=str(version["name"]),
                namespaced=spec.get("scope") == "Namespaced",
                schema=build_json_schema(raw),
                cel_rules=tuple(_cel_rules(raw)),
            )
        )
    return tuple(out)


def structural_problems(openapi: Mapping[str, Any], where: str = "") -> list[str]:
    """Where a schema node breaks the structural-schema rules the API server enforces
    (every node typed unless int-or-string or preserve-unknown-fields; no ``properties``
    together with ``additionalProperties``; no types inside oneOf/anyOf/allOf/not)."""
    problems: list[str] = []
    here = where or "<root>"
    typed = (
        "type" in openapi
        or openapi.get("x-kubernetes-int-or-string") is True
        or openapi.get("x-kubernetes-preserve-unknown-fields") is True
    )
    if not typed:
        problems.append(f"{here}: no type")
    if "properties" in openapi and "additionalProperties" in openapi:
        problems.append(f"{here}: both properties and additionalProperties")
    for key in _NESTED_LISTS:
        for i, sub in enumerate(openapi.get(key, ())):
            if isinstance(sub, Mapping) and {"type", "properties", "items"} & set(sub):
                problems.append(f"{here}.{key}[{i}]: types/fields inside a junctor")
    for name, sub in (openapi.get("properties") or {}).items():
        if isinstance(sub, Mapping):
            problems.extend(structural_problems(sub, f"{where}.{name}"))
    for key in ("items", "additionalProperties"):
        sub = openapi.get(key)
        if isinstance(sub, Mapping):
            problems.extend(structural_problems(sub, f"{where}.{key}"))
    return problems


__all__ = [
    "CrdVersion",
    "SchemaConversionError",
    "build_json_schema",
    "parse_crd",
    "structural_problems",
]
