"""Scheduling with the real kube-scheduler 1.20.2 and Node objects (no kubelet) carrying what
the device plugins, Karpenter and Node Feature Discovery publish, all read from manifests/:
NFD rules' labels and taints (SEV-SNP, TDX, SGX hosts), the enclave NodePool's labels and taint
and its NodeOverlay's capacity (Nitro), Intel's SGX device-plugin resources. The pods are what
the injector makes of them (``sidecar.inject.mutate``, the function the webhook serves; minus
the native-sidecar probes 1.20 cannot store, see the README's testing section).

Shown: injected TEE pods bind only to their TEE's nodes; ordinary pods never land on TEE nodes;
a pod asking for more enclave CPUs than any node offers stays Pending with the scheduler's
reason, and ``attestmesh lint`` flags it beforehand.
"""

from __future__ import annotations

import asyncio
import copy
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from sidecar.inject import Decision, InjectConfig, SimInjection, mutate
from tests.kube_real.cluster import Cluster
from tests.kube_real.install import MANIFESTS, Installed
from tests.kube_real.plane import (
    GOOD,
    Env,
    app_pod,
    control_plane,
    namespace_doc,
    service_account_doc,
)
from tests.kube_real.rest import Rest, load_docs, until
from tests.unit.inject.jsonpatch import apply_patch

pytestmark = pytest.mark.integration

NS = "sched"  # no injection label: pods are stored as sent (the webhook lets injected ones by)
NFD_RULES = MANIFESTS / "nodes" / "nfd" / "nodefeaturerules.yaml"
NITRO = MANIFESTS / "nodes" / "nitro"
BASE_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110"}
CFG = InjectConfig(sim=SimInjection(GOOD.hex()))
# what Intel's SGX device plugin advertises on an SGX host
SGX_CAPACITY = {"sgx.intel.com/epc": "512Mi", "sgx.intel.com/enclave": "20",
                "sgx.intel.com/provision": "20"}  # fmt: skip


def one(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in load_docs([path]) if d.get("kind") == kind]
    return doc


def nfd_host(tee: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(labels, taints) nfd-master gives a host matching the rule for ``tee``, plus NFD's own
    feature label the injector's node affinity selects."""
    rules = one(NFD_RULES, "NodeFeatureRule")["spec"]["rules"]
    (rule,) = [r for r in rules if r["name"] == f"attestmesh.{tee}-host"]
    feature = {"sev-snp": "sev.snp", "tdx": "tdx", "sgx": "sgx"}[tee]
    labels = {
        **rule["labels"],
        f"feature.node.kubernetes.io/cpu-security.{feature}.enabled": "true",
    }
    return labels, list(rule.get("taints", []))


def nitro_host() -> tuple[dict[str, str], list[dict[str, str]], dict[str, str]]:
    """(labels, taints, extended capacity) of a node of the enclave NodePool."""
    template = one(NITRO / "nodepool.yaml", "NodePool")["spec"]["template"]
    capacity = one(NITRO / "nodeoverlay.yaml", "NodeOverlay")["spec"]["capacity"]
    return dict(template["metadata"]["labels"]), list(template["spec"]["taints"]), dict(capacity)


def node(
    name: str,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    capacity: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Node, its status as a kubelet would report it)."""
    obj = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": {"taints": taints or []},
    }
    cap = {**BASE_CAPACITY, **(capacity or {})}
    status = {
        "capacity": cap,
        "allocatable": cap,
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test"}
        ],
    }
    return obj, status


@pytest.fixture(scope="module")
def nodes(cluster: Cluster, admin: Rest, installed: Installed) -> Iterator[list[str]]:
    made = [
        node("plain-1"),
        node("plain-2"),
        node("snp-1", *nfd_host("sev-snp")),
        node("tdx-1", *nfd_host("tdx")),
        node("sgx-1", *nfd_host("sgx"), SGX_CAPACITY),
        node("nitro-1", *nitro_host()),
    ]
    for obj, status in made:
        admin.apply(obj)
        # the TaintNodesByCondition admission plugin gave it node.kubernetes.io/not-ready (the
        # node lifecycle controller takes it off once the kubelet reports Ready): as that would
        admin.patch("v1", "Node", None, obj["metadata"]["name"], {"spec": obj["spec"]})
        admin.patch("v1", "Node", None, obj["metadata"]["name"], {"status": status},
                    subresource="status")  # fmt: skip
    admin.apply(namespace_doc(NS))
    for rc in (CFG.snp_runtime_class, CFG.tdx_runtime_class):  # what the CoCo operator installs
        admin.apply({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": rc}, "handler": rc})  # fmt: skip
    admin.apply(service_account_doc(NS, "web"))
    cluster.start_scheduler()
    try:
        yield [obj["metadata"]["name"] for obj, _ in made]
    finally:
        cluster.stop_scheduler()
        for obj, _ in made:
            admin.delete("v1", "Node", None, obj["metadata"]["name"])


def injected(name: str, tee: str, cfg: InjectConfig = CFG) -> dict[str, Any]:
    """The pod the injection webhook makes of an app pod asking for ``tee``."""
    annotations = {"attestmesh.dev/tee": tee}
    if tee == "nitro":
        annotations["attestmesh.dev/enclave-image"] = "registry.example/enclave:1"
    sent = app_pod(name, NS, annotations=annotations)
    sent["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    result = mutate(sent, {"attestmesh.dev/inject": "enabled"}, cfg)
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(sent, [dict(op) for op in result.patch])
    for c in out["spec"]["initContainers"]:  # native sidecars: 1.20 refuses their probes
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            c.pop(probe, None)
    return out


def ordinary(name: str) -> dict[str, Any]:
    pod = app_pod(name, NS)
    pod["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "100m", "memory": "64Mi"}}
    return pod


async def create_all(admin: Rest, pods: list[dict[str, Any]]) -> None:
    for pod in pods:
        status, body = await asyncio.to_thread(
            admin.status_of, "POST", admin.path("v1", "Pod", NS), pod
        )
        assert status == 200, body.get("message")


def bound_nodes(admin: Rest, names: list[str]) -> dict[str, str] | None:
    out = {}
    for name in names:
        pod = admin.get("v1", "Pod", NS, name)
        if not pod["spec"].get("nodeName"):
            return None
        out[name] = pod["spec"]["nodeName"]
    return out


async def test_tee_pods_bind_only_to_their_nodes_and_ordinary_pods_never_to_tee_nodes(
    env: Env, admin: Rest, nodes: list[str], tmp_path: Path
) -> None:
    async with control_plane(env, tmp_path / "state"):  # its webhook admits pods in NS
        tee_pods = [injected(f"{tee}-app", tee) for tee in ("sev-snp", "tdx", "sgx", "nitro")]
        plain = [ordinary(f"plain-{i}") for i in range(8)]
        await create_all(admin, tee_pods + plain)
        names = [p["metadata"]["name"] for p in tee_pods + plain]
        placed = await until(lambda: bound_nodes(admin, names), timeout=60, what="all bound")
        assert {n: placed[n] for n in ("sev-snp-app", "tdx-app", "sgx-app", "nitro-app")} == {
            "sev-snp-app": "snp-1",
            "tdx-app": "tdx-1",
            "sgx-app": "sgx-1",
            "nitro-app": "nitro-1",
        }
        assert {placed[p["metadata"]["name"]] for p in plain} <= {"plain-1", "plain-2"}, placed

        # an ordinary pod that only selects an SNP host (no toleration) is refused by the taint:
        # it stays Pending, with the scheduler's reason
        snp_only = ordinary("wants-snp")
        snp_only["spec"]["nodeSelector"] = {"attestmesh.dev/tee-host.sev-snp": "true"}
        await create_all(admin, [snp_only])
        cond = await until(lambda: unschedulable(admin, "wants-snp"), what="Unschedulable")
        assert "taint" in cond["message"] and "attestmesh.dev/tee-host.sev-snp" in cond["message"]


def unschedulable(admin: Rest, name: str) -> dict[str, Any] | None:
    pod = admin.get("v1", "Pod", NS, name)
    for c in pod["status"].get("conditions") or []:
        if c["type"] == "PodScheduled" and c["status"] == "False":
            assert not pod["spec"].get("nodeName")
            return dict(c)
    return None


@pytest.mark.parametrize(
    ("name", "resource", "oversize", "lint_says"),
    [
        # more enclave CPUs than the NodeOverlay gives any enclave node
        ("big-cpus", "aws.ec2.nitro/nitro_enclaves_cpus",
         lambda offered: InjectConfig(nitro_enclave_cpus=offered + 2),
         lambda offered: f"aws.ec2.nitro/nitro_enclaves_cpus {offered + 2} > {offered}"),
        # more 1 GiB hugepages (enclave memory) than any enclave node has
        ("big-memory", "hugepages-1Gi",
         lambda offered: InjectConfig(nitro_hugepages_gi=offered + 4),
         lambda offered: f"hugepages-1Gi {offered + 4}Gi > {offered}Gi"),
    ],
)  # fmt: skip
async def test_an_oversized_enclave_pod_stays_pending_and_lint_flags_it(
    env: Env,
    admin: Rest,
    nodes: list[str],
    tmp_path: Path,
    name: str,
    resource: str,
    oversize: Callable[[int], InjectConfig],
    lint_says: Callable[[int], str],
) -> None:
    _, _, capacity = nitro_host()
    offered = int(capacity[resource].removesuffix("Gi"))
    big = injected(name, "nitro", oversize(offered))
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump(copy.deepcopy(big)))
    lint = subprocess.run(
        [str(Path(sys.executable).with_name("attestmesh")), "lint", str(NITRO), str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert lint.returncode == 1, lint.stdout + lint.stderr
    flagged = [
        line for line in lint.stdout.splitlines() if "WorkloadExceedsOverlayCapacity" in line
    ]
    assert flagged and name in flagged[0], lint.stdout
    assert lint_says(offered) in lint.stdout, lint.stdout

    async with control_plane(env, tmp_path / "state"):
        await create_all(admin, [big])
        cond = await until(lambda: unschedulable(admin, name), what="Unschedulable")
    assert cond["reason"] == "Unschedulable", cond
    assert f"Insufficient {resource}" in cond["message"], cond
