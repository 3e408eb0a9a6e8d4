"""Secret injection: ``attestmesh.dev/secrets`` gives the agent the secrets to fetch and the
pod a memory-backed volume (emptyDir medium Memory) every application container mounts
read-only; the agent's command is one the real CLI accepts. Applied to the pod as Kubernetes
would (the JSON patch), validated strictly against the Kubernetes schema."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from attestmesh.cli import build_parser
from sidecar.inject import (
    AGENT_CONTAINER,
    ANNOTATION_SECRETS,
    SECRETS_DIR,
    SECRETS_VOLUME,
    Decision,
    mutate,
)
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.inject.test_inject import CFG, ENABLED, container, pod, validate_pod


def _with_secrets(value: str, **kw: Any) -> dict[str, Any]:
    p = pod(**kw)
    p["metadata"]["annotations"][ANNOTATION_SECRETS] = value
    return p


def _injected(p: dict[str, Any]) -> dict[str, Any]:
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(copy.deepcopy(p), [dict(op) for op in result.patch])
    return out


def test_secrets_volume_is_memory_backed_and_mounted_read_only_in_apps() -> None:
    p = _with_secrets("db, payments/model-key,db")
    p["spec"]["containers"].append({"name": "worker", "image": "registry.example/w:1"})
    out = _injected(p)
    validate_pod(out)
    (vol,) = [v for v in out["spec"]["volumes"] if v["name"] == SECRETS_VOLUME]
    assert vol["emptyDir"]["medium"] == "Memory"
    for name in ("app", "worker"):
        mounts = container(out, name)["volumeMounts"]
        assert {"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR, "readOnly": True} in mounts
    agent = container(out, AGENT_CONTAINER)
    assert {"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR} in agent["volumeMounts"]
    cmd = agent["command"]
    args = build_parser().parse_args(
        [a.replace("$(POD_NAMESPACE)/$(POD_NAME)", "shop/web-0") for a in cmd[1:]]
    )
    assert args.secret == ["db", "payments/model-key"]  # once each, in order
    assert args.secret_dir.as_posix() == SECRETS_DIR
    assert args.secret_url == CFG.secret_url
    assert args.secret_file_mode == 0o444


def test_no_annotation_no_secrets_volume() -> None:
    out = _injected(pod())
    assert SECRETS_VOLUME not in {v["name"] for v in out["spec"]["volumes"]}
    assert "--secret" not in container(out, AGENT_CONTAINER)["command"]
    assert all(m["name"] != SECRETS_VOLUME for m in container(out, "app").get("volumeMounts", []))


@pytest.mark.parametrize("value", ["DB", "a/b/c", "../x", ",".join(f"s{i}" for i in range(65))])
def test_bad_secret_names_are_refused(value: str) -> None:
    result = mutate(_with_secrets(value), ENABLED, CFG)
    assert result.decision is Decision.INVALID_POD
    assert ANNOTATION_SECRETS in result.message
    assert not result.patch


def test_reserved_volume_name_is_refused() -> None:
    p = _with_secrets("db")
    p["spec"]["volumes"] = [{"name": SECRETS_VOLUME, "emptyDir": {}}]
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.INVALID_POD
    assert SECRETS_VOLUME in result.message
