"""TEE-host taints and the injector's tolerations: manifests/nodes/nfd taints every SEV-SNP, TDX
and SGX host NoSchedule, and injected pods of those TEEs (only they) tolerate exactly those
taints, while their node affinity still picks the host. The real kube-scheduler shows the
effect in tests/kube_real/test_scheduling.py."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from certs.evidence.claims import Tee
from sidecar.inject import TEE_HOST_TAINTS, mutate
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.inject.test_inject import CFG, ENABLED, pod, validate_pod
from tests.vectors import REPO

NFD_RULES = REPO / "manifests" / "nodes" / "nfd" / "nodefeaturerules.yaml"


def injected_as(tee: str, **spec: Any) -> dict[str, Any]:
    p = pod(**spec)
    p["metadata"]["annotations"]["attestmesh.dev/tee"] = tee
    if tee == "nitro":
        p["metadata"]["annotations"]["attestmesh.dev/enclave-image"] = "registry.example/eif:1"
    result = mutate(p, ENABLED, CFG)
    assert result.decision.value == "injected", result.message
    out: dict[str, Any] = apply_patch(p, [dict(op) for op in result.patch])
    validate_pod(out)
    return out


def test_nfd_rules_taint_every_tee_host_with_the_label_key() -> None:
    (doc,) = [d for d in yaml.safe_load_all(NFD_RULES.read_text()) if d]
    taints: dict[str, list[dict[str, str]]] = {}
    for rule in doc["spec"]["rules"]:
        (label,) = rule["labels"]
        taints[label] = rule.get("taints", [])
    assert taints == {
        key: [{"key": key, "value": "true", "effect": "NoSchedule"}]
        for key in TEE_HOST_TAINTS.values()
    }
    assert set(TEE_HOST_TAINTS) == {Tee.SEV_SNP, Tee.TDX, Tee.SGX}


@pytest.mark.parametrize("tee", ["sev-snp", "tdx", "sgx"])
def test_cvm_and_sgx_pods_tolerate_every_tee_host_taint(tee: str) -> None:
    existing = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    out = injected_as(tee, tolerations=[existing])
    tolerations = out["spec"]["tolerations"]
    assert tolerations[0] == existing
    assert tolerations[1:] == [
        {"key": key, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        for key in TEE_HOST_TAINTS.values()
    ]
    # the affinity still selects the TEE's own hosts
    terms = out["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {f"feature.node.kubernetes.io/cpu-security.{tee.replace('-', '.')}.enabled"}


def test_a_toleration_already_there_is_not_repeated() -> None:
    key = TEE_HOST_TAINTS[Tee.TDX]
    mine = {"key": key, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    out = injected_as("tdx", tolerations=[mine])
    keys = [t["key"] for t in out["spec"]["tolerations"]]
    assert keys[0] == key and sorted(keys) == sorted(TEE_HOST_TAINTS.values())


@pytest.mark.parametrize("tee", ["sim", "nitro"])
def test_other_tees_do_not_tolerate_tee_hosts(tee: str) -> None:
    out = injected_as(tee)
    keys = {t["key"] for t in out["spec"].get("tolerations", [])}
    assert not keys & set(TEE_HOST_TAINTS.values())
