"""The injector's pure core: apply the returned JSON patch to real pods, validate the result."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import kubernetes_validate
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.evidence.claims import Tee
from sidecar.inject import (
    AGENT_CONTAINER,
    ANNOTATION_INJECT,
    ANNOTATION_INJECTED,
    ANNOTATION_TEE,
    BOOTSTRAP_CONTAINER,
    ENVOY_CONTAINER,
    LABEL_INJECT,
    NITRO_PARENT_CONTAINER,
    AdmissionError,
    Decision,
    InjectConfig,
    SimInjection,
    build_admission_response,
    build_patch,
    decode_patch,
    mutate,
    parse_admission_review,
)
from tests.unit.inject.jsonpatch import PatchError, apply_patch

SIM = SimInjection(measurement="a1" * 48)
CFG = InjectConfig(default_tee=Tee.SIM, sim=SIM)  # a test cluster: sim enabled, the default
ENABLED = {"attestmesh.dev/inject": "enabled"}
K8S_VERSION = "1.37"


def pod(name: str = "web-0", ns: str = "shop", **extra_spec: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app": "web"},
            "annotations": {"example.com/team": "payments"},
        },
        "spec": {
            "serviceAccountName": "web",
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/web:1.2",
                    "ports": [{"containerPort": 8080}],
                    "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                }
            ],
        },
    }
    p["spec"].update(extra_spec)
    return p


def validate_pod(p: dict[str, Any]) -> None:
    """Schema (kubernetes-validate, strict) plus the semantic rules the API server enforces
    that a JSON schema cannot express."""
    kubernetes_validate.validate(p, K8S_VERSION, strict=True)
    spec = p["spec"]
    all_containers = [*spec.get("initContainers", []), *spec["containers"]]
    names = [c["name"] for c in all_containers]
    assert len(names) == len(set(names)), f"duplicate container names {names}"
    volumes = {v["name"] for v in spec.get("volumes", [])}
    assert len(volumes) == len(spec.get("volumes", [])), "duplicate volume names"
    for c in all_containers:
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes, f"{c['name']} mounts unknown volume {m['name']}"
        res = c.get("resources", {})
        req, lim = res.get("requests", {}), res.get("limits", {})
        for key in set(req) | set(lim):
            if "/" in key or key.startswith("hugepages-"):
                assert req.get(key) == lim.get(key), f"{key} request must equal limit"
            if key.startswith("hugepages-"):
                assert "cpu" in req or "memory" in req, "hugepages need a cpu or memory request"
    for c in spec["containers"]:
        assert "restartPolicy" not in c


def injected(p: dict[str, Any], ns_labels: dict[str, str] | None = None) -> dict[str, Any]:
    result = mutate(p, ns_labels if ns_labels is not None else ENABLED, CFG)
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(p, [dict(op) for op in result.patch])
    validate_pod(out)
    # idempotent: a second pass yields nothing
    again = mutate(out, ns_labels if ns_labels is not None else ENABLED, CFG)
    assert again.decision is Decision.ALREADY_INJECTED
    assert again.patch == ()
    return out


def container(p: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*p["spec"].get("initContainers", []), *p["spec"]["containers"]]:
        if c["name"] == name:
            found: dict[str, Any] = c
            return found
    raise AssertionError(f"no container {name}")


def test_original_pod_is_valid() -> None:
    validate_pod(pod())


def test_plain_sim_injection_shape() -> None:
    src = pod()
    out = injected(src)
    spec = out["spec"]
    assert [c["name"] for c in spec["initContainers"]] == [
        BOOTSTRAP_CONTAINER,
        AGENT_CONTAINER,
        ENVOY_CONTAINER,
    ]
    assert "restartPolicy" not in spec["initContainers"][0]  # runs to completion first
    assert spec["initContainers"][1]["restartPolicy"] == "Always"
    assert spec["initContainers"][2]["restartPolicy"] == "Always"
    envoy = container(out, ENVOY_CONTAINER)
    # admin stays on loopback: the kubelet probes the inbound listener over TCP
    assert envoy["startupProbe"]["tcpSocket"] == {"port": 15006}
    assert envoy["readinessProbe"]["tcpSocket"] == {"port": 15006}
    assert "httpGet" not in json.dumps(out)
    assert envoy["ports"][0]["containerPort"] == 15006
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["attestmesh-sds"]["emptyDir"]["medium"] == "Memory"
    token = vols["attestmesh-token"]["projected"]["sources"][0]["serviceAccountToken"]
    assert token == {"audience": "attestmesh", "expirationSeconds": 3600, "path": "token"}
    assert vols["attestmesh-trust-bundle"]["configMap"] == {
        "name": "attestmesh-trust-bundle",
        "items": [{"key": "root.pem", "path": "root.pem"}],
    }
    assert vols["attestmesh-sim-platform"]["secret"]["secretName"] == SIM.secret
    agent = container(out, AGENT_CONTAINER)
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["attestmesh-token"]["readOnly"] is True
    assert mounts["attestmesh-sim-platform"]["readOnly"] is True
    assert "attestmesh-sds" in mounts
    assert {"name": "attestmesh-sds", "mountPath": "/var/run/attestmesh"} in envoy["volumeMounts"]
    bootstrap = container(out, BOOTSTRAP_CONTAINER)
    assert bootstrap["command"][:2] == ["attestmesh", "bootstrap"]
    trust = {"name": "attestmesh-trust-bundle", "mountPath": "/etc/attestmesh/trust",
             "readOnly": True}  # fmt: skip
    for c in (bootstrap, agent, envoy):  # the bundle, read-only, where the commands name it
        assert trust in c["volumeMounts"]
        sc = c["securityContext"]  # one uid: Envoy may connect to the agent's 0600 socket
        assert (sc["runAsUser"], sc["runAsGroup"], sc["runAsNonRoot"]) == (65532, 65532, True)
    ann = out["metadata"]["annotations"]
    assert ann[ANNOTATION_INJECTED] == "true"
    assert ann[ANNOTATION_TEE] == "sim"
    assert ann["attestmesh.dev/inbound-port"] == "15006"
    assert ann["example.com/team"] == "payments"
    # the application container is untouched; nothing TEE-specific for sim
    assert out["spec"]["containers"] == src["spec"]["containers"]
    assert "runtimeClassName" not in spec and "affinity" not in spec and "tolerations" not in spec
    assert src == pod()  # mutate did not modify its input


NITRO_ANNOTATIONS = {ANNOTATION_TEE: "nitro", "attestmesh.dev/enclave-image": "reg/app-eif:1"}


def test_nitro_follows_the_karpenter_guide() -> None:
    p = pod()
    p["metadata"]["annotations"].update(NITRO_ANNOTATIONS)
    out = injected(p)
    # agent and Envoy run inside the enclave: the pod gets the parent that launches it
    assert [c["name"] for c in out["spec"]["initContainers"]] == [NITRO_PARENT_CONTAINER]
    parent = container(out, NITRO_PARENT_CONTAINER)
    assert parent["image"] == "reg/app-eif:1" and parent["restartPolicy"] == "Always"
    want = {
        "aws.ec2.nitro/nitro_enclaves": "1",
        "aws.ec2.nitro/nitro_enclaves_cpus": "2",
        "hugepages-1Gi": "4Gi",
    }
    for key, value in want.items():
        assert parent["resources"]["requests"][key] == value
        assert parent["resources"]["limits"][key] == value
    assert parent["resources"]["requests"]["cpu"] == "250m"
    assert {"name": "attestmesh-hugepages", "mountPath": "/dev/hugepages"} in parent["volumeMounts"]
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["attestmesh-hugepages"] == {
        "name": "attestmesh-hugepages",
        "emptyDir": {"medium": "HugePages-1Gi"},
    }
    assert "attestmesh-sds" not in vols and "attestmesh-bootstrap" not in vols
    assert out["spec"]["tolerations"] == [
        {
            "key": "aws-nitro-enclaves-k8s-dp",
            "operator": "Equal",
            "value": "enabled",
            "effect": "NoSchedule",
        }
    ]
    assert out["spec"]["containers"] == p["spec"]["containers"]


def test_nitro_sizes_are_configurable_and_existing_tolerations_kept() -> None:
    cfg = InjectConfig(nitro_enclave_cpus=4, nitro_hugepages_gi=8)
    existing = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    p = pod(tolerations=[existing])
    p["metadata"]["annotations"].update(NITRO_ANNOTATIONS)
    result = mutate(p, ENABLED, cfg)
    out = apply_patch(p, [dict(o) for o in result.patch])
    validate_pod(out)
    parent = container(out, NITRO_PARENT_CONTAINER)
    limits = parent["resources"]["limits"]
    assert limits["aws.ec2.nitro/nitro_enclaves_cpus"] == "4"
    assert limits["hugepages-1Gi"] == "8Gi"
    # the enclave is sized to exactly that grant
    cmd = parent["command"]
    assert cmd[cmd.index("--granted-cpus") + 1] == "4"
    assert cmd[cmd.index("--granted-memory-mib") + 1] == "8192"
    assert out["spec"]["tolerations"][0] == existing
    assert len(out["spec"]["tolerations"]) == 2


@pytest.mark.parametrize(
    ("tee", "runtime_class", "label"),
    [
        ("sev-snp", "kata-qemu-snp", "feature.node.kubernetes.io/cpu-security.sev.snp.enabled"),
        ("tdx", "kata-qemu-tdx", "feature.node.kubernetes.io/cpu-security.tdx.enabled"),
    ],
)
def test_confidential_vm_runtime_class_and_nfd_affinity(
    tee: str, runtime_class: str, label: str
) -> None:
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_TEE] = tee
    out = injected(p)
    assert out["spec"]["runtimeClassName"] == runtime_class
    terms = out["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": label, "operator": "In", "values": ["true"]}]}]


def test_tee_from_namespace_label_and_existing_affinity_is_anded() -> None:
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a", "b"]}
    gpu = {"key": "gpu", "operator": "Exists"}
    p = pod(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [zone]}, {"matchExpressions": [gpu]}]
                }
            }
        }
    )
    out = injected(p, {**ENABLED, "attestmesh.dev/tee": "tdx"})
    snp = {
        "key": "feature.node.kubernetes.io/cpu-security.tdx.enabled",
        "operator": "In",
        "values": ["true"],
    }
    terms = out["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [zone, snp]}, {"matchExpressions": [gpu, snp]}]
    assert out["metadata"]["annotations"][ANNOTATION_TEE] == "tdx"


def test_sgx_epc_and_affinity() -> None:
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_TEE] = "sgx"
    out = injected(p)
    res = container(out, AGENT_CONTAINER)["resources"]
    assert res["requests"]["sgx.intel.com/epc"] == res["limits"]["sgx.intel.com/epc"] == "64Mi"
    assert res["requests"]["sgx.intel.com/enclave"] == "1"
    expr = out["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]["matchExpressions"]
    assert expr == [
        {
            "key": "feature.node.kubernetes.io/cpu-security.sgx.enabled",
            "operator": "In",
            "values": ["true"],
        }
    ]
    assert "runtimeClassName" not in out["spec"]


def test_pod_label_opts_in_without_namespace_label() -> None:
    p = pod()
    p["metadata"]["labels"][LABEL_INJECT] = "enabled"
    injected(p, {})


def test_pod_annotation_true_is_no_opt_in() -> None:
    # the webhook's selectors cannot see annotations: the server never sends such a pod, and
    # mutate agrees (attestmesh lint tells users migrating from the annotation)
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_INJECT] = "true"
    result = mutate(p, {}, CFG)
    assert result.decision is Decision.NOT_SELECTED and result.allowed and result.patch == ()
    p["metadata"]["labels"][LABEL_INJECT] = "enabled"
    assert mutate(p, {}, CFG).decision is Decision.INJECTED


def test_namespace_label_disabled_overrides_the_pod_label() -> None:
    p = pod()
    p["metadata"]["labels"][LABEL_INJECT] = "enabled"
    result = mutate(p, {LABEL_INJECT: "disabled"}, CFG)
    assert result.decision is Decision.NOT_SELECTED and result.patch == ()
    assert mutate(p, {LABEL_INJECT: "other"}, CFG).decision is Decision.INJECTED


def test_not_selected_and_opt_out_give_empty_patches() -> None:
    assert mutate(pod(), {}, CFG).decision is Decision.NOT_SELECTED
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_INJECT] = "false"
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.OPTED_OUT
    assert result.allowed and result.patch == ()


def test_opt_out_by_pod_label() -> None:
    p = pod()
    p["metadata"]["labels"]["attestmesh.dev/inject"] = "disabled"
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.OPTED_OUT and result.patch == ()


def test_control_plane_namespace_is_never_injected() -> None:
    p = pod(ns="attestmesh-system")
    p["metadata"]["labels"][LABEL_INJECT] = "enabled"
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.CONTROL_PLANE
    assert result.allowed and result.patch == ()
    other = InjectConfig(control_plane_namespace="mesh")
    assert mutate(pod(ns="mesh"), ENABLED, other).decision is Decision.CONTROL_PLANE


@pytest.mark.parametrize("ns", ["kube-system", "kube-public", "kube-node-lease"])
def test_kubernetes_system_namespaces_are_never_injected(ns: str) -> None:
    # whatever the pod's and the namespace's labels say: 1.20 servers do not set the
    # kubernetes.io/metadata.name label the webhook's namespaceSelector excludes them by
    p = pod(ns=ns)
    p["metadata"]["labels"][LABEL_INJECT] = "enabled"
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.SYSTEM_NAMESPACE
    assert result.allowed and result.patch == ()
    assert mutate(pod(ns="kube-systems"), ENABLED, CFG).decision is Decision.INJECTED


def test_existing_init_containers_and_volumes_are_kept_after_ours() -> None:
    p = pod(
        initContainers=[{"name": "migrate", "image": "registry.example/migrate:1"}],
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    p["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    out = injected(p)
    assert [c["name"] for c in out["spec"]["initContainers"]][-1] == "migrate"
    assert out["spec"]["volumes"][0] == {"name": "data", "emptyDir": {}}


def test_pod_without_metadata_annotations_or_generate_name() -> None:
    p = pod()
    del p["metadata"]["annotations"]
    del p["metadata"]["name"]
    p["metadata"]["generateName"] = "web-"
    out = injected(p)
    assert out["metadata"]["annotations"][ANNOTATION_INJECTED] == "true"


def test_host_network_is_denied_with_a_clear_message() -> None:
    result = mutate(pod(hostNetwork=True), ENABLED, CFG)
    assert result.decision is Decision.HOST_NETWORK
    assert not result.allowed
    assert "hostNetwork" in result.message and "web-0" in result.message
    assert result.patch == ()


def test_conflicting_names_are_denied() -> None:
    p = pod()
    p["spec"]["containers"].append({"name": "attestmesh-envoy", "image": "envoy"})
    result = mutate(p, ENABLED, CFG)
    assert result.decision is Decision.NAME_CONFLICT and not result.allowed
    assert "container attestmesh-envoy" in result.message
    q = pod(volumes=[{"name": "attestmesh-sds", "emptyDir": {}}])
    assert "volume attestmesh-sds" in mutate(q, ENABLED, CFG).message


def test_injected_annotation_without_containers_still_injects() -> None:
    """A copied annotation alone does not make a pod injected."""
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_INJECTED] = "true"
    out = injected(p)
    assert container(out, AGENT_CONTAINER)


@pytest.mark.parametrize("tee", ["nvidia-gpu", "sev", "", "SEV-SNP"])
def test_unknown_tee_is_denied(tee: str) -> None:
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_TEE] = tee
    result = mutate(p, {**ENABLED, "attestmesh.dev/tee": "sim"} if tee == "" else ENABLED, CFG)
    if tee == "":
        assert result.decision is Decision.INJECTED  # empty falls back to the namespace label
        return
    assert result.decision is Decision.UNKNOWN_TEE and not result.allowed
    assert "sev-snp" in result.message


def test_default_tee_comes_from_config() -> None:
    cfg = InjectConfig(default_tee=Tee.SEV_SNP)
    result = mutate(pod(), ENABLED, cfg)
    assert result.tee is Tee.SEV_SNP


def test_production_defaults_refuse_sim_and_a_pod_without_a_tee() -> None:
    prod = InjectConfig()
    assert prod.sim is None and prod.default_tee is None
    result = mutate(pod(), ENABLED, prod)
    assert result.decision is Decision.NO_TEE and not result.allowed
    assert "attestmesh.dev/tee" in result.message and "sim" not in result.message
    p = pod()
    p["metadata"]["annotations"][ANNOTATION_TEE] = "sim"
    result = mutate(p, ENABLED, prod)
    assert result.decision is Decision.TEE_DISABLED and not result.allowed
    assert "test clusters only" in result.message
    # a namespace label cannot turn it on either
    result = mutate(pod(), {**ENABLED, "attestmesh.dev/tee": "sim"}, prod)
    assert result.decision is Decision.TEE_DISABLED
    assert mutate(p, ENABLED, CFG).decision is Decision.INJECTED


def test_inbound_port_annotation_is_honoured_and_app_port_required() -> None:
    p = pod()
    p["metadata"]["annotations"]["attestmesh.dev/inbound-port"] = "16000"
    out = injected(p)
    envoy = container(out, ENVOY_CONTAINER)
    assert envoy["startupProbe"]["tcpSocket"] == {"port": 16000}
    assert envoy["ports"][0]["containerPort"] == 16000
    assert out["metadata"]["annotations"]["attestmesh.dev/inbound-port"] == "16000"
    for bad in ("0", "http", "70000"):
        q = pod()
        q["metadata"]["annotations"]["attestmesh.dev/inbound-port"] = bad
        result = mutate(q, ENABLED, CFG)
        assert result.decision is Decision.INVALID_POD and "is not a port" in result.message
    clash = pod()
    clash["metadata"]["annotations"]["attestmesh.dev/app-port"] = "15006"
    assert "must differ" in mutate(clash, ENABLED, CFG).message
    portless = pod()
    del portless["spec"]["containers"][0]["ports"]
    result = mutate(portless, ENABLED, CFG)
    assert result.decision is Decision.NO_APP_PORT and not result.allowed
    assert "attestmesh.dev/app-port" in result.message
    portless["metadata"]["annotations"]["attestmesh.dev/app-port"] = "9000"
    injected(portless)


@pytest.mark.parametrize("bad", [None, [], {"metadata": {}}, {"spec": "x"}, "pod"])
def test_garbage_is_refused_not_raised(bad: Any) -> None:
    result = mutate(bad, ENABLED, CFG)
    assert result.decision is Decision.INVALID_POD and not result.allowed


# --- build_patch ------------------------------------------------------------------------------

json_scalars = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=3)
json_values = st.recursive(
    json_scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text("a/~b", max_size=3), kids, max_size=3)
    ),
    max_leaves=12,
)
json_objects = st.dictionaries(st.text("a/~b", max_size=3), json_values, max_size=4)


@settings(max_examples=300, deadline=None)
@given(json_objects, json_objects)
def test_build_patch_turns_before_into_after(before: dict[str, Any], after: dict[str, Any]) -> None:
    ops = build_patch(before, after)
    assert apply_patch(before, ops) == after
    if before == after:
        assert ops == []


def test_build_patch_escapes_pointer_tokens() -> None:
    ops = build_patch({"a": {}}, {"a": {"x/y~z": 1}})
    assert ops == [{"op": "add", "path": "/a/x~1y~0z", "value": 1}]
    with pytest.raises(PatchError):
        apply_patch({}, [{"op": "remove", "path": "/missing"}])


# --- AdmissionReview ---------------------------------------------------------------------------


def review(obj: Any, uid: str = "1234-abcd", ns: str = "shop") -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {"uid": uid, "namespace": ns, "operation": "CREATE", "object": obj},
        }
    ).encode()


def test_admission_round_trip() -> None:
    uid, obj, ns = parse_admission_review(review(pod()))
    assert (uid, ns) == ("1234-abcd", "shop")
    resp = build_admission_response(uid, mutate(obj, ENABLED, CFG))["response"]
    assert resp["uid"] == uid and resp["allowed"] is True and resp["patchType"] == "JSONPatch"
    out = apply_patch(pod(), decode_patch(resp))
    validate_pod(out)
    denied = build_admission_response(uid, mutate(pod(hostNetwork=True), ENABLED, CFG))
    assert denied["response"]["allowed"] is False
    assert "hostNetwork" in denied["response"]["status"]["message"]
    none = build_admission_response(uid, mutate(pod(), {}, CFG))["response"]
    assert "patch" not in none and none["allowed"] is True


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).encode(),
        json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(),
        review(pod(), uid=""),
        review({"kind": "Service", "metadata": {}}),
        b"\xff\xfe",
    ],
)
def test_bad_admission_reviews_raise_admission_error(body: bytes) -> None:
    with pytest.raises(AdmissionError):
        parse_admission_review(body)


def test_decode_patch_rejects_garbage() -> None:
    with pytest.raises(AdmissionError):
        decode_patch({"patch": "!!!"})
    with pytest.raises(AdmissionError):
        decode_patch({"patch": base64.b64encode(b'{"op":"add"}').decode()})
    assert decode_patch({}) == []


def test_mutation_is_deterministic() -> None:
    a = mutate(copy.deepcopy(pod()), ENABLED, CFG)
    b = mutate(copy.deepcopy(pod()), ENABLED, CFG)
    assert a == b
