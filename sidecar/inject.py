"""Sidecar injection: a pure ``mutate(pod)`` step and a thin aiohttp AdmissionReview app.

What an injected pod looks like (``initContainers`` in this order, before any of the pod's own).
Every command is the real ``attestmesh`` CLI (``tests/unit/inject/test_injected_commands.py``
parses them); ``$(POD_NAMESPACE)/$(POD_NAME)`` is expanded by the kubelet from the container's
env and is the workload's registration name (``xds.kube.workload_name``) and Envoy node id.

1. ``attestmesh-bootstrap``: a plain init container running ``attestmesh bootstrap --node
   $(POD_NAMESPACE)/$(POD_NAME) --xds <xds> --sds-socket <socket> --admin-port <port> --xds-ca
   /etc/attestmesh/trust/root.pem --trust-domain <td> -o /etc/attestmesh/envoy/bootstrap.json``
   into the ``attestmesh-bootstrap`` volume (emptyDir, medium Memory). It runs to completion
   before anything else starts, so Envoy never starts without its bootstrap.
2. ``attestmesh-agent``: a native sidecar (``restartPolicy: Always``) running ``attestmesh agent
   --control-plane <url> --workload $(POD_NAMESPACE)/$(POD_NAME) --ca-bundle <root.pem>
   --sds-socket <socket> --token-file <token> --tee <tee>``. It holds the workload key, attests,
   and serves SDS on a Unix socket (mode 0600) in the ``attestmesh-sds`` volume. It presents
   the pod's projected service-account token (audience ``attestmesh``, ``expirationSeconds:
   3600``). Its startup probe, ``attestmesh agent --check --sds-socket <socket>``, passes once
   the socket serves a currently valid certificate, so Envoy starts with the certificate its
   mutual-TLS xDS connection presents.
3. ``attestmesh-envoy``: a native sidecar. Its admin API stays on 127.0.0.1 (it can dump the
   configuration, stop the proxy, change runtime values: never on the pod network). The kubelet
   instead probes the inbound mTLS listener with TCP (startup and readiness); that listener
   exists only once Envoy holds its configuration from the control plane and its certificate
   from the agent. The kubelet starts the application containers only after this startup
   probe passes, so the application starts after its proxy can serve the mesh.

The mesh root bundle comes from the ConfigMap ``attestmesh-trust-bundle`` (key ``root.pem``),
mounted read-only at ``/etc/attestmesh/trust`` into all three; the control plane keeps it in
every namespace with injected pods (``xds.kube.trustbundle``). The volume is not optional: a pod
whose namespace lacks it waits in ContainerCreating instead of trusting nothing or anything.
All three run as one non-root uid (``InjectConfig.sidecar_uid``) so that Envoy may connect to
the agent's 0600 socket. The inbound port is the pod's ``attestmesh.dev/inbound-port``
annotation, else ``InjectConfig.inbound_port``, written back onto the pod so the registration
(``xds.kube.workloads.pod_ports``) and the probes agree; a pod without an application port
(``attestmesh.dev/app-port`` or a containerPort) is refused: it would never be registered and
its proxy would never become ready.

Per TEE (pod annotation ``attestmesh.dev/tee``, else the namespace label of the same name, else
``InjectConfig.default_tee``):

- ``nitro``: agent, Envoy and the application run inside the enclave (``attestmesh
  enclave-init``, the EIF's entrypoint); instead of bootstrap, agent and Envoy the pod gets one
  native sidecar, ``attestmesh-nitro-parent`` (``attestmesh nitro-parent``, image: the pod's
  ``attestmesh.dev/enclave-image`` annotation, which is required, holding the EIF at
  ``attestmesh.dev/enclave-eif``, default ``/enclave/app.eif``). It starts the enclave sized
  to the pod's grant, bridges vsock to exactly the control plane's API and xDS addresses and the
  peers of ``attestmesh.dev/enclave-peers`` (comma-separated ``host:port``), forwards the
  inbound mesh port to the enclave, and is ready (HTTP ``/readyz``) once the enclave's agent
  holds a certificate. It requests and limits ``aws.ec2.nitro/nitro_enclaves``,
  ``aws.ec2.nitro/nitro_enclaves_cpus`` and ``hugepages-1Gi`` and mounts an emptyDir with medium
  ``HugePages-1Gi`` at ``/dev/hugepages``; the pod tolerates the enclave NodePool taint
  ``aws-nitro-enclaves-k8s-dp=enabled:NoSchedule``. This follows the example pod of Karpenter's
  "Using Nitro Enclaves" guide (same extended resources in requests and limits, cpu request
  ``250m`` because a hugepages request needs a cpu or memory request beside it).
- ``sev-snp`` / ``tdx``: ``runtimeClassName`` (``kata-qemu-snp`` / ``kata-qemu-tdx`` by default)
  and a required node affinity on Node Feature Discovery's
  ``feature.node.kubernetes.io/cpu-security.sev.snp.enabled=true`` /
  ``feature.node.kubernetes.io/cpu-security.tdx.enabled=true``.
- ``sgx``: the agent container (run under Gramine inside the enclave) requests and limits
  ``sgx.intel.com/epc`` and ``sgx.intel.com/enclave`` (Intel's SGX device plugin) and the pod
  requires NFD's ``feature.node.kubernetes.io/cpu-security.sgx.enabled=true``.
- ``sev-snp`` / ``tdx`` / ``sgx`` pods also tolerate every TEE-host taint of
  manifests/nodes/nfd (``TEE_HOST_TAINTS``: ``attestmesh.dev/tee-host.<tee>=true:NoSchedule``),
  which keeps ordinary pods off TEE capacity; the node affinity above picks the right host (an
  Intel host may be TDX- and SGX-capable at once, so each tolerates all three).
- ``sim``: only when ``InjectConfig.sim`` is set (test and development clusters); otherwise
  refused, and no namespace label or annotation can turn it on. The agent gets
  ``--sim-platform-key`` from the Secret ``InjectConfig.sim.secret`` in the pod's namespace
  (mounted read-only) and ``--sim-measurement`` from the configuration.

The agent's ``--tee`` is the pod's TEE, except ``tdx``, whose evidence comes through
configfs-tsm (``--tee tsm``). With no TEE chosen (annotation, namespace label, or
``InjectConfig.default_tee``, None by default) the pod is refused.

Composite GPU attestation: a ``sev-snp``/``tdx`` pod annotated ``attestmesh.dev/attest-gpus:
"true"`` (or any such pod requesting GPUs when ``InjectConfig.attest_gpus`` is set, unless it
annotates ``"false"``) gets ``--gpus N``, N the sum of its containers' limits of
``nvidia.com/pgpu`` (NVIDIA's confidential-containers sandbox device plugin) and
``nvidia.com/gpu``: the GPUs of one confidential VM. Asked for on another TEE, with no GPU
requested, more than 8 or a count that is not a whole number: refused. A ``sev-snp``/``tdx`` pod
requesting GPUs runs in the GPU runtime class (``kata-qemu-nvidia-gpu-snp``/``-tdx``).

The attested control plane: the pod's ``attestmesh.dev/control-plane-policy`` (else
``InjectConfig.control_plane_policy``) names a ConfigMap in its namespace whose ``policy.yaml``
(an AttestationPolicy) the agent checks the control plane's evidence against before sending its
own (``--control-plane-policy``, mounted read-only, not optional); not for nitro pods yet
(refused).

Opt-in: namespace label ``attestmesh.dev/inject: enabled`` or pod label
``attestmesh.dev/inject: enabled``, what the two webhooks' namespaceSelector/objectSelector
see on every API server version, so pods that did not opt in never wait on the control plane.
The annotation ``attestmesh.dev/inject: "true"`` is not an opt-in (no selector can see it;
``attestmesh lint`` flags it). Opt-out: pod annotation ``attestmesh.dev/inject: "false"`` or
pod label ``attestmesh.dev/inject: disabled``; a namespace labelled ``disabled`` opts all its
pods out (the pod label cannot opt in there).

Decisions (``MutationResult``): opted out, not opted in, already injected, or the control-plane
namespace -> allowed with an empty patch. A pod the injector cannot make correct (host network,
a container or volume name already used by the injector, no TEE, an unknown or disabled TEE, no
application port, an invalid inbound port) -> denied with a clear
message: an opted-in workload silently running without its sidecar would be unattested, so it
is refused rather than passed unchanged. (What happens when the webhook is unreachable is the
MutatingWebhookConfiguration's ``failurePolicy``.)

The patch is computed by diffing the original pod with the mutated one (``build_patch``), so it
is a correct RFC 6902 patch for any input shape.
"""

from __future__ import annotations

import base64
import binascii
import copy
import enum
import json
import logging
import re
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from certs.evidence.claims import Tee
from certs.evidence.composite import MAX_GPUS
from xds.kube.names import (
    ANNOTATION_APP_PORT,
    ANNOTATION_INBOUND_PORT,
    ANNOTATION_INJECT,
    ANNOTATION_INJECTED,
    DEFAULT_INBOUND_PORT,
    HUGEPAGES_1GI,
    HUGEPAGES_1GI_MEDIUM,
    LABEL_INJECT,
    NITRO_DP_LABEL,
    NITRO_ENCLAVE_CPUS,
    NITRO_ENCLAVES,
    SYSTEM_NAMESPACES,
    TOKEN_AUDIENCE,
    TRUST_CONFIGMAP,
    TRUST_KEY,
)
from xds.kube.workloads import pod_ports

log = logging.getLogger(__name__)

ANNOTATION_TEE = "attestmesh.dev/tee"
LABEL_TEE = "attestmesh.dev/tee"

BOOTSTRAP_CONTAINER = "attestmesh-bootstrap"
AGENT_CONTAINER = "attestmesh-agent"
ENVOY_CONTAINER = "attestmesh-envoy"
NITRO_PARENT_CONTAINER = "attestmesh-nitro-parent"
CONTAINER_NAMES = (BOOTSTRAP_CONTAINER, AGENT_CONTAINER, ENVOY_CONTAINER, NITRO_PARENT_CONTAINER)
SDS_VOLUME = "attestmesh-sds"
BOOTSTRAP_VOLUME = "attestmesh-bootstrap"
TOKEN_VOLUME = "attestmesh-token"  # noqa: S105 (a volume name)
TRUST_VOLUME = "attestmesh-trust-bundle"
SIM_VOLUME = "attestmesh-sim-platform"
HUGEPAGES_VOLUME = "attestmesh-hugepages"
NITRO_RUN_VOLUME = "attestmesh-nitro-run"
NITRO_LOG_VOLUME = "attestmesh-nitro-log"
VOLUME_NAMES = (
    SDS_VOLUME, BOOTSTRAP_VOLUME, TOKEN_VOLUME, TRUST_VOLUME, SIM_VOLUME, HUGEPAGES_VOLUME,
    NITRO_RUN_VOLUME, NITRO_LOG_VOLUME,
)  # fmt: skip

# The mesh root bundle (TRUST_CONFIGMAP, key TRUST_KEY: xds.kube.names): the control plane keeps
# it in every namespace with injected pods (xds.kube.trustbundle); the agent verifies the
# attestation API with it and Envoy the xDS server. A pod whose namespace lacks it waits in
# ContainerCreating (the volume is not optional).
TRUST_DIR = "/etc/attestmesh/trust"
TRUST_BUNDLE = f"{TRUST_DIR}/{TRUST_KEY}"
SDS_DIR = "/var/run/attestmesh"
SDS_SOCKET = f"{SDS_DIR}/sds.sock"
BOOTSTRAP_DIR = "/etc/attestmesh/envoy"
BOOTSTRAP_FILE = f"{BOOTSTRAP_DIR}/bootstrap.json"
TOKEN_DIR = "/var/run/secrets/attestmesh"  # noqa: S105 (a path)
TOKEN_PATH = f"{TOKEN_DIR}/token"
SIM_DIR = "/etc/attestmesh/sim"
# The workload (registration) name and Envoy node id, ``xds.kube.workload_name``: the kubelet
# expands $(VAR) in command and args from the container's env (POD_NAMESPACE, POD_NAME).
WORKLOAD_REF = "$(POD_NAMESPACE)/$(POD_NAME)"

ANNOTATION_ENCLAVE_IMAGE = "attestmesh.dev/enclave-image"
ANNOTATION_ENCLAVE_EIF = "attestmesh.dev/enclave-eif"
ANNOTATION_ENCLAVE_PEERS = "attestmesh.dev/enclave-peers"
DEFAULT_EIF = "/enclave/app.eif"
NITRO_READY_PORT = 15021
SGX_EPC = "sgx.intel.com/epc"
# The NoSchedule taints manifests/nodes/nfd puts on TEE-capable hosts (value "true").
TEE_HOST_TAINTS: Mapping[Tee, str] = {
    Tee.SEV_SNP: "attestmesh.dev/tee-host.sev-snp",
    Tee.TDX: "attestmesh.dev/tee-host.tdx",
    Tee.SGX: "attestmesh.dev/tee-host.sgx",
}
SGX_ENCLAVE = "sgx.intel.com/enclave"
# Secret release (SecretPolicy): the pod lists what its agent fetches; the agent writes them to
# a memory-backed volume every application container mounts read-only.
ANNOTATION_SECRETS = "attestmesh.dev/secrets"
SECRETS_VOLUME = "attestmesh-secrets"
SECRETS_DIR = "/run/attestmesh/secrets"
_SECRET_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?")

INJECTABLE_TEES = (Tee.SIM, Tee.NITRO, Tee.SEV_SNP, Tee.TDX, Tee.SGX)
# Composite CPU + GPU attestation (certs.evidence.composite): the agent of a confidential VM pod
# that requests NVIDIA GPUs attaches them to its evidence (``attestmesh agent --gpus N``, N the
# GPUs its containers request), when the pod annotates attest-gpus "true" or, unless it says
# "false", when the injector is configured so (``InjectConfig.attest_gpus``). A confidential VM
# pod requesting GPUs runs in the GPU runtime class (passthrough into the VM): NVIDIA's
# confidential-containers reference architecture names kata-qemu-nvidia-gpu-snp/-tdx and the
# sandbox device plugin's resource nvidia.com/pgpu (nvidia.com/gpu elsewhere).
ANNOTATION_ATTEST_GPUS = "attestmesh.dev/attest-gpus"
GPU_RESOURCES = ("nvidia.com/pgpu", "nvidia.com/gpu")
GPU_TEES = (Tee.SEV_SNP, Tee.TDX)
# The attested control plane (attestmesh.cp_attest): the agent sends evidence only to a control
# plane whose own evidence the AttestationPolicy in this ConfigMap (key policy.yaml, in the pod's
# namespace) admits (``--control-plane-policy``). Named by the pod's annotation, else by
# ``InjectConfig.control_plane_policy``. The volume is not optional: a pod whose ConfigMap is
# missing waits in ContainerCreating instead of trusting any control plane.
ANNOTATION_CP_POLICY = "attestmesh.dev/control-plane-policy"
CP_POLICY_VOLUME = "attestmesh-control-plane-policy"
CP_POLICY_KEY = "policy.yaml"
CP_POLICY_DIR = "/etc/attestmesh/control-plane-policy"
CP_POLICY_FILE = f"{CP_POLICY_DIR}/{CP_POLICY_KEY}"
_CONFIGMAP_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_WHOLE = re.compile(r"[0-9]{1,4}")
# The pod's TEE -> ``attestmesh agent --tee``: TDX evidence comes through configfs-tsm.
AGENT_TEE: Mapping[Tee, str] = {
    Tee.SIM: "sim",
    Tee.NITRO: "nitro",
    Tee.SEV_SNP: "sev-snp",
    Tee.TDX: "tsm",
    Tee.SGX: "sgx",
}


@dataclass(frozen=True, slots=True)
class SimInjection:
    """Enables ``attestmesh.dev/tee: sim`` (test and development clusters only: a simulated
    platform proves nothing). The agent reads the simulated platform's private key from the
    Secret ``secret`` (key ``key``) in the pod's namespace and reports ``measurement``."""

    measurement: str  # 96 hex characters
    secret: str = "attestmesh-sim-platform"  # noqa: S105 (a Secret name)
    key: str = "platform-key.pem"


@dataclass(frozen=True, slots=True)
class InjectConfig:
    """What the injector adds. Frozen; built once in main() from settings (the trust domain is
    filled in by Kubernetes mode from the running control plane)."""

    agent_image: str = "ghcr.io/attestmesh/attestmesh:0.1.0"
    envoy_image: str = "envoyproxy/envoy:v1.36.2"
    control_plane_url: str = "https://attestmesh.attestmesh-system.svc:8443"
    secret_url: str = "https://attestmesh.attestmesh-system.svc:8444"  # noqa: S105 (a URL)
    xds_address: str = "attestmesh.attestmesh-system.svc:18000"
    control_plane_namespace: str = "attestmesh-system"
    trust_domain: str = "attestmesh.local"
    # None: a pod must choose its TEE (annotation or namespace label); it is refused otherwise.
    default_tee: Tee | None = None
    # None: ``sim`` is refused, so a production cluster cannot be given simulated attestation.
    sim: SimInjection | None = None
    envoy_admin_port: int = 15000  # on 127.0.0.1 only (see _envoy_container)
    inbound_port: int = DEFAULT_INBOUND_PORT  # unless the pod's annotation names one
    # Agent and Envoy share the SDS socket (mode 0600): one uid for every injected container.
    sidecar_uid: int = 65532
    token_expiration_seconds: int = 3600
    attestmesh_command: tuple[str, ...] = ("attestmesh",)
    envoy_command: tuple[str, ...] = ("envoy",)
    # nitro
    nitro_enclaves: int = 1
    nitro_enclave_cpus: int = 2
    nitro_hugepages_gi: int = 4
    nitro_cpu_request: str = "250m"
    # confidential VMs
    snp_runtime_class: str = "kata-qemu-snp"
    tdx_runtime_class: str = "kata-qemu-tdx"
    # ... of pods requesting GPUs (``gpu_resources``), which are passed through into the VM
    snp_gpu_runtime_class: str = "kata-qemu-nvidia-gpu-snp"
    tdx_gpu_runtime_class: str = "kata-qemu-nvidia-gpu-tdx"
    gpu_resources: tuple[str, ...] = GPU_RESOURCES
    snp_node_labels: Mapping[str, str] = field(
        default_factory=lambda: {"feature.node.kubernetes.io/cpu-security.sev.snp.enabled": "true"}
    )
    tdx_node_labels: Mapping[str, str] = field(
        default_factory=lambda: {"feature.node.kubernetes.io/cpu-security.tdx.enabled": "true"}
    )
    # sgx
    sgx_epc: str = "64Mi"
    sgx_node_labels: Mapping[str, str] = field(
        default_factory=lambda: {"feature.node.kubernetes.io/cpu-security.sgx.enabled": "true"}
    )
    # composite CPU + GPU: sev-snp/tdx pods requesting nvidia.com/gpu get ``--gpus`` (unless
    # they annotate attest-gpus "false"); off: only pods annotating "true"
    attest_gpus: bool = False
    # the ConfigMap with the control plane's AttestationPolicy every agent checks it against
    # (None: only pods naming one in their annotation)
    control_plane_policy: str | None = None

    def allowed_tees(self) -> tuple[Tee, ...]:
        return tuple(t for t in INJECTABLE_TEES if t is not Tee.SIM or self.sim is not None)


class Decision(enum.StrEnum):
    """Why the injector answered as it did (bounded: usable as a metric label)."""

    INJECTED = "injected"
    NOT_SELECTED = "not_selected"
    OPTED_OUT = "opted_out"
    ALREADY_INJECTED = "already_injected"
    CONTROL_PLANE = "control_plane"
    SYSTEM_NAMESPACE = "system_namespace"
    HOST_NETWORK = "host_network"
    NAME_CONFLICT = "name_conflict"
    NO_TEE = "no_tee"
    UNKNOWN_TEE = "unknown_tee"
    TEE_DISABLED = "tee_disabled"
    NO_APP_PORT = "no_app_port"
    INVALID_POD = "invalid_pod"


_DENIALS = frozenset(
    {
        Decision.HOST_NETWORK,
        Decision.NAME_CONFLICT,
        Decision.NO_TEE,
        Decision.UNKNOWN_TEE,
        Decision.TEE_DISABLED,
        Decision.NO_APP_PORT,
        Decision.INVALID_POD,
    }
)


@dataclass(frozen=True, slots=True)
class MutationResult:
    decision: Decision
    patch: tuple[Mapping[str, Any], ...] = ()
    message: str = ""
    tee: Tee | None = None

    @property
    def allowed(self) -> bool:
        return self.decision not in _DENIALS


# ---------------------------------------------------------------------------------------------
# JSON patch (RFC 6902) by diffing two JSON documents


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def build_patch(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """RFC 6902 operations turning ``before`` into ``after``. Objects are diffed key by key;
    a list that only grew at its end gets ``add`` operations; any other changed list is
    replaced whole. The root must be an object on both sides."""
    ops: list[dict[str, Any]] = []
    if isinstance(before, dict) and isinstance(after, dict):
        for key in before:
            if key not in after:
                ops.append({"op": "remove", "path": f"{path}/{_escape(key)}"})
        for key, value in after.items():
            sub = f"{path}/{_escape(key)}"
            if key not in before:
                ops.append({"op": "add", "path": sub, "value": copy.deepcopy(value)})
            else:
                ops.extend(build_patch(before[key], value, sub))
        return ops
    if isinstance(before, list) and isinstance(after, list) and before != after:
        if len(after) > len(before) and after[: len(before)] == before:
            return [
                {"op": "add", "path": f"{path}/-", "value": copy.deepcopy(v)}
                for v in after[len(before) :]
            ]
        return [{"op": "replace", "path": path, "value": copy.deepcopy(after)}]
    if before != after or type(before) is not type(after):
        return [{"op": "replace", "path": path, "value": copy.deepcopy(after)}]
    return []


# ---------------------------------------------------------------------------------------------
# mutate (pure)


def _names(items: Any) -> set[str]:
    if not isinstance(items, list):
        return set()
    return {str(i["name"]) for i in items if isinstance(i, dict) and isinstance(i.get("name"), str)}


def _select_tee(
    annotations: Mapping[str, Any], ns_labels: Mapping[str, str], cfg: InjectConfig
) -> str:
    default = cfg.default_tee.value if cfg.default_tee is not None else ""
    return str(annotations.get(ANNOTATION_TEE) or ns_labels.get(LABEL_TEE) or default)


def _affinity_for(labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": k, "operator": "In", "values": [v]}
                            for k, v in sorted(labels.items())
                        ]
                    }
                ]
            }
        }
    }


def _merge_required_affinity(spec: dict[str, Any], labels: Mapping[str, str]) -> None:
    """AND the TEE's node requirements into every existing required term (terms are ORed)."""
    wanted = _affinity_for(labels)["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"][0]["matchExpressions"]
    affinity = spec.setdefault("affinity", {})
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms")
    if not isinstance(terms, list) or not terms:
        required["nodeSelectorTerms"] = [{"matchExpressions": list(wanted)}]
        return
    for term in terms:
        exprs = term.setdefault("matchExpressions", [])
        for expr in wanted:
            if expr not in exprs:
                exprs.append(expr)


def _security_context(cfg: InjectConfig) -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": cfg.sidecar_uid,
        "runAsGroup": cfg.sidecar_uid,
        "capabilities": {"drop": ["ALL"]},
    }


_POD_ENV = [
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
]
_TRUST_MOUNT = {"name": TRUST_VOLUME, "mountPath": TRUST_DIR, "readOnly": True}


def agent_command(
    tee: Tee, cfg: InjectConfig, *, gpus: int = 0, control_plane_policy: bool = False
) -> list[str]:
    """``attestmesh agent`` as the injected agent runs it ($(VAR)s expanded by the kubelet).
    ``gpus``: attach that many GPUs; ``control_plane_policy``: check the control plane against
    the mounted policy first."""
    cmd = [
        *cfg.attestmesh_command,
        "agent",
        "--control-plane",
        cfg.control_plane_url,
        "--workload",
        WORKLOAD_REF,
        "--ca-bundle",
        TRUST_BUNDLE,
        "--sds-socket",
        SDS_SOCKET,
        "--token-file",
        TOKEN_PATH,
        "--tee",
        AGENT_TEE[tee],
    ]
    if tee is Tee.SIM and cfg.sim is not None:
        key = f"{SIM_DIR}/{cfg.sim.key}"
        cmd += ["--sim-platform-key", key, "--sim-measurement", cfg.sim.measurement]
    if gpus:
        cmd += ["--gpus", str(gpus)]
    if control_plane_policy:
        cmd += [
            "--control-plane-policy", CP_POLICY_FILE,
            "--control-plane-trust-domain", cfg.trust_domain,
        ]  # fmt: skip
    return cmd


def agent_check_command(cfg: InjectConfig) -> list[str]:
    """The agent's startup probe: the SDS socket serves a currently valid certificate."""
    return [*cfg.attestmesh_command, "agent", "--check", "--sds-socket", SDS_SOCKET]


def bootstrap_command(cfg: InjectConfig) -> list[str]:
    """``attestmesh bootstrap`` as the init container runs it: node id = workload name, mutual
    TLS to the control plane verified with the mounted trust bundle."""
    return [
        *cfg.attestmesh_command,
        "bootstrap",
        "--node",
        WORKLOAD_REF,
        "--xds",
        cfg.xds_address,
        "--sds-socket",
        SDS_SOCKET,
        "--admin-port",
        str(cfg.envoy_admin_port),
        "--xds-ca",
        TRUST_BUNDLE,
        "--trust-domain",
        cfg.trust_domain,
        "-o",
        BOOTSTRAP_FILE,
    ]


def _agent_container(
    tee: Tee, cfg: InjectConfig, gpus: int = 0, cp_policy: str | None = None
) -> dict[str, Any]:
    mounts = [
        {"name": SDS_VOLUME, "mountPath": SDS_DIR},
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
        dict(_TRUST_MOUNT),
    ]
    requests: dict[str, str] = {"cpu": "50m", "memory": "64Mi"}
    limits: dict[str, str] = {"memory": "128Mi"}
    if tee is Tee.SGX:
        extended = {SGX_EPC: cfg.sgx_epc, SGX_ENCLAVE: "1"}
        requests = {**requests, **extended}
        limits = {**limits, **extended}
    elif tee is Tee.SIM:
        mounts.append({"name": SIM_VOLUME, "mountPath": SIM_DIR, "readOnly": True})
    if cp_policy is not None:
        mounts.append({"name": CP_POLICY_VOLUME, "mountPath": CP_POLICY_DIR, "readOnly": True})
    return {
        "name": AGENT_CONTAINER,
        "image": cfg.agent_image,
        "command": agent_command(tee, cfg, gpus=gpus, control_plane_policy=cp_policy is not None),
        "restartPolicy": "Always",
        "env": copy.deepcopy(_POD_ENV),
        "volumeMounts": mounts,
        "resources": {"requests": requests, "limits": limits},
        # Envoy (the next sidecar) starts only once this passes: it needs the certificate for
        # its mutual-TLS xDS connection. An exec probe: the socket is private to the pod.
        "startupProbe": {
            "exec": {"command": agent_check_command(cfg)},
            "periodSeconds": 2,
            "timeoutSeconds": 5,
            "failureThreshold": 150,
        },
        "securityContext": _security_context(cfg),
    }


def _bootstrap_container(cfg: InjectConfig) -> dict[str, Any]:
    return {
        "name": BOOTSTRAP_CONTAINER,
        "image": cfg.agent_image,
        "command": bootstrap_command(cfg),
        "env": copy.deepcopy(_POD_ENV),
        "volumeMounts": [
            {"name": BOOTSTRAP_VOLUME, "mountPath": BOOTSTRAP_DIR},
            dict(_TRUST_MOUNT),
        ],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": _security_context(cfg),
    }


def _envoy_container(cfg: InjectConfig, inbound_port: int) -> dict[str, Any]:
    # Envoy's admin API (config dump, /quitquitquit, runtime changes) stays on 127.0.0.1: the
    # kubelet cannot reach it, so readiness is a TCP probe of the inbound mTLS listener. That
    # listener exists only once Envoy holds the configuration from the control plane and the
    # workload certificate from the agent (a listener waits for its SDS secret), i.e. when the
    # proxy can serve the mesh. The probe opens and closes a TCP connection without a TLS
    # handshake (counted by Envoy as a failed handshake, harmless).
    ready = {"tcpSocket": {"port": inbound_port}}
    return {
        "name": ENVOY_CONTAINER,
        "image": cfg.envoy_image,
        "command": [
            *cfg.envoy_command,
            "-c",
            BOOTSTRAP_FILE,
            "--disable-hot-restart",
            "--drain-strategy",
            "immediate",
        ],
        "restartPolicy": "Always",
        "ports": [{"name": "mesh-inbound", "containerPort": inbound_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": SDS_VOLUME, "mountPath": SDS_DIR},
            {"name": BOOTSTRAP_VOLUME, "mountPath": BOOTSTRAP_DIR, "readOnly": True},
            dict(_TRUST_MOUNT),  # the xDS cluster's trusted_ca, read by Envoy at run time
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "startupProbe": {**ready, "periodSeconds": 1, "failureThreshold": 300},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3},
        "securityContext": _security_context(cfg),
    }


def _nitro_problem(annotations: Mapping[str, Any]) -> str | None:
    from sidecar.nitro.bridge import BridgeError, parse_host_port

    image = annotations.get(ANNOTATION_ENCLAVE_IMAGE)
    if not isinstance(image, str) or not image.strip() or any(c.isspace() for c in image):
        return (
            f"a nitro pod names the image holding its EIF in the {ANNOTATION_ENCLAVE_IMAGE} "
            "annotation (examples/nitro)"
        )
    eif = annotations.get(ANNOTATION_ENCLAVE_EIF, DEFAULT_EIF)
    if not isinstance(eif, str) or not eif.startswith("/") or any(c.isspace() for c in eif):
        return f"{ANNOTATION_ENCLAVE_EIF} must be an absolute path"
    for peer in _peers(annotations):
        try:
            parse_host_port(peer)
        except BridgeError as exc:
            return f"{ANNOTATION_ENCLAVE_PEERS}: {exc.detail}"
    return None


def _peers(annotations: Mapping[str, Any]) -> list[str]:
    raw = annotations.get(ANNOTATION_ENCLAVE_PEERS, "")
    return [p.strip() for p in str(raw).split(",") if p.strip()]


def nitro_parent_command(
    cfg: InjectConfig, annotations: Mapping[str, Any], inbound_port: int
) -> list[str]:
    """``attestmesh nitro-parent`` as the injected parent runs it ($(VAR)s expanded by the
    kubelet): the enclave sized to exactly the grant this container requests."""
    cmd = [
        *cfg.attestmesh_command, "nitro-parent",
        "--eif", str(annotations.get(ANNOTATION_ENCLAVE_EIF, DEFAULT_EIF)),
        "--granted-cpus", str(cfg.nitro_enclave_cpus),
        "--granted-memory-mib", str(cfg.nitro_hugepages_gi * 1024),
        "--workload", WORKLOAD_REF,
        "--control-plane", cfg.control_plane_url,
        "--xds", cfg.xds_address,
        "--trust-domain", cfg.trust_domain,
        "--ca-bundle", TRUST_BUNDLE,
        "--token-file", TOKEN_PATH,
        "--inbound-address", "$(POD_IP)",
        "--inbound-port", str(inbound_port),
        "--envoy-admin-port", str(cfg.envoy_admin_port),
        "--ready-port", str(NITRO_READY_PORT),
    ]  # fmt: skip
    for peer in _peers(annotations):
        cmd += ["--peer", peer]
    return cmd


def nitro_parent_container(
    cfg: InjectConfig, annotations: Mapping[str, Any], inbound_port: int
) -> dict[str, Any]:
    """The one injected container of a nitro pod (the enclave runs agent and Envoy)."""
    extended = {
        NITRO_ENCLAVES: str(cfg.nitro_enclaves),
        NITRO_ENCLAVE_CPUS: str(cfg.nitro_enclave_cpus),
        HUGEPAGES_1GI: f"{cfg.nitro_hugepages_gi}Gi",
    }

    def ready() -> dict[str, Any]:
        return {"httpGet": {"path": "/readyz", "port": NITRO_READY_PORT}}

    env = [
        *copy.deepcopy(_POD_ENV),
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    return {
        "name": NITRO_PARENT_CONTAINER,
        "image": str(annotations[ANNOTATION_ENCLAVE_IMAGE]),
        "command": nitro_parent_command(cfg, annotations, inbound_port),
        "restartPolicy": "Always",
        "env": env,
        "ports": [
            {"name": "mesh-inbound", "containerPort": inbound_port, "protocol": "TCP"},
            {"name": "nitro-ready", "containerPort": NITRO_READY_PORT, "protocol": "TCP"},
        ],
        "volumeMounts": [
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
            dict(_TRUST_MOUNT),
            {"name": HUGEPAGES_VOLUME, "mountPath": "/dev/hugepages"},
            {"name": NITRO_RUN_VOLUME, "mountPath": "/run/nitro_enclaves"},
            {"name": NITRO_LOG_VOLUME, "mountPath": "/var/log/nitro_enclaves"},
        ],
        "resources": {
            "requests": {"cpu": cfg.nitro_cpu_request, "memory": "64Mi", **extended},
            "limits": {"memory": "256Mi", **extended},
        },
        # the enclave boots, attests and starts Envoy: the application containers wait for it
        "startupProbe": {**ready(), "periodSeconds": 2, "failureThreshold": 150},
        "readinessProbe": {**ready(), "periodSeconds": 5, "failureThreshold": 3},
        "securityContext": _security_context(cfg),
    }


def _volumes(tee: Tee, cfg: InjectConfig) -> list[dict[str, Any]]:
    vols: list[dict[str, Any]] = [
        {"name": SDS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": BOOTSTRAP_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {
            "name": TOKEN_VOLUME,
            "projected": {
                "sources": [
                    {
                        "serviceAccountToken": {
                            "audience": TOKEN_AUDIENCE,
                            "expirationSeconds": cfg.token_expiration_seconds,
                            "path": "token",
                        }
                    }
                ]
            },
        },
        {
            "name": TRUST_VOLUME,
            "configMap": {
                "name": TRUST_CONFIGMAP,
                "items": [{"key": TRUST_KEY, "path": TRUST_KEY}],
            },
        },
    ]
    if tee is Tee.NITRO:
        vols = [v for v in vols if v["name"] in (TOKEN_VOLUME, TRUST_VOLUME)]
        vols.append({"name": HUGEPAGES_VOLUME, "emptyDir": {"medium": HUGEPAGES_1GI_MEDIUM}})
        for name in (NITRO_RUN_VOLUME, NITRO_LOG_VOLUME):
            vols.append({"name": name, "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}})
    elif tee is Tee.SIM and cfg.sim is not None:
        vols.append(
            {
                "name": SIM_VOLUME,
                "secret": {
                    "secretName": cfg.sim.secret,
                    "items": [{"key": cfg.sim.key, "path": cfg.sim.key}],
                },
            }
        )
    return vols


def _inject(
    pod: dict[str, Any],
    tee: Tee,
    inbound_port: int,
    cfg: InjectConfig,
    gpus: int = 0,
    cp_policy: str | None = None,
    gpu_pod: bool = False,
) -> None:
    meta = pod.setdefault("metadata", {})
    spec = pod["spec"]
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict):
        annotations = meta["annotations"] = {}
    annotations[ANNOTATION_INJECTED] = "true"
    annotations[ANNOTATION_TEE] = tee.value
    # written out so the registration (xds.kube.workloads.pod_ports) and the Envoy probe agree
    annotations[ANNOTATION_INBOUND_PORT] = str(inbound_port)
    init = spec.get("initContainers") or []
    if tee is Tee.NITRO:  # agent and Envoy run inside the enclave
        ours = [nitro_parent_container(cfg, annotations, inbound_port)]
    else:
        ours = [
            _bootstrap_container(cfg),
            _agent_container(tee, cfg, gpus, cp_policy),
            _envoy_container(cfg, inbound_port),
        ]
    spec["initContainers"] = [*ours, *init]
    spec["volumes"] = [*(spec.get("volumes") or []), *_volumes(tee, cfg)]
    if cp_policy is not None:
        items = [{"key": CP_POLICY_KEY, "path": CP_POLICY_KEY}]
        spec["volumes"].append(
            {"name": CP_POLICY_VOLUME, "configMap": {"name": cp_policy, "items": items}}
        )
    if secrets := requested_secrets(annotations):
        _inject_secrets(spec, secrets, cfg)
    if tee is Tee.NITRO:
        toleration = {
            "key": NITRO_DP_LABEL,
            "operator": "Equal",
            "value": "enabled",
            "effect": "NoSchedule",
        }
        tolerations = spec.get("tolerations") or []
        if toleration not in tolerations:
            spec["tolerations"] = [*tolerations, toleration]
    elif tee in (Tee.SEV_SNP, Tee.TDX):
        snp = tee is Tee.SEV_SNP
        if gpu_pod:
            spec["runtimeClassName"] = (
                cfg.snp_gpu_runtime_class if snp else cfg.tdx_gpu_runtime_class
            )
        else:
            spec["runtimeClassName"] = cfg.snp_runtime_class if snp else cfg.tdx_runtime_class
        _merge_required_affinity(spec, cfg.snp_node_labels if snp else cfg.tdx_node_labels)
        _tolerate_tee_hosts(spec)
    elif tee is Tee.SGX:
        _merge_required_affinity(spec, cfg.sgx_node_labels)
        _tolerate_tee_hosts(spec)


def requested_gpus(spec: Mapping[str, Any], resources: tuple[str, ...] = GPU_RESOURCES) -> int:
    """The GPUs the pod's containers request: per container and resource name its limit, else
    its request. ValueError: a count that is not a whole number."""
    total = 0
    for c in spec.get("containers") or []:
        res = c.get("resources") if isinstance(c, Mapping) else None
        if not isinstance(res, Mapping):
            continue
        for name in resources:
            for kind in ("limits", "requests"):
                amounts = res.get(kind)
                if isinstance(amounts, Mapping) and name in amounts:
                    raw = amounts[name]
                    if isinstance(raw, bool) or not _WHOLE.fullmatch(str(raw)):
                        raise ValueError(f"{name} {kind} must be a whole number, not {raw!r}")
                    total += int(str(raw))
                    break
    return total


def _gpu_plan(
    annotations: Mapping[str, Any], spec: Mapping[str, Any], tee: Tee, cfg: InjectConfig
) -> tuple[int, int, str | None]:
    """(GPUs the agent attaches, GPUs the pod requests, why the pod cannot be injected)."""
    raw = annotations.get(ANNOTATION_ATTEST_GPUS)
    if raw is not None and str(raw).lower() not in ("true", "false"):
        return 0, 0, f'{ANNOTATION_ATTEST_GPUS} must be "true" or "false", not {raw!r}'
    asked = raw is not None and str(raw).lower() == "true"
    on = asked or (raw is None and cfg.attest_gpus)
    if tee not in GPU_TEES:
        if asked:
            where = f"a confidential VM's evidence ({_tee_list(GPU_TEES)}), not {tee.value}"
            return 0, 0, f"{ANNOTATION_ATTEST_GPUS}: GPUs attach to {where}"
        return 0, 0, None  # the injector's default: only confidential VMs' GPUs attach
    try:
        gpus = requested_gpus(spec, cfg.gpu_resources)
    except ValueError as exc:
        return 0, 0, str(exc)
    if asked and gpus == 0:
        what = " or ".join(cfg.gpu_resources)
        return 0, 0, f"{ANNOTATION_ATTEST_GPUS} is true but no container requests {what}"
    if on and gpus > MAX_GPUS:
        return 0, gpus, f"{gpus} GPUs requested; at most {MAX_GPUS} attach to one attestation"
    return (gpus if on else 0), gpus, None


def is_configmap_name(name: str) -> bool:
    """A valid ConfigMap name (a DNS-1123 subdomain)."""
    return len(name) <= 253 and _CONFIGMAP_NAME.fullmatch(name) is not None


def _cp_policy_plan(
    annotations: Mapping[str, Any], spec: Mapping[str, Any], tee: Tee, cfg: InjectConfig
) -> tuple[str | None, str | None]:
    """The ConfigMap with the control plane's policy (None: none), or why the pod cannot be
    injected."""
    raw = annotations.get(ANNOTATION_CP_POLICY)
    name = cfg.control_plane_policy if raw is None else str(raw)
    if name is None:
        return None, None
    if not is_configmap_name(name):
        return None, f"{ANNOTATION_CP_POLICY}: {name!r} is not a ConfigMap name"
    if tee is Tee.NITRO:
        return None, "a control-plane policy is not supported for nitro pods yet"
    if CP_POLICY_VOLUME in _names(spec.get("volumes")):
        return None, f"the volume name {CP_POLICY_VOLUME} is reserved for the sidecar"
    return name, None


def requested_secrets(annotations: Mapping[str, Any]) -> list[str]:
    """The secrets ``attestmesh.dev/secrets`` asks for (comma-separated name or ns/name)."""
    raw = annotations.get(ANNOTATION_SECRETS, "")
    return list(dict.fromkeys(p.strip() for p in str(raw).split(",") if p.strip()))


def _secrets_problem(
    annotations: Mapping[str, Any], spec: Mapping[str, Any], tee: Tee
) -> str | None:
    secrets = requested_secrets(annotations)
    if not secrets:
        return None
    if tee is Tee.NITRO:
        return f"{ANNOTATION_SECRETS} is not supported for nitro pods yet"
    bad = [n for n in secrets if not _SECRET_NAME.fullmatch(n)]
    if bad or len(secrets) > 64:
        return f"{ANNOTATION_SECRETS}: up to 64 names (name or namespace/name), not {bad}"
    if SECRETS_VOLUME in _names(spec.get("volumes")):
        return f"the volume name {SECRETS_VOLUME} is reserved for the sidecar"
    return None


def _inject_secrets(spec: dict[str, Any], secrets: list[str], cfg: InjectConfig) -> None:
    """The agent fetches ``secrets`` into a memory-backed volume (never the node's disk), files
    readable in the pod (0444: the application runs under its own uid); every application
    container mounts it read-only at ``SECRETS_DIR``."""
    spec["volumes"].append(
        {"name": SECRETS_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "4Mi"}}
    )
    for c in spec["initContainers"]:
        if c.get("name") == AGENT_CONTAINER:
            c["command"] = [
                *c["command"],
                "--secret-url", cfg.secret_url,
                "--secret-dir", SECRETS_DIR,
                "--secret-file-mode", "0444",
                *(a for name in secrets for a in ("--secret", name)),
            ]  # fmt: skip
            c["volumeMounts"].append({"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR})
    for c in spec.get("containers") or []:
        if isinstance(c, dict):
            mount = {"name": SECRETS_VOLUME, "mountPath": SECRETS_DIR, "readOnly": True}
            c["volumeMounts"] = [*(c.get("volumeMounts") or []), mount]


def _tolerate_tee_hosts(spec: dict[str, Any]) -> None:
    """Add the tolerations of every ``TEE_HOST_TAINTS`` taint the pod does not have yet."""
    tolerations = list(spec.get("tolerations") or [])
    for key in TEE_HOST_TAINTS.values():
        toleration = {"key": key, "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        if toleration not in tolerations:
            tolerations.append(toleration)
    spec["tolerations"] = tolerations


def mutate(
    pod: Mapping[str, Any], ns_labels: Mapping[str, str], config: InjectConfig
) -> MutationResult:
    """Decide and compute the injection for one pod. Pure: no I/O, never raises on input."""
    if not isinstance(pod, Mapping) or not isinstance(pod.get("spec"), Mapping):
        return MutationResult(Decision.INVALID_POD, message="object is not a Pod with a spec")
    meta_raw = pod.get("metadata")
    meta: Mapping[str, Any] = meta_raw if isinstance(meta_raw, Mapping) else {}
    ann_raw = meta.get("annotations")
    annotations: Mapping[str, Any] = ann_raw if isinstance(ann_raw, Mapping) else {}
    spec: Mapping[str, Any] = pod["spec"]
    namespace = meta.get("namespace", "")
    if namespace == config.control_plane_namespace:
        return MutationResult(Decision.CONTROL_PLANE, message="control-plane namespace")
    if namespace in SYSTEM_NAMESPACES:
        return MutationResult(Decision.SYSTEM_NAMESPACE, message=f"{namespace} is never injected")
    labels_raw = meta.get("labels")
    pod_labels: Mapping[str, Any] = labels_raw if isinstance(labels_raw, Mapping) else {}
    opt = str(annotations.get(ANNOTATION_INJECT, "")).lower()
    if opt == "false" or pod_labels.get(LABEL_INJECT) == "disabled":
        return MutationResult(Decision.OPTED_OUT, message=f"{ANNOTATION_INJECT}=false")
    ns_opt = ns_labels.get(LABEL_INJECT)
    if ns_opt == "disabled" or (ns_opt != "enabled" and pod_labels.get(LABEL_INJECT) != "enabled"):
        return MutationResult(Decision.NOT_SELECTED, message="namespace and pod not opted in")
    containers = _names(spec.get("containers")) | _names(spec.get("initContainers"))
    ours = set(CONTAINER_NAMES)
    if annotations.get(ANNOTATION_INJECTED) == "true" and (
        ours - {NITRO_PARENT_CONTAINER} <= containers or NITRO_PARENT_CONTAINER in containers
    ):
        return MutationResult(Decision.ALREADY_INJECTED, message="already injected")
    who = meta.get("name") or meta.get("generateName") or "pod"
    if spec.get("hostNetwork") is True:
        return MutationResult(
            Decision.HOST_NETWORK,
            message=f"attestmesh cannot inject {who}: hostNetwork pods share the node's ports "
            f'and cannot carry a per-pod sidecar; set {ANNOTATION_INJECT}: "false" to opt out',
        )
    clash = sorted(containers & ours)
    vclash = sorted(_names(spec.get("volumes")) & set(VOLUME_NAMES))
    if clash or vclash:
        what = ", ".join([*(f"container {c}" for c in clash), *(f"volume {v}" for v in vclash)])
        return MutationResult(
            Decision.NAME_CONFLICT,
            message=f"attestmesh cannot inject {who}: names reserved for the sidecar are "
            f"already used ({what})",
        )
    tee_name = _select_tee(annotations, ns_labels, config)
    if not tee_name:
        return MutationResult(
            Decision.NO_TEE,
            message=f"attestmesh cannot inject {who}: no TEE chosen; annotate the pod or label "
            f"its namespace {ANNOTATION_TEE} (one of {_tee_list(config.allowed_tees())})",
        )
    try:
        tee = Tee(tee_name)
    except ValueError:
        tee = None
    if tee not in INJECTABLE_TEES:
        return MutationResult(
            Decision.UNKNOWN_TEE,
            message=f"attestmesh cannot inject {who}: {ANNOTATION_TEE}={tee_name!r} "
            f"is not one of {_tee_list(config.allowed_tees())}",
        )
    assert tee is not None
    if tee not in config.allowed_tees():
        return MutationResult(
            Decision.TEE_DISABLED,
            message=f"attestmesh cannot inject {who}: {ANNOTATION_TEE}={tee.value} is not "
            "enabled in this cluster (simulated attestation is for test clusters only)",
        )
    if problem := _secrets_problem(annotations, spec, tee):
        return MutationResult(
            Decision.INVALID_POD, message=f"attestmesh cannot inject {who}: {problem}"
        )
    if tee is Tee.NITRO and (problem := _nitro_problem(annotations)):
        return MutationResult(
            Decision.INVALID_POD, message=f"attestmesh cannot inject {who}: {problem}"
        )
    gpus, gpu_pod, problem = _gpu_plan(annotations, spec, tee, config)
    if problem is None:
        cp_policy, problem = _cp_policy_plan(annotations, spec, tee, config)
    if problem is not None:
        return MutationResult(
            Decision.INVALID_POD, message=f"attestmesh cannot inject {who}: {problem}"
        )
    raw_inbound = annotations.get(ANNOTATION_INBOUND_PORT)
    inbound, app_port = pod_ports(pod)
    if raw_inbound is None:
        inbound = config.inbound_port
    elif str(raw_inbound) != str(inbound):
        return MutationResult(
            Decision.INVALID_POD,
            message=f"attestmesh cannot inject {who}: {ANNOTATION_INBOUND_PORT}="
            f"{raw_inbound!r} is not a port (1-65535)",
        )
    if app_port is None:
        return MutationResult(
            Decision.NO_APP_PORT,
            message=f"attestmesh cannot inject {who}: no application port; annotate "
            f"{ANNOTATION_APP_PORT} or declare a containerPort (the sidecar forwards inbound "
            "mesh traffic to it and could never become ready without it)",
        )
    if app_port == inbound or config.envoy_admin_port in (app_port, inbound):
        return MutationResult(
            Decision.INVALID_POD,
            message=f"attestmesh cannot inject {who}: application port {app_port}, inbound "
            f"port {inbound} and Envoy admin port {config.envoy_admin_port} must differ",
        )
    mutated = copy.deepcopy(dict(pod))
    _inject(mutated, tee, inbound, config, gpus, cp_policy, gpu_pod > 0)
    patch = tuple(build_patch(dict(pod), mutated))
    return MutationResult(Decision.INJECTED, patch, f"injected for {tee.value}", tee)


def _tee_list(tees: tuple[Tee, ...]) -> str:
    return ", ".join(t.value for t in tees)


# ---------------------------------------------------------------------------------------------
# AdmissionReview v1 (thin aiohttp adapter)


class AdmissionError(ValueError):
    """The request body is not an AdmissionReview v1 for a Pod."""


def parse_admission_review(body: bytes) -> tuple[str, dict[str, Any], str]:
    """Return (uid, pod, namespace) from AdmissionReview v1 bytes; raise AdmissionError."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdmissionError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise AdmissionError("body is not a JSON object")
    if doc.get("apiVersion") != "admission.k8s.io/v1" or doc.get("kind") != "AdmissionReview":
        raise AdmissionError("expected apiVersion admission.k8s.io/v1, kind AdmissionReview")
    req = doc.get("request")
    if not isinstance(req, dict):
        raise AdmissionError("AdmissionReview has no request")
    uid = req.get("uid")
    if not isinstance(uid, str) or not uid:
        raise AdmissionError("request.uid is required")
    obj = req.get("object")
    if not isinstance(obj, dict) or obj.get("kind", "Pod") != "Pod":
        raise AdmissionError("request.object must be a Pod")
    namespace = req.get("namespace") or (obj.get("metadata") or {}).get("namespace") or ""
    if not isinstance(namespace, str):
        raise AdmissionError("request.namespace must be a string")
    return uid, obj, namespace


def build_admission_response(uid: str, result: MutationResult) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": result.allowed}
    if not result.allowed:
        response["status"] = {"code": 403, "reason": "Forbidden", "message": result.message}
    elif result.patch:
        raw = json.dumps(list(result.patch), separators=(",", ":")).encode()
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(raw).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


class NamespaceLabels:
    """Seam: labels of a namespace (the control plane backs it with a namespace watch)."""

    def __init__(self, labels: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self._labels = dict(labels or {})

    def set(self, namespace: str, labels: Mapping[str, str]) -> None:
        self._labels[namespace] = dict(labels)

    def get(self, namespace: str) -> Mapping[str, str]:
        return self._labels.get(namespace, {})


WEBHOOK_REQUESTS = "attestmesh_webhook_requests_total"
MAX_BODY = 4 * 1024 * 1024


def webhook_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        WEBHOOK_REQUESTS,
        "Admission requests handled by the injector, by decision",
        ["decision"],
        registry=registry,
    )


def build_app(
    config: InjectConfig, namespaces: NamespaceLabels, requests_total: Counter
) -> web.Application:
    """The webhook app: POST /mutate and /mutate/pods (AdmissionReview v1), GET /healthz."""

    async def mutate_handler(request: web.Request) -> web.Response:
        body = await request.read()
        try:
            if len(body) > MAX_BODY:
                raise AdmissionError("body too large")
            uid, pod, namespace = parse_admission_review(body)
        except AdmissionError as exc:
            requests_total.labels(decision="bad_request").inc()
            return web.json_response({"error": str(exc)}, status=400)
        meta = pod.setdefault("metadata", {}) if isinstance(pod.get("metadata", {}), dict) else {}
        if namespace and isinstance(meta, dict):
            meta.setdefault("namespace", namespace)
        result = mutate(pod, namespaces.get(namespace), config)
        requests_total.labels(decision=result.decision.value).inc()
        if not result.allowed:
            log.info("injection denied: %s", result.message)
        return web.json_response(build_admission_response(uid, result))

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_BODY + 1)
    app.router.add_post("/mutate", mutate_handler)
    app.router.add_post("/mutate/pods", mutate_handler)  # the path manifests/base/webhook.yaml uses
    app.router.add_get("/healthz", healthz)
    return app


async def start_webhook(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext
) -> web.AppRunner:
    """Serve ``app`` over HTTPS; the caller owns the runner (``await runner.cleanup()``)."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return runner


def decode_patch(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JSON patch inside an AdmissionReview response (empty when none)."""
    raw = response.get("patch")
    if not raw:
        return []
    try:
        ops = json.loads(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError) as exc:
        raise AdmissionError(f"patch is not base64 JSON: {exc}") from None
    if not isinstance(ops, list):
        raise AdmissionError("patch is not a list")
    return ops


__all__ = [
    "ANNOTATION_INJECT",
    "ANNOTATION_INJECTED",
    "ANNOTATION_TEE",
    "AdmissionError",
    "Decision",
    "InjectConfig",
    "MutationResult",
    "NamespaceLabels",
    "SimInjection",
    "agent_check_command",
    "agent_command",
    "bootstrap_command",
    "build_admission_response",
    "build_app",
    "build_patch",
    "decode_patch",
    "mutate",
    "parse_admission_review",
    "start_webhook",
    "webhook_counter",
]
