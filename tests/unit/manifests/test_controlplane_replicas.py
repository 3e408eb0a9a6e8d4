"""manifests/base/controlplane.yaml: three replicas on the PostgreSQL store that survive the loss
of any one (PDB minAvailable 2, one replica per node), the URL from a Secret through the
environment (never argv), nothing on the pod's disk that another replica needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from attestmesh.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[3] / "manifests" / "base" / "controlplane.yaml"


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text()) if d}


def test_three_replicas_rolling_one_at_a_time() -> None:
    spec = docs()["Deployment"]["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 1},
    }


def test_the_budget_keeps_two_and_selects_the_replicas() -> None:
    d = docs()
    pdb, deploy = d["PodDisruptionBudget"]["spec"], d["Deployment"]["spec"]
    assert pdb["minAvailable"] == 2 and "maxUnavailable" not in pdb
    labels = deploy["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def test_at_most_one_replica_per_node() -> None:
    pod = docs()["Deployment"]["spec"]["template"]
    (term,) = pod["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()


def test_the_store_url_comes_from_a_secret_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (container,) = docs()["Deployment"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["ATTESTMESH_STORE"]["valueFrom"]["secretKeyRef"] == {
        "name": "attestmesh-postgresql",
        "key": "url",
    }
    assert "value" not in env["ATTESTMESH_STORE"]
    assert not any(a.startswith("--store") or "postgresql://" in a for a in container["args"])
    # the CLI takes the store from that variable
    monkeypatch.setenv("ATTESTMESH_STORE", "postgresql://mesh@db:5432/mesh")
    parsed = build_parser().parse_args(["controlplane", "--state-dir", "/s"])
    assert parsed.store == "postgresql://mesh@db:5432/mesh"


def test_no_persistent_volume_the_state_is_in_the_database() -> None:
    d = docs()
    assert "PersistentVolumeClaim" not in d
    volumes = {v["name"]: v for v in d["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["state"]
