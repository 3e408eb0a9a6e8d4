"""Sidecar injection: a pure ``mutate(pod)`` step and a thin aiohttp AdmissionReview app.

What an injected pod looks like (``initContainers`` in this order, before any of the pod's own):

1. ``attestmesh-bootstrap``: a plain init container that runs ``attestmesh bootstrap`` and writes
   the Envoy bootstrap into the ``attestmesh-bootstrap`` volume (emptyDir, medium Memory). It
   runs to completion before anything else starts, so Envoy never starts without its bootstrap.
2. ``attestmesh-agent``: a native sidecar (``restartPolicy: Always``). It holds the workload key,
   attests, and serves SDS on a Unix socket in the ``attestmesh-sds`` volume (emptyDir, medium
   Memory). It reads the pod's projected service-account token (audience ``attestmesh``,
   ``expirationSeconds: 3600``) from ``attestmesh-token``. Its startup probe waits for the SDS
   socket, so Envoy starts only once the agent serves it.
3. ``attestmesh-envoy``: a native sidecar with a startup probe and a readiness probe on the Envoy
   admin ``/ready``. The kubelet starts the application containers only after this startup probe
   passes, so the application starts after its proxy is ready.

Per TEE (pod annotation ``attestmesh.dev/tee``, else the namespace label of the same name, else
``InjectConfig.default_tee``):

- ``nitro``: the agent container (which launches the enclave and proxies vsock; agent and Envoy
  run inside the enclave image) requests and limits ``aws.ec2.nitro/nitro_enclaves``,
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
- ``sim``: nothing extra.

Opt-out: pod annotation ``attestmesh.dev/inject: "false"`` or pod label
``attestmesh.dev/inject: disabled`` (the label is what the webhook's objectSelector can see).

Decisions (``MutationResult``): opted out, not opted in, already injected, or the control-plane
namespace -> allowed with an empty patch. A pod the injector cannot make correct (host network,
a container or volume name already used by the injector, an unknown TEE) -> denied with a clear
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
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from certs.evidence.claims import Tee

log = logging.getLogger(__name__)

ANNOTATION_INJECT = "attestmesh.dev/inject"
ANNOTATION_INJECTED = "attestmesh.dev/injected"
ANNOTATION_TEE = "attestmesh.dev/tee"
LABEL_INJECT = "attestmesh.dev/inject"
LABEL_TEE = "attestmesh.dev/tee"

BOOTSTRAP_CONTAINER = "attestmesh-bootstrap"
AGENT_CONTAINER = "attestmesh-agent"
ENVOY_CONTAINER = "attestmesh-envoy"
CONTAINER_NAMES = (BOOTSTRAP_CONTAINER, AGENT_CONTAINER, ENVOY_CONTAINER)
SDS_VOLUME = "attestmesh-sds"
BOOTSTRAP_VOLUME = "attestmesh-bootstrap"
TOKEN_VOLUME = "attestmesh-token"  # noqa: S105 (a volume name)
HUGEPAGES_VOLUME = "attestmesh-hugepages"
VOLUME_NAMES = (SDS_VOLUME, BOOTSTRAP_VOLUME, TOKEN_VOLUME, HUGEPAGES_VOLUME)

SDS_DIR = "/var/run/attestmesh"
SDS_SOCKET = f"{SDS_DIR}/sds.sock"
BOOTSTRAP_DIR = "/etc/attestmesh/envoy"
BOOTSTRAP_FILE = f"{BOOTSTRAP_DIR}/bootstrap.json"
TOKEN_DIR = "/var/run/secrets/attestmesh"  # noqa: S105 (a path)
TOKEN_PATH = f"{TOKEN_DIR}/token"
TOKEN_AUDIENCE = "attestmesh"  # noqa: S105 (an audience)

NITRO_ENCLAVES = "aws.ec2.nitro/nitro_enclaves"
NITRO_ENCLAVE_CPUS = "aws.ec2.nitro/nitro_enclaves_cpus"
HUGEPAGES_1GI = "hugepages-1Gi"
NITRO_TAINT_KEY = "aws-nitro-enclaves-k8s-dp"
SGX_EPC = "sgx.intel.com/epc"
SGX_ENCLAVE = "sgx.intel.com/enclave"

INJECTABLE_TEES = (Tee.SIM, Tee.NITRO, Tee.SEV_SNP, Tee.TDX, Tee.SGX)


@dataclass(frozen=True, slots=True)
class InjectConfig:
    """What the injector adds. Frozen; built once in main() from settings."""

    agent_image: str = "ghcr.io/attestmesh/attestmesh:0.1.0"
    envoy_image: str = "envoyproxy/envoy:v1.36.2"
    control_plane_url: str = "https://attestmesh.attestmesh-system.svc:8443"
    xds_address: str = "attestmesh.attestmesh-system.svc:18000"
    control_plane_namespace: str = "attestmesh-system"
    default_tee: Tee = Tee.SIM
    envoy_admin_port: int = 15000
    inbound_port: int = 15006
    token_expiration_seconds: int = 3600
    bootstrap_command: tuple[str, ...] = ("attestmesh", "bootstrap")
    agent_command: tuple[str, ...] = ("attestmesh", "agent")
    agent_ready_command: tuple[str, ...] = ("attestmesh", "agent", "--check-socket")
    # nitro
    nitro_enclaves: int = 1
    nitro_enclave_cpus: int = 2
    nitro_hugepages_gi: int = 4
    nitro_cpu_request: str = "250m"
    # confidential VMs
    snp_runtime_class: str = "kata-qemu-snp"
    tdx_runtime_class: str = "kata-qemu-tdx"
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


class Decision(enum.StrEnum):
    """Why the injector answered as it did (bounded: usable as a metric label)."""

    INJECTED = "injected"
    NOT_SELECTED = "not_selected"
    OPTED_OUT = "opted_out"
    ALREADY_INJECTED = "already_injected"
    CONTROL_PLANE = "control_plane"
    HOST_NETWORK = "host_network"
    NAME_CONFLICT = "name_conflict"
    UNKNOWN_TEE = "unknown_tee"
    INVALID_POD = "invalid_pod"


_DENIALS = frozenset(
    {Decision.HOST_NETWORK, Decision.NAME_CONFLICT, Decision.UNKNOWN_TEE, Decision.INVALID_POD}
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
    raw = annotations.get(ANNOTATION_TEE) or ns_labels.get(LABEL_TEE) or cfg.default_tee.value
    return str(raw)


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


def _agent_container(pod: Mapping[str, Any], tee: Tee, cfg: InjectConfig) -> dict[str, Any]:
    spec = pod.get("spec", {})
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    env = [
        {"name": "ATTESTMESH_TEE", "value": tee.value},
        {"name": "ATTESTMESH_CONTROL_PLANE", "value": cfg.control_plane_url},
        {"name": "ATTESTMESH_SDS_SOCKET", "value": SDS_SOCKET},
        {"name": "ATTESTMESH_TOKEN_PATH", "value": TOKEN_PATH},
        {"name": "ATTESTMESH_SERVICE_ACCOUNT", "value": str(sa)},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    mounts = [
        {"name": SDS_VOLUME, "mountPath": SDS_DIR},
        {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
    ]
    requests: dict[str, str] = {"cpu": "50m", "memory": "64Mi"}
    limits: dict[str, str] = {"memory": "128Mi"}
    if tee is Tee.NITRO:
        extended = {
            NITRO_ENCLAVES: str(cfg.nitro_enclaves),
            NITRO_ENCLAVE_CPUS: str(cfg.nitro_enclave_cpus),
            HUGEPAGES_1GI: f"{cfg.nitro_hugepages_gi}Gi",
        }
        requests = {"cpu": cfg.nitro_cpu_request, "memory": "64Mi", **extended}
        limits = {"memory": "128Mi", **extended}
        mounts.append({"name": HUGEPAGES_VOLUME, "mountPath": "/dev/hugepages"})
    elif tee is Tee.SGX:
        extended = {SGX_EPC: cfg.sgx_epc, SGX_ENCLAVE: "1"}
        requests = {**requests, **extended}
        limits = {**limits, **extended}
    return {
        "name": AGENT_CONTAINER,
        "image": cfg.agent_image,
        "command": list(cfg.agent_command),
        "restartPolicy": "Always",
        "env": env,
        "volumeMounts": mounts,
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": {
            "exec": {"command": list(cfg.agent_ready_command)},
            "periodSeconds": 1,
            "failureThreshold": 120,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _bootstrap_container(tee: Tee, cfg: InjectConfig) -> dict[str, Any]:
    return {
        "name": BOOTSTRAP_CONTAINER,
        "image": cfg.agent_image,
        "command": [
            *cfg.bootstrap_command,
            "--out",
            BOOTSTRAP_FILE,
            "--xds-address",
            cfg.xds_address,
            "--sds-socket",
            SDS_SOCKET,
            "--admin-port",
            str(cfg.envoy_admin_port),
            "--inbound-port",
            str(cfg.inbound_port),
            "--tee",
            tee.value,
        ],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {
                "name": "POD_NAMESPACE",
                "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
            },
        ],
        "volumeMounts": [{"name": BOOTSTRAP_VOLUME, "mountPath": BOOTSTRAP_DIR}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _envoy_container(cfg: InjectConfig) -> dict[str, Any]:
    ready = {"httpGet": {"path": "/ready", "port": cfg.envoy_admin_port}}
    return {
        "name": ENVOY_CONTAINER,
        "image": cfg.envoy_image,
        "command": ["envoy", "-c", BOOTSTRAP_FILE, "--drain-strategy", "immediate"],
        "restartPolicy": "Always",
        "ports": [{"name": "mesh-inbound", "containerPort": cfg.inbound_port, "protocol": "TCP"}],
        "volumeMounts": [
            {"name": SDS_VOLUME, "mountPath": SDS_DIR},
            {"name": BOOTSTRAP_VOLUME, "mountPath": BOOTSTRAP_DIR, "readOnly": True},
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "startupProbe": {**ready, "periodSeconds": 1, "failureThreshold": 120},
        "readinessProbe": {**ready, "periodSeconds": 5, "failureThreshold": 3},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
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
    ]
    if tee is Tee.NITRO:
        vols.append({"name": HUGEPAGES_VOLUME, "emptyDir": {"medium": "HugePages-1Gi"}})
    return vols


def _inject(pod: dict[str, Any], tee: Tee, cfg: InjectConfig) -> None:
    meta = pod.setdefault("metadata", {})
    spec = pod["spec"]
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict):
        annotations = meta["annotations"] = {}
    annotations[ANNOTATION_INJECTED] = "true"
    annotations[ANNOTATION_TEE] = tee.value
    init = spec.get("initContainers") or []
    spec["initContainers"] = [
        _bootstrap_container(tee, cfg),
        _agent_container(pod, tee, cfg),
        _envoy_container(cfg),
        *init,
    ]
    spec["volumes"] = [*(spec.get("volumes") or []), *_volumes(tee, cfg)]
    if tee is Tee.NITRO:
        toleration = {
            "key": NITRO_TAINT_KEY,
            "operator": "Equal",
            "value": "enabled",
            "effect": "NoSchedule",
        }
        tolerations = spec.get("tolerations") or []
        if toleration not in tolerations:
            spec["tolerations"] = [*tolerations, toleration]
    elif tee in (Tee.SEV_SNP, Tee.TDX):
        snp = tee is Tee.SEV_SNP
        spec["runtimeClassName"] = cfg.snp_runtime_class if snp else cfg.tdx_runtime_class
        _merge_required_affinity(spec, cfg.snp_node_labels if snp else cfg.tdx_node_labels)
    elif tee is Tee.SGX:
        _merge_required_affinity(spec, cfg.sgx_node_labels)


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
    labels_raw = meta.get("labels")
    pod_labels: Mapping[str, Any] = labels_raw if isinstance(labels_raw, Mapping) else {}
    opt = str(annotations.get(ANNOTATION_INJECT, "")).lower()
    if opt == "false" or pod_labels.get(LABEL_INJECT) == "disabled":
        return MutationResult(Decision.OPTED_OUT, message=f"{ANNOTATION_INJECT}=false")
    if opt != "true" and ns_labels.get(LABEL_INJECT) != "enabled":
        return MutationResult(Decision.NOT_SELECTED, message="namespace and pod not opted in")
    containers = _names(spec.get("containers")) | _names(spec.get("initContainers"))
    ours = set(CONTAINER_NAMES)
    if annotations.get(ANNOTATION_INJECTED) == "true" and ours <= containers:
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
    try:
        tee = Tee(tee_name)
    except ValueError:
        tee = None
    if tee not in INJECTABLE_TEES:
        allowed = ", ".join(t.value for t in INJECTABLE_TEES)
        return MutationResult(
            Decision.UNKNOWN_TEE,
            message=f"attestmesh cannot inject {who}: {ANNOTATION_TEE}={tee_name!r} "
            f"is not one of {allowed}",
        )
    assert tee is not None
    mutated = copy.deepcopy(dict(pod))
    _inject(mutated, tee, config)
    patch = tuple(build_patch(dict(pod), mutated))
    return MutationResult(Decision.INJECTED, patch, f"injected for {tee.value}", tee)


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
    "build_admission_response",
    "build_app",
    "build_patch",
    "decode_patch",
    "mutate",
    "parse_admission_review",
    "start_webhook",
    "webhook_counter",
]
