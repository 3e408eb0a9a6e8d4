"""Injection of composite GPU attestation (``attestmesh agent --gpus N``) and of the attested
control plane check (``--control-plane-policy``): the injected agent command is parsed by the
real CLI parser, every file it names comes from one of its mounts, and the parsed arguments
build the agent's control-plane gate from a real policy file; pods the injector cannot make
correct are refused with a clear message."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestmesh.agent_cmd import check_agent_args
from attestmesh.cli import _check_mode, build_parser
from attestmesh.cp_attest import ControlPlaneGate, gate_from_args
from certs.errors import PolicyError
from sidecar.inject import (
    AGENT_CONTAINER,
    ANNOTATION_ATTEST_GPUS,
    ANNOTATION_CP_POLICY,
    CP_POLICY_KEY,
    CP_POLICY_VOLUME,
    Decision,
    InjectConfig,
    MutationResult,
    mutate,
    requested_gpus,
)
from tests.unit.fixtures_core import policy_doc
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.inject.test_injected_commands import CFG, cli, command, mounted

NS = "shop"


def _pod(
    tee: str, gpus: list[Any] | None = None, /, resource: str = "nvidia.com/gpu", **annotations: str
) -> dict[str, Any]:
    """A pod of ``tee`` with one app container per entry of ``gpus`` (its ``resource`` limit;
    None: no GPU requested)."""
    app: list[dict[str, Any]] = []
    for i, n in enumerate(gpus or [None]):
        c: dict[str, Any] = {"name": f"app{i}", "image": "cuda-app:1"}
        if i == 0:
            c["ports"] = [{"containerPort": 8080}]
        if n is not None:
            c["resources"] = {"limits": {resource: n, "memory": "1Gi"}}
        app.append(c)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "trainer-0",
            "namespace": NS,
            "labels": {"attestmesh.dev/inject": "enabled"},
            "annotations": {"attestmesh.dev/tee": tee, **annotations},
        },
        "spec": {"serviceAccountName": "trainer", "containers": app},
    }  # fmt: skip


def _injected(pod: dict[str, Any], cfg: InjectConfig = CFG) -> dict[str, Any]:
    result = mutate(pod, {}, cfg)
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(pod, [dict(op) for op in result.patch])
    return out


def _agent(pod: dict[str, Any]) -> Any:
    args = cli(command(pod, AGENT_CONTAINER))
    check_agent_args(args)
    return args


def _refused(pod: dict[str, Any], cfg: InjectConfig = CFG) -> MutationResult:
    result = mutate(pod, {}, cfg)
    assert result.decision is Decision.INVALID_POD and not result.allowed, result
    assert result.patch == ()
    return result


# -- GPUs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tee", "agent_tee", "runtime"),
    [
        ("sev-snp", "sev-snp", "kata-qemu-nvidia-gpu-snp"),
        ("tdx", "tsm", "kata-qemu-nvidia-gpu-tdx"),
    ],
)
@pytest.mark.parametrize("resource", ["nvidia.com/pgpu", "nvidia.com/gpu"])
def test_a_cvm_pod_asking_for_gpu_attestation_gets_gpus_n(
    tee: str, agent_tee: str, runtime: str, resource: str
) -> None:
    pod = _injected(_pod(tee, [2, "1"], resource=resource, **{ANNOTATION_ATTEST_GPUS: "true"}))
    args = _agent(pod)
    assert args.tee == agent_tee and args.gpus == 3  # every container's GPUs: one CVM
    assert args.control_plane_policy is None
    assert pod["spec"]["runtimeClassName"] == runtime  # GPUs passed through into the VM


def test_a_cvm_pod_with_gpus_runs_in_the_gpu_runtime_class_even_without_attesting_them() -> None:
    assert _injected(_pod("sev-snp", [1]))["spec"]["runtimeClassName"] == "kata-qemu-nvidia-gpu-snp"
    assert _injected(_pod("tdx"))["spec"]["runtimeClassName"] == "kata-qemu-tdx"
    assert _injected(_pod("sev-snp"))["spec"]["runtimeClassName"] == "kata-qemu-snp"


def test_the_injector_default_attaches_the_gpus_of_cvm_pods_only() -> None:
    on = InjectConfig(**{**_fields(CFG), "attest_gpus": True})
    assert _agent(_injected(_pod("sev-snp", [4]), on)).gpus == 4
    assert _agent(_injected(_pod("sev-snp"), on)).gpus == 0  # no GPUs: plain CPU evidence
    assert _agent(_injected(_pod("sgx", [1]), on)).gpus == 0  # no GPU can attach to SGX
    # a pod opts out; without the default a GPU pod gets no --gpus
    off = {ANNOTATION_ATTEST_GPUS: "false"}
    assert _agent(_injected(_pod("tdx", [1], **off), on)).gpus == 0
    assert _agent(_injected(_pod("tdx", [1]))).gpus == 0
    assert "--gpus" not in command(_injected(_pod("tdx", [1])), AGENT_CONTAINER)


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        (_pod("sev-snp", **{ANNOTATION_ATTEST_GPUS: "true"}), "no container requests"),
        (_pod("sgx", [1], **{ANNOTATION_ATTEST_GPUS: "true"}), "confidential VM"),
        (_pod("sim", [1], **{ANNOTATION_ATTEST_GPUS: "true"}), "not sim"),
        (_pod("tdx", [9], **{ANNOTATION_ATTEST_GPUS: "true"}), "at most 8"),
        (
            _pod("tdx", [5, 4], resource="nvidia.com/pgpu", **{ANNOTATION_ATTEST_GPUS: "true"}),
            "9 GPUs requested",
        ),
        (_pod("tdx", ["1.5"]), "whole number"),  # a GPU count the runtime class depends on
        (_pod("tdx", ["0.5"], **{ANNOTATION_ATTEST_GPUS: "true"}), "whole number"),
        (_pod("tdx", [True], **{ANNOTATION_ATTEST_GPUS: "true"}), "whole number"),
        (_pod("tdx", [1], **{ANNOTATION_ATTEST_GPUS: "yes"}), '"true" or "false"'),
    ],
)
def test_gpu_attestation_the_injector_cannot_make_correct_is_refused(
    pod: dict[str, Any], says: str
) -> None:
    result = _refused(pod)
    assert "attestmesh cannot inject trainer-0" in result.message and says in result.message


def test_requested_gpus_reads_limits_then_requests() -> None:
    spec = {"containers": [
        {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "2"},
                                    "requests": {"nvidia.com/gpu": "2"}}},
        {"name": "b", "resources": {"requests": {"nvidia.com/pgpu": 1}}},
        {"name": "c"},
        "not a container",
    ]}  # fmt: skip
    assert requested_gpus(spec) == 3
    assert requested_gpus(spec, ("nvidia.com/gpu",)) == 2
    with pytest.raises(ValueError, match="whole number"):
        requested_gpus({"containers": [{"resources": {"limits": {"nvidia.com/gpu": "-1"}}}]})


# -- the control plane's policy -----------------------------------------------------------------


def _fields(cfg: InjectConfig) -> dict[str, Any]:
    return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}


def _gate_from(args: Any, pod: dict[str, Any], tmp_path: Path) -> ControlPlaneGate | None:
    """Build the agent's gate as it starts, its mounted policy file mapped to a real one."""
    vol = mounted(pod, AGENT_CONTAINER, str(args.control_plane_policy))
    assert vol["readOnly"] and vol["configMap"]["items"] == [
        {"key": CP_POLICY_KEY, "path": CP_POLICY_KEY}
    ]
    policy = tmp_path / "policy.yaml"
    doc = policy_doc("controlplane", "attestmesh-system", tees=["sev-snp"],
                     refs={"sevSnp": {"measurement": ["ab" * 48]}})  # fmt: skip
    policy.write_text(yaml.safe_dump(doc))
    args = copy.copy(args)
    args.control_plane_policy = policy
    return gate_from_args(args, b"")


def test_a_pod_naming_a_policy_configmap_gets_control_plane_policy(tmp_path: Path) -> None:
    pod = _injected(_pod("sev-snp", [1], **{ANNOTATION_CP_POLICY: "cp-policy",
                                            ANNOTATION_ATTEST_GPUS: "true"}))  # fmt: skip
    args = _agent(pod)
    assert args.gpus == 1
    assert args.control_plane_trust_domain == CFG.trust_domain == "mesh.example"
    vol = mounted(pod, AGENT_CONTAINER, str(args.control_plane_policy))
    assert vol["name"] == CP_POLICY_VOLUME and vol["configMap"]["name"] == "cp-policy"
    assert "optional" not in vol["configMap"]  # missing: the pod waits, trusting nothing
    assert isinstance(_gate_from(args, pod, tmp_path), ControlPlaneGate)
    # only the agent mounts it
    assert all(
        m["name"] != CP_POLICY_VOLUME
        for c in pod["spec"]["containers"]
        for m in c.get("volumeMounts", [])
    )


def test_the_injector_config_names_the_policy_for_every_pod_and_a_pod_may_name_another() -> None:
    cfg = InjectConfig(**{**_fields(CFG), "control_plane_policy": "mesh-cp-policy"})
    for tee in ("sim", "sev-snp", "tdx", "sgx"):
        pod = _injected(_pod(tee), cfg)
        args = _agent(pod)
        vol = mounted(pod, AGENT_CONTAINER, str(args.control_plane_policy))
        assert vol["configMap"]["name"] == "mesh-cp-policy"
    other = _injected(_pod("tdx", **{ANNOTATION_CP_POLICY: "team-policy"}), cfg)
    vol = mounted(other, AGENT_CONTAINER, str(_agent(other).control_plane_policy))
    assert vol["configMap"]["name"] == "team-policy"
    # without either, no check (as before)
    assert _agent(_injected(_pod("tdx"))).control_plane_policy is None


@pytest.mark.parametrize(
    ("pod", "says"),
    [
        (_pod("tdx", **{ANNOTATION_CP_POLICY: "Not_A_Name"}), "not a ConfigMap name"),
        (_pod("tdx", **{ANNOTATION_CP_POLICY: ""}), "not a ConfigMap name"),
        (_pod("tdx", **{ANNOTATION_CP_POLICY: "a" * 254}), "not a ConfigMap name"),
        (
            _pod("nitro", **{ANNOTATION_CP_POLICY: "cp", "attestmesh.dev/enclave-image": "i:1"}),
            "not supported for nitro",
        ),
    ],
)
def test_a_control_plane_policy_the_injector_cannot_honour_is_refused(
    pod: dict[str, Any], says: str
) -> None:
    assert says in _refused(pod).message


def test_the_policy_volume_name_is_reserved() -> None:
    pod = _pod("tdx", **{ANNOTATION_CP_POLICY: "cp"})
    pod["spec"]["volumes"] = [{"name": CP_POLICY_VOLUME, "emptyDir": {}}]
    assert "reserved for the sidecar" in _refused(pod).message


def test_the_controlplane_cli_sets_the_injector_options(tmp_path: Path) -> None:
    flags = ["--inject-attest-gpus", "--inject-control-plane-policy", "mesh-cp-policy"]
    args = build_parser().parse_args(
        ["controlplane", "--state-dir", str(tmp_path), "--kubernetes", *flags]
    )
    _check_mode(args)
    assert args.inject_attest_gpus is True
    assert args.inject_control_plane_policy == "mesh-cp-policy"
    local = build_parser().parse_args(
        ["controlplane", "--state-dir", str(tmp_path), "--policy", "p.yaml", *flags]
    )
    with pytest.raises(PolicyError) as refused:
        _check_mode(local)
    assert "--inject-attest-gpus needs --kubernetes" in str(refused.value)
    assert "--inject-control-plane-policy needs --kubernetes" in str(refused.value)
    bad = build_parser().parse_args(
        ["controlplane", "--state-dir", str(tmp_path), "--kubernetes",
         "--inject-control-plane-policy", "CP_Policy"]
    )  # fmt: skip
    with pytest.raises(PolicyError, match="'CP_Policy' is not a ConfigMap name"):
        _check_mode(bad)
