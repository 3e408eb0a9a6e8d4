"""A minimal, strict RFC 6902 applier (add, remove, replace, test) with RFC 6901 pointers."""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    pass


def _tokens(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"pointer must start with '/': {path!r}")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if token == "-" and for_add:
        return len(container)
    if not token.isdigit() or (token != "0" and token.startswith("0")):
        raise PatchError(f"bad array index {token!r}")
    i = int(token)
    limit = len(container) if for_add else len(container) - 1
    if i > limit:
        raise PatchError(f"array index {i} out of range")
    return i


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for t in tokens[:-1]:
        if isinstance(node, dict):
            if t not in node:
                raise PatchError(f"path segment {t!r} missing")
            node = node[t]
        elif isinstance(node, list):
            node = node[_index(node, t, for_add=False)]
        else:
            raise PatchError(f"cannot descend into {type(node).__name__}")
    return node


def apply_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, path = op["op"], op["path"]
        if set(op) - {"op", "path", "value", "from"}:
            raise PatchError(f"unknown member in {op}")
        tokens = _tokens(path)
        if not tokens:
            if kind in ("add", "replace"):
                doc = copy.deepcopy(op["value"])
                continue
            raise PatchError(f"{kind} on the root")
        parent, last = _parent(doc, tokens), tokens[-1]
        if kind == "add":
            if isinstance(parent, dict):
                parent[last] = copy.deepcopy(op["value"])
            elif isinstance(parent, list):
                parent.insert(_index(parent, last, for_add=True), copy.deepcopy(op["value"]))
            else:
                raise PatchError("add into a scalar")
        elif kind in ("remove", "replace", "test"):
            if isinstance(parent, dict):
                if last not in parent:
                    raise PatchError(f"{kind}: {path} does not exist")
                key: Any = last
            elif isinstance(parent, list):
                key = _index(parent, last, for_add=False)
            else:
                raise PatchError(f"{kind} in a scalar")
            if kind == "remove":
                del parent[key]
            elif kind == "replace":
                parent[key] = copy.deepcopy(op["value"])
            elif parent[key] != op["value"]:
                raise PatchError(f"test failed at {path}")
        else:
            raise PatchError(f"unsupported op {kind!r}")
    return doc
