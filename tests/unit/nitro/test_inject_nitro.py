"""The webhook's nitro pod: manifests/examples/workloads/nitro.yaml is exactly what it injects,
the parent's command is accepted by the real CLI after the kubelet's $(VAR) expansion and
names only mounted files, and the pods it cannot make work are refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from attestmesh.cli import build_parser
from attestmesh.nitro_cmd import run_nitro_parent
from sidecar.inject import (
    NITRO_PARENT_CONTAINER,
    Decision,
    InjectConfig,
    mutate,
)
from tests.unit.inject.jsonpatch import apply_patch
from tests.unit.inject.test_injected_commands import expand, mounted
from xds.kube import ANNOTATION_INBOUND_PORT, ANNOTATION_INJECTED

EXAMPLE = Path(__file__).resolve().parents[3] / "manifests/examples/workloads/nitro.yaml"


def example_template() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def as_written_by_the_user(template: dict[str, Any]) -> dict[str, Any]:
    t = copy.deepcopy(template)
    for key in ("initContainers", "volumes", "tolerations"):
        del t["spec"][key]
    for key in (ANNOTATION_INJECTED, ANNOTATION_INBOUND_PORT):
        del t["metadata"]["annotations"][key]
    return t


def inject(template: dict[str, Any], cfg: InjectConfig | None = None) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod", **copy.deepcopy(template)}
    pod["metadata"] |= {"name": "enclave-app-7c9d-x1", "namespace": "demo"}
    result = mutate(pod, {}, cfg or InjectConfig())
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(pod, [dict(op) for op in result.patch])
    return out


def test_the_example_is_what_the_webhook_injects() -> None:
    shown = example_template()
    out = inject(as_written_by_the_user(shown))
    assert out["spec"] == shown["spec"]
    assert out["metadata"]["annotations"] == shown["metadata"]["annotations"]
    kubernetes_validate.validate(out, "1.37", strict=True)
    # and it is already injected: a second pass changes nothing
    again = mutate(out, {}, InjectConfig())
    assert again.decision is Decision.ALREADY_INJECTED and again.patch == ()


def parent_argv(pod: dict[str, Any]) -> list[str]:
    (c,) = [c for c in pod["spec"]["initContainers"] if c["name"] == NITRO_PARENT_CONTAINER]
    env = {"POD_NAME": pod["metadata"]["name"], "POD_NAMESPACE": pod["metadata"]["namespace"],
           "POD_IP": "10.0.3.17"}  # fmt: skip
    assert {e["name"] for e in c["env"]} == set(env)
    argv = [expand(a, env) for a in c["command"]]
    assert not any("$(" in a for a in argv), argv
    return argv


def test_the_parent_command_is_accepted_by_the_cli_and_names_mounted_files() -> None:
    template = as_written_by_the_user(example_template())
    template["metadata"]["annotations"]["attestmesh.dev/enclave-peers"] = (
        "10.0.7.1:15006, payments.shop.svc:15006"
    )
    cfg = InjectConfig(nitro_enclave_cpus=4, nitro_hugepages_gi=8)
    pod = inject(template, cfg)
    argv = parent_argv(pod)
    assert argv[0] == "attestmesh"
    args = build_parser().parse_args(argv[1:])
    assert args.func is run_nitro_parent
    assert (args.granted_cpus, args.granted_memory_mib) == (4, 8192)  # = what it requests
    (parent,) = pod["spec"]["initContainers"]
    limits = parent["resources"]["limits"]
    assert limits["aws.ec2.nitro/nitro_enclaves_cpus"] == "4" and limits["hugepages-1Gi"] == "8Gi"
    assert args.workload == "demo/enclave-app-7c9d-x1"
    assert args.inbound_address == "10.0.3.17" and args.inbound_port == 15006
    assert args.peer == ["10.0.7.1:15006", "payments.shop.svc:15006"]
    assert args.cpu_count is None and args.memory_mib is None  # the whole grant
    for path in (str(args.token_file), str(args.ca_bundle)):
        mounted(pod, NITRO_PARENT_CONTAINER, path)


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"attestmesh.dev/enclave-image": None}, "attestmesh.dev/enclave-image"),
        ({"attestmesh.dev/enclave-image": "two words"}, "attestmesh.dev/enclave-image"),
        ({"attestmesh.dev/enclave-eif": "app.eif"}, "absolute path"),
        ({"attestmesh.dev/enclave-peers": "10.0.0.1"}, "not host:port"),
    ],
)
def test_nitro_pods_it_cannot_make_work_are_refused(
    annotations: dict[str, str | None], message: str
) -> None:
    template = as_written_by_the_user(example_template())
    for key, value in annotations.items():
        if value is None:
            del template["metadata"]["annotations"][key]
        else:
            template["metadata"]["annotations"][key] = value
    pod = {"apiVersion": "v1", "kind": "Pod", **template}
    pod["metadata"] |= {"name": "p", "namespace": "demo"}
    result = mutate(pod, {}, InjectConfig())
    assert result.decision is Decision.INVALID_POD and message in result.message
    assert result.patch == ()
