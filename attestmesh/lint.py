"""``attestmesh lint``: the Nitro Enclaves provisioning pitfalls of Karpenter's "Using Nitro
Enclaves" guide, checked over a set of manifests.

``lint(objects)`` is pure: it takes parsed objects (with where they came from) and returns
findings; the CLI only loads files and prints. Lint the rendered set that will be applied
(``kustomize build manifests/nodes/nitro | attestmesh lint - manifests/examples``): the
checks relate objects to each other (NodeOverlay <-> device plugin <-> EC2NodeClass <->
NodePool <-> workloads).

How the facts are found:

- Enclave NodePool: a NodePool whose template labels carry ``aws-nitro-enclaves-k8s-dp:
  enabled`` (the device plugin's node selector). Its EC2NodeClass is its ``nodeClassRef``.
- Overlays of a pool: NodeOverlays advertising ``aws.ec2.nitro/*`` or ``hugepages-1Gi`` whose
  label requirements the pool's template labels satisfy (requirements on well-known instance
  labels are taken as satisfiable).
- Device plugin: a DaemonSet named ``aws-nitro-enclaves-k8s-daemonset``, or with a container
  named ``aws-nitro-enclaves-k8s-dp`` or running the device-plugin image. A strategic-merge
  patch of it (manifests/nodes/nitro/patches) counts as the patched DaemonSet.
- Allocator: the EC2NodeClass ``userData`` writes ``/etc/nitro_enclaves/allocator.yaml``;
  lint reads its ``memory_mib:`` and ``cpu_count:`` lines. For an AMI with the allocator baked
  in, annotate the EC2NodeClass ``attestmesh.dev/enclave-allocator: "memory_mib=4096,cpu_count=2"``.
- A node's actual allocatable CPU: the NodePool annotation ``attestmesh.dev/node-allocatable-cpu``
  (a quantity, e.g. the ``.status.allocatable.cpu`` of a launched Node) when present; otherwise
  the smallest vCPU count the pool and the overlay allow (``karpenter.k8s.aws/instance-cpu``
  Gt/Gte/In), minus the enclave CPUs (allocator ``cpu_count``, else the overlay's
  ``nitro_enclaves_cpus``), minus kube-reserved CPU (EC2NodeClass ``kubelet.kubeReserved.cpu``
  and ``systemReserved.cpu`` if set, else the EKS formula Karpenter uses).
- Pods allowed onto the pool: pod templates (Pod, Deployment, StatefulSet, ReplicaSet,
  DaemonSet, Job, CronJob) that tolerate every NoSchedule/NoExecute taint of the pool and
  whose nodeSelector does not exclude it; Deployments/StatefulSets/ReplicaSets count
  ``replicas`` times (default 1), DaemonSets once. Node affinity is not evaluated, and the
  injected sidecar's requests are not added (lint the injected pods to include them).

One attestmesh check beside the guide's: a pod (template) opting in to sidecar injection only
by the annotation ``attestmesh.dev/inject: "true"`` (``InjectOptInByAnnotation``). That
annotation is no opt-in any more: the webhook is selected by labels (an annotation would need
every pod creation in the cluster to call it), so such a pod runs without a sidecar unless its
namespace is labelled; the fix is the pod label ``attestmesh.dev/inject: enabled``.
"""

from __future__ import annotations

import argparse
import enum
import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, TextIO

import yaml

# The shared Kubernetes names (one definition, xds.kube.names), under this module's names. The
# enclave NodePool's label is also the device plugin's container name; INJECT_KEY is the pod
# label enabled|disabled, and the annotation "false" opts out.
from xds.kube.names import HUGEPAGES_1GI as RES_HUGEPAGES
from xds.kube.names import HUGEPAGES_1GI_MEDIUM as HUGEPAGES_MEDIUM
from xds.kube.names import LABEL_INJECT as INJECT_KEY
from xds.kube.names import NITRO_DP_LABEL as DP_CONTAINER
from xds.kube.names import NITRO_DP_LABEL as DP_LABEL
from xds.kube.names import NITRO_ENCLAVE_CPUS as RES_ENCLAVE_CPUS
from xds.kube.names import NITRO_ENCLAVES as RES_ENCLAVES
from xds.kube.names import NITRO_RESOURCE_PREFIX as NITRO_PREFIX

DP_LABEL_VALUE = "enabled"
DP_DAEMONSET = "aws-nitro-enclaves-k8s-daemonset"
DP_IMAGE = "aws-nitro-enclaves-k8s-device-plugin"
CPU_ADVERTISEMENT = "ENCLAVE_CPU_ADVERTISEMENT"
LABEL_INSTANCE_CPU = "karpenter.k8s.aws/instance-cpu"
LABEL_INSTANCE_MEMORY = "karpenter.k8s.aws/instance-memory"
ANNOTATION_ALLOCATOR = "attestmesh.dev/enclave-allocator"
ANNOTATION_ALLOCATABLE_CPU = "attestmesh.dev/node-allocatable-cpu"
_WELL_KNOWN_PREFIXES = (
    "karpenter.k8s.aws/",
    "karpenter.sh/",
    "node.kubernetes.io/",
    "topology.kubernetes.io/",
    "kubernetes.io/",
    "beta.kubernetes.io/",
)
_MIB = Decimal(1024 * 1024)


class Severity(enum.StrEnum):
    ERROR = "error"
    WARNING = "warning"


class Code(enum.StrEnum):
    OVERLAY_ENCLAVE_CPUS_NOT_ADVERTISED = "OverlayEnclaveCpusNotAdvertised"
    OVERLAY_HUGEPAGES_WITHOUT_ALLOCATOR = "OverlayHugepagesWithoutAllocator"
    OVERLAY_ALLOCATOR_MISMATCH = "OverlayAllocatorMismatch"
    OVERLAY_MISSING_DEVICE_PLUGIN_LABEL = "OverlayMissingDevicePluginLabel"
    OVERLAY_MISSING_SIZE_GUARD = "OverlayMissingSizeGuard"
    DEVICE_PLUGIN_MISSING = "DevicePluginMissing"
    DEVICE_PLUGIN_MISSING_TOLERATION = "DevicePluginMissingToleration"
    WORKLOAD_EXCEEDS_OVERLAY_CAPACITY = "WorkloadExceedsOverlayCapacity"
    WORKLOAD_REQUESTS_LIMITS_DIFFER = "WorkloadRequestsLimitsDiffer"
    WORKLOAD_MISSING_HUGEPAGES_VOLUME = "WorkloadMissingHugepagesVolume"
    WORKLOAD_MISSING_TOLERATION = "WorkloadMissingToleration"
    NITRO_ENCLAVES_DISABLED = "NitroEnclavesDisabled"
    ENCLAVE_POOL_CPU_OVERCOMMIT = "EnclavePoolCpuOvercommit"
    ORDINARY_WORKLOAD_ON_ENCLAVE_POOL = "OrdinaryWorkloadOnEnclavePool"
    INJECT_OPT_IN_BY_ANNOTATION = "InjectOptInByAnnotation"


SEVERITY: Mapping[Code, Severity] = {c: Severity.ERROR for c in Code} | {
    Code.DEVICE_PLUGIN_MISSING: Severity.WARNING
}


@dataclass(frozen=True, slots=True)
class SourcedObject:
    """One Kubernetes object and where it was read (file and document index)."""

    source: str
    index: int
    obj: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str(_get(self.obj, "metadata", "name") or "")

    @property
    def namespace(self) -> str:
        return str(_get(self.obj, "metadata", "namespace") or "")

    @property
    def ref(self) -> str:
        return "/".join(x for x in (self.kind, self.namespace, self.name) if x)


@dataclass(frozen=True, slots=True)
class Finding:
    code: Code
    severity: Severity
    source: str
    object: str
    message: str
    fix: str

    def render(self) -> str:
        return (
            f"{self.source}: {self.severity}: {self.code} {self.object}: {self.message}\n"
            f"  fix: {self.fix}"
        )


# ---------------------------------------------------------------------------------------------
# small pure helpers


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


_QUANTITY = re.compile(
    r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$", re.ASCII
)
_EXPONENT = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d{1,2}$", re.ASCII)
_SUFFIX = {
    None: Decimal(1),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}


def parse_quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity as a number (cores, bytes, counts); None if invalid."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value) if abs(value) < 10**30 else None
    if isinstance(value, float):
        return Decimal(str(value)) if math.isfinite(value) and abs(value) < 1e30 else None
    if not isinstance(value, str):
        return None
    text = value.strip()
    if len(text) > 64:
        return None
    m = _QUANTITY.match(text)
    if m is None:
        if not _EXPONENT.match(text):
            return None
        try:
            return Decimal(text)
        except InvalidOperation:
            return None
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def _fmt(resource: str, amount: Decimal) -> str:
    if resource == RES_HUGEPAGES or resource == "memory":
        return f"{(amount / (_MIB * 1024)).normalize():f}Gi"
    if resource == "cpu":
        return f"{int(amount * 1000)}m"
    return f"{amount.normalize():f}"


def eks_kube_reserved_cpu(vcpus: int) -> Decimal:
    """CPU the EKS AMIs (and Karpenter) reserve for the kubelet: 6% of the first core, 1% of
    the second, 0.5% of the third and fourth, 0.25% of every further core."""
    millis = Decimal(0)
    for core in range(1, vcpus + 1):
        if core == 1:
            millis += 60
        elif core == 2:
            millis += 10
        elif core <= 4:
            millis += 5
        else:
            millis += Decimal("2.5")
    return millis / 1000


# ---------------------------------------------------------------------------------------------
# pod templates


@dataclass(frozen=True, slots=True)
class PodTemplate:
    owner: SourcedObject
    spec: Mapping[str, Any]
    replicas: int

    def requests(self) -> dict[str, Decimal]:
        """Effective pod requests: max(sum over containers, any init container); a missing
        request defaults to the limit, as the API server does."""
        total: dict[str, Decimal] = {}
        for c in _list(self.spec.get("containers")):
            for res, amount in _container_requests(c).items():
                total[res] = total.get(res, Decimal(0)) + amount
        for c in _list(self.spec.get("initContainers")):
            for res, amount in _container_requests(c).items():
                total[res] = max(total.get(res, Decimal(0)), amount)
        return total

    def needs_enclaves(self) -> bool:
        return any(
            r.startswith(NITRO_PREFIX) for c in self.containers() for r in _resource_names(c)
        )

    def containers(self) -> list[Mapping[str, Any]]:
        return [
            c
            for c in _list(self.spec.get("initContainers")) + _list(self.spec.get("containers"))
            if isinstance(c, Mapping)
        ]


def _resource_names(container: Mapping[str, Any]) -> set[str]:
    res = _map(container.get("resources"))
    return {str(k) for k in (*_map(res.get("requests")), *_map(res.get("limits")))}


def _container_requests(container: Any) -> dict[str, Decimal]:
    res = _map(_map(container).get("resources"))
    out: dict[str, Decimal] = {}
    for name, value in _map(res.get("limits")).items():
        if (q := parse_quantity(value)) is not None:
            out[str(name)] = q
    for name, value in _map(res.get("requests")).items():
        if (q := parse_quantity(value)) is not None:
            out[str(name)] = q
    return out


_REPLICATED = {"Deployment", "StatefulSet", "ReplicaSet", "ReplicationController"}


def pod_metadata(o: SourcedObject) -> Mapping[str, Any]:
    """The metadata of a Pod, or of the pod template of a workload object."""
    kind, obj = o.kind, o.obj
    if kind == "Pod":
        return _map(obj.get("metadata"))
    if kind == "CronJob":
        return _map(_get(obj, "spec", "jobTemplate", "spec", "template", "metadata"))
    return _map(_get(obj, "spec", "template", "metadata"))


def pod_templates(objects: Iterable[SourcedObject]) -> Iterator[PodTemplate]:
    for o in objects:
        kind, obj = o.kind, o.obj
        spec: Any = None
        replicas = 1
        if kind == "Pod":
            spec = obj.get("spec")
        elif kind in _REPLICATED or kind in {"DaemonSet", "Job"}:
            spec = _get(obj, "spec", "template", "spec")
            if kind in _REPLICATED:
                r = _get(obj, "spec", "replicas")
                replicas = r if isinstance(r, int) and not isinstance(r, bool) else 1
            elif kind == "Job":
                p = _get(obj, "spec", "parallelism")
                replicas = p if isinstance(p, int) and not isinstance(p, bool) else 1
        elif kind == "CronJob":
            spec = _get(obj, "spec", "jobTemplate", "spec", "template", "spec")
        if isinstance(spec, Mapping):
            yield PodTemplate(o, spec, max(replicas, 0))


def tolerates(tolerations: Sequence[Any], taint: Mapping[str, Any]) -> bool:
    for t in tolerations:
        if not isinstance(t, Mapping):
            continue
        effect = t.get("effect")
        if effect and effect != taint.get("effect"):
            continue
        key = t.get("key")
        op = t.get("operator", "Equal")
        if not key:
            if op == "Exists":
                return True
            continue
        if key != taint.get("key"):
            continue
        if op == "Exists" or (op == "Equal" and t.get("value", "") == taint.get("value", "")):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# the node side


@dataclass(frozen=True, slots=True)
class Allocator:
    memory_mib: int | None
    cpu_count: int | None


_ALLOC_MEMORY = re.compile(r"^\s*memory_mib\s*[:=]\s*(\d{1,9})\s*$", re.MULTILINE | re.ASCII)
_ALLOC_CPUS = re.compile(r"^\s*cpu_count\s*[:=]\s*(\d{1,6})\s*$", re.MULTILINE | re.ASCII)
_SMALL_INT = re.compile(r"^\d{1,9}$", re.ASCII)


def allocator_of(node_class: SourcedObject) -> Allocator | None:
    """The allocator reservation configured by an EC2NodeClass (userData or annotation)."""
    text = _get(node_class.obj, "metadata", "annotations", ANNOTATION_ALLOCATOR)
    if isinstance(text, str):
        text = text.replace(",", "\n")
    else:
        user_data = _get(node_class.obj, "spec", "userData")
        if not isinstance(user_data, str) or "allocator.yaml" not in user_data:
            return None
        text = user_data
    mem, cpus = _ALLOC_MEMORY.search(text), _ALLOC_CPUS.search(text)
    if mem is None and cpus is None:
        return None
    return Allocator(int(mem.group(1)) if mem else None, int(cpus.group(1)) if cpus else None)


def _is_device_plugin(o: SourcedObject) -> bool:
    if o.kind != "DaemonSet":
        return False
    if o.name == DP_DAEMONSET:
        return True
    return any(
        c.get("name") == DP_CONTAINER or DP_IMAGE in str(c.get("image", ""))
        for c in _list(_get(o.obj, "spec", "template", "spec", "containers"))
        if isinstance(c, Mapping)
    )


def _advertises_cpus(ds: SourcedObject) -> bool:
    for c in _list(_get(ds.obj, "spec", "template", "spec", "containers")):
        for env in _list(_map(c).get("env")):
            if (
                isinstance(env, Mapping)
                and env.get("name") == CPU_ADVERTISEMENT
                and str(env.get("value", "")).lower() == "true"
            ):
                return True
    return False


def _overlay_capacity(overlay: SourcedObject) -> dict[str, Decimal]:
    out: dict[str, Decimal] = {}
    for name, value in _map(_get(overlay.obj, "spec", "capacity")).items():
        if (q := parse_quantity(value)) is not None:
            out[str(name)] = q
    return out


def _is_enclave_overlay(overlay: SourcedObject) -> bool:
    return any(r.startswith(NITRO_PREFIX) or r == RES_HUGEPAGES for r in _overlay_capacity(overlay))


def _requirements(obj: Any) -> list[Mapping[str, Any]]:
    return [r for r in _list(obj) if isinstance(r, Mapping)]


def _min_from(requirements: Sequence[Mapping[str, Any]], key: str) -> int | None:
    """The smallest integer a label may take under the requirements (Gt/Gte/In)."""
    floor: int | None = None
    for r in requirements:
        if r.get("key") != key:
            continue
        values = [v for v in _list(r.get("values")) if isinstance(v, str) and _SMALL_INT.match(v)]
        if not values:
            continue
        op = r.get("operator")
        candidate = None
        if op == "Gt":
            candidate = int(values[0]) + 1
        elif op == "Gte":
            candidate = int(values[0])
        elif op == "In":
            candidate = min(int(v) for v in values)
        if candidate is not None:
            floor = candidate if floor is None else max(floor, candidate)
    return floor


def _requirement_allows(req: Mapping[str, Any], labels: Mapping[str, Any]) -> bool:
    key = str(req.get("key", ""))
    if key.startswith(_WELL_KNOWN_PREFIXES):
        return True
    op = req.get("operator")
    values = [str(v) for v in _list(req.get("values"))]
    have = labels.get(key)
    if op == "In":
        return have is not None and str(have) in values
    if op == "NotIn":
        return have is None or str(have) not in values
    if op == "Exists":
        return have is not None
    if op == "DoesNotExist":
        return have is None
    return True


@dataclass(frozen=True, slots=True)
class Pool:
    node_pool: SourcedObject
    labels: Mapping[str, Any]
    taints: tuple[Mapping[str, Any], ...]
    node_class: SourcedObject | None
    overlays: tuple[SourcedObject, ...]

    def admits(self, pod: PodTemplate) -> bool:
        tolerations = _list(pod.spec.get("tolerations"))
        hard = [t for t in self.taints if t.get("effect") in ("NoSchedule", "NoExecute")]
        if not all(tolerates(tolerations, t) for t in hard):
            return False
        for key, value in _map(pod.spec.get("nodeSelector")).items():
            if key in self.labels:
                if str(self.labels[key]) != str(value):
                    return False
            elif not str(key).startswith(_WELL_KNOWN_PREFIXES):
                return False
        return True

    def capacity(self) -> dict[str, Decimal]:
        cap: dict[str, Decimal] = {}
        for overlay in self.overlays:
            for res, amount in _overlay_capacity(overlay).items():
                cap[res] = max(cap.get(res, Decimal(0)), amount)
        return cap


def enclave_pools(objects: Sequence[SourcedObject]) -> list[Pool]:
    classes = {o.name: o for o in objects if o.kind == "EC2NodeClass"}
    overlays = [o for o in objects if o.kind == "NodeOverlay" and _is_enclave_overlay(o)]
    pools: list[Pool] = []
    for o in objects:
        if o.kind != "NodePool":
            continue
        labels = _map(_get(o.obj, "spec", "template", "metadata", "labels"))
        if str(labels.get(DP_LABEL)) != DP_LABEL_VALUE:
            continue
        taints = tuple(
            t
            for t in _list(_get(o.obj, "spec", "template", "spec", "taints"))
            if isinstance(t, Mapping)
        )
        ref = _map(_get(o.obj, "spec", "template", "spec", "nodeClassRef"))
        node_class = (
            classes.get(str(ref.get("name"))) if ref.get("kind") == "EC2NodeClass" else None
        )
        applying = tuple(
            ov
            for ov in overlays
            if all(
                _requirement_allows(r, labels)
                for r in _requirements(_get(ov.obj, "spec", "requirements"))
            )
        )
        pools.append(Pool(o, labels, taints, node_class, applying))
    return pools


# ---------------------------------------------------------------------------------------------
# the checks


class _Report:
    def __init__(self) -> None:
        self.findings: list[Finding] = []

    def add(self, code: Code, o: SourcedObject, message: str, fix: str) -> None:
        self.findings.append(
            Finding(code, SEVERITY[code], f"{o.source}#{o.index}", o.ref, message, fix)
        )


def _check_overlays(
    objects: Sequence[SourcedObject], pools: Sequence[Pool], report: _Report
) -> None:
    plugins = [o for o in objects if _is_device_plugin(o)]
    for overlay in (o for o in objects if o.kind == "NodeOverlay" and _is_enclave_overlay(o)):
        cap = _overlay_capacity(overlay)
        reqs = _requirements(_get(overlay.obj, "spec", "requirements"))
        label_req = [
            r
            for r in reqs
            if r.get("key") == DP_LABEL
            and (
                (r.get("operator") == "In" and DP_LABEL_VALUE in _list(r.get("values")))
                or r.get("operator") == "Exists"
            )
        ]
        if not label_req:
            report.add(
                Code.OVERLAY_MISSING_DEVICE_PLUGIN_LABEL,
                overlay,
                f"the overlay does not require the device-plugin label {DP_LABEL}, so Karpenter "
                "would assume enclave capacity on instance types of every NodePool",
                f"add requirement {{key: {DP_LABEL}, operator: In, values: [{DP_LABEL_VALUE}]}}",
            )
        my_pools = [p for p in pools if overlay in p.overlays]
        allocators = [
            (p.node_class, allocator_of(p.node_class)) for p in my_pools if p.node_class is not None
        ]
        enclave_cpus = cap.get(RES_ENCLAVE_CPUS)
        if enclave_cpus is None:
            enclave_cpus = next(
                (Decimal(a.cpu_count) for _, a in allocators if a and a.cpu_count), None
            )
        hugepages_mib = cap[RES_HUGEPAGES] / _MIB if RES_HUGEPAGES in cap else None
        _check_guard(overlay, reqs, LABEL_INSTANCE_CPU, enclave_cpus, "vCPUs", report)
        _check_guard(overlay, reqs, LABEL_INSTANCE_MEMORY, hugepages_mib, "MiB", report)
        if RES_ENCLAVE_CPUS in cap and plugins and not any(_advertises_cpus(p) for p in plugins):
            report.add(
                Code.OVERLAY_ENCLAVE_CPUS_NOT_ADVERTISED,
                overlay,
                f"capacity declares {RES_ENCLAVE_CPUS} but the device-plugin DaemonSet "
                f"{plugins[0].ref} does not set {CPU_ADVERTISEMENT}=true, so no node will "
                "ever advertise it and enclave pods stay pending after Karpenter launches "
                "a node",
                f'set env {CPU_ADVERTISEMENT}: "true" on the device-plugin container '
                "(manifests/nodes/nitro/patches/device-plugin.yaml)",
            )
        if cap and not plugins:
            report.add(
                Code.DEVICE_PLUGIN_MISSING,
                overlay,
                "no device-plugin DaemonSet is among the linted manifests, so what the nodes "
                "advertise cannot be checked",
                "lint the rendered device-plugin DaemonSet together with the overlay",
            )
        if RES_HUGEPAGES in cap or RES_ENCLAVE_CPUS in cap:
            _check_allocator(overlay, cap, allocators, report)


def _check_guard(
    overlay: SourcedObject,
    reqs: Sequence[Mapping[str, Any]],
    key: str,
    reservation: Decimal | None,
    unit: str,
    report: _Report,
) -> None:
    floor = _min_from([r for r in reqs if r.get("operator") in ("Gt", "Gte")], key)
    if floor is None:
        report.add(
            Code.OVERLAY_MISSING_SIZE_GUARD,
            overlay,
            f"no numeric {key} requirement (Gt), so the overlay also applies to instances "
            "no larger than the enclave reservation",
            f'add {{key: {key}, operator: Gt, values: ["<reservation in {unit}>"]}}',
        )
    elif reservation is not None and floor <= reservation:
        report.add(
            Code.OVERLAY_MISSING_SIZE_GUARD,
            overlay,
            f"{key} guard admits instances with {floor} {unit}, not larger than the "
            f"enclave reservation of {reservation.normalize():f} {unit}",
            f'use {{key: {key}, operator: Gt, values: ["{reservation.normalize():f}"]}} or higher',
        )


def _check_allocator(
    overlay: SourcedObject,
    cap: Mapping[str, Decimal],
    allocators: Sequence[tuple[SourcedObject | None, Allocator | None]],
    report: _Report,
) -> None:
    for node_class, alloc in allocators:
        if node_class is None:
            continue
        if alloc is None or (RES_HUGEPAGES in cap and alloc.memory_mib is None):
            if RES_HUGEPAGES in cap:
                report.add(
                    Code.OVERLAY_HUGEPAGES_WITHOUT_ALLOCATOR,
                    overlay,
                    f"capacity declares {RES_HUGEPAGES} but EC2NodeClass {node_class.name} "
                    "configures no Nitro Enclaves allocator (memory_mib), so the kubelet will "
                    "not advertise those hugepages",
                    "write /etc/nitro_enclaves/allocator.yaml (memory_mib, cpu_count) and "
                    "enable nitro-enclaves-allocator in the EC2NodeClass userData, or "
                    f"annotate it {ANNOTATION_ALLOCATOR} for an AMI that does",
                )
            continue
        problems = []
        if RES_HUGEPAGES in cap and alloc.memory_mib is not None:
            want = cap[RES_HUGEPAGES] / _MIB
            if Decimal(alloc.memory_mib) != want:
                problems.append(f"memory_mib {alloc.memory_mib} != {want.normalize():f} MiB")
        if (
            RES_ENCLAVE_CPUS in cap
            and alloc.cpu_count is not None
            and Decimal(alloc.cpu_count) != cap[RES_ENCLAVE_CPUS]
        ):
            problems.append(f"cpu_count {alloc.cpu_count} != {cap[RES_ENCLAVE_CPUS].normalize():f}")
        if problems:
            report.add(
                Code.OVERLAY_ALLOCATOR_MISMATCH,
                overlay,
                f"overlay capacity differs from the allocator of EC2NodeClass "
                f"{node_class.name}: {'; '.join(problems)}",
                "make the overlay capacity equal what the allocator reserves (and the node "
                "therefore advertises)",
            )


def _check_device_plugins(
    objects: Sequence[SourcedObject], pools: Sequence[Pool], report: _Report
) -> None:
    for ds in (o for o in objects if _is_device_plugin(o)):
        tolerations = _list(_get(ds.obj, "spec", "template", "spec", "tolerations"))
        for pool in pools:
            missing = [
                t
                for t in pool.taints
                if t.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, t)
            ]
            if missing:
                t = missing[0]
                report.add(
                    Code.DEVICE_PLUGIN_MISSING_TOLERATION,
                    ds,
                    f"the device plugin does not tolerate taint {t.get('key')}="
                    f"{t.get('value', '')}:{t.get('effect')} of NodePool {pool.node_pool.name}, "
                    "so it never runs there and no enclave resource is advertised",
                    f"add toleration {{key: {t.get('key')}, operator: Equal, value: "
                    f"{t.get('value', '')}, effect: {t.get('effect')}}}",
                )


def _check_workloads(
    objects: Sequence[SourcedObject], pools: Sequence[Pool], report: _Report
) -> None:
    templates = list(pod_templates(objects))
    for pod in templates:
        if _is_device_plugin(pod.owner):
            continue
        if pod.needs_enclaves():
            _check_enclave_workload(pod, pools, report)
        else:
            for pool in pools:
                if pool.admits(pod):
                    report.add(
                        Code.ORDINARY_WORKLOAD_ON_ENCLAVE_POOL,
                        pod.owner,
                        f"requests no enclave but tolerates the taints of enclave NodePool "
                        f"{pool.node_pool.name}: it takes CPU the enclave workloads need and "
                        "can reach the node's enclaves",
                        "remove the toleration (add it only to enclave workloads and the "
                        "device plugin)",
                    )
                    break
    for pool in pools:
        _check_pool_cpu(pool, templates, report)
    needing = [p for p in templates if p.needs_enclaves()]
    if needing:
        seen: set[str] = set()
        for pool in pools:
            nc = pool.node_class
            if nc is None or nc.name in seen:
                continue
            seen.add(nc.name)
            enabled = _get(nc.obj, "spec", "enclaveOptions", "enabled")
            if enabled is not True:
                state = "enabled: false" if enabled is False else "no enclaveOptions"
                names = ", ".join(p.owner.ref for p in needing)
                report.add(
                    Code.NITRO_ENCLAVES_DISABLED,
                    nc,
                    f"EC2NodeClass has {state} but {names} need Nitro Enclaves: launches fail "
                    "with NitroEnclavesDisabled (retried until the launch timeout) and the "
                    "workloads stay pending",
                    "set spec.enclaveOptions.enabled: true",
                )


def _check_inject_opt_in(objects: Sequence[SourcedObject], report: _Report) -> None:
    for pod in pod_templates(objects):
        meta = pod_metadata(pod.owner)
        annotation = _map(meta.get("annotations")).get(INJECT_KEY)
        label = _map(meta.get("labels")).get(INJECT_KEY)
        if str(annotation).lower() == "true" and label != "enabled":
            report.add(
                Code.INJECT_OPT_IN_BY_ANNOTATION,
                pod.owner,
                f'opts in to sidecar injection only by the annotation {INJECT_KEY}: "true", '
                "which the injection webhook no longer selects: unless its namespace is "
                "labelled, the pod runs without a sidecar (unattested, outside the mesh)",
                f"label the pod (template) {INJECT_KEY}: enabled and drop the annotation",
            )


def _check_enclave_workload(pod: PodTemplate, pools: Sequence[Pool], report: _Report) -> None:
    for c in pod.containers():
        res = _map(c.get("resources"))
        requests = {str(k): v for k, v in _map(res.get("requests")).items()}
        limits = {str(k): v for k, v in _map(res.get("limits")).items()}
        for name in sorted(set(requests) | set(limits)):
            if not (name.startswith(NITRO_PREFIX) or name.startswith("hugepages-")):
                continue
            req, lim = parse_quantity(requests.get(name)), parse_quantity(limits.get(name))
            if name not in limits or (name in requests and req != lim):
                report.add(
                    Code.WORKLOAD_REQUESTS_LIMITS_DIFFER,
                    pod.owner,
                    f"container {c.get('name')}: {name} requests {requests.get(name)} but "
                    f"limits {limits.get(name)}; extended resources and hugepages must be "
                    "equal in both",
                    f"set resources.requests and resources.limits of {name} to the same value",
                )
    want = pod.requests()
    if want.get(RES_HUGEPAGES, Decimal(0)) > 0 or want.get(RES_ENCLAVES, Decimal(0)) > 0:
        volumes = [v for v in _list(pod.spec.get("volumes")) if isinstance(v, Mapping)]
        huge = {
            v.get("name")
            for v in volumes
            if _get(v, "emptyDir", "medium") == HUGEPAGES_MEDIUM and isinstance(v.get("name"), str)
        }
        mounted = any(
            isinstance(_map(m).get("name"), str) and _map(m).get("name") in huge
            for c in pod.containers()
            for m in _list(c.get("volumeMounts"))
        )
        if not mounted or RES_HUGEPAGES not in want:
            report.add(
                Code.WORKLOAD_MISSING_HUGEPAGES_VOLUME,
                pod.owner,
                "an enclave's memory comes from 1 GiB hugepages, but the pod "
                + (
                    f"does not request {RES_HUGEPAGES}"
                    if RES_HUGEPAGES not in want
                    else f"mounts no emptyDir with medium {HUGEPAGES_MEDIUM}"
                ),
                f"request {RES_HUGEPAGES} and mount a volume {{emptyDir: {{medium: "
                f"{HUGEPAGES_MEDIUM}}}}} (e.g. at /dev/hugepages)",
            )
    if not pools:
        return
    admitted = [p for p in pools if p.admits(pod)]
    if not admitted:
        pool = pools[0]
        taints = ", ".join(
            f"{t.get('key')}={t.get('value', '')}:{t.get('effect')}" for t in pool.taints
        )
        report.add(
            Code.WORKLOAD_MISSING_TOLERATION,
            pod.owner,
            f"requests Nitro Enclaves but does not tolerate the enclave NodePool "
            f"{pool.node_pool.name} ({taints}) or is excluded by its nodeSelector; it stays "
            "pending",
            "add the NodePool taint's toleration to the pod template",
        )
        return
    for pool in admitted:
        cap = pool.capacity()
        over = [
            f"{r} {_fmt(r, want[r])} > {_fmt(r, cap.get(r, Decimal(0)))}"
            for r in sorted(want)
            if (r.startswith(NITRO_PREFIX) or r == RES_HUGEPAGES)
            and want[r] > cap.get(r, Decimal(0))
        ]
        if over:
            report.add(
                Code.WORKLOAD_EXCEEDS_OVERLAY_CAPACITY,
                pod.owner,
                f"requests more than one node of NodePool {pool.node_pool.name} offers "
                f"(NodeOverlay capacity): {', '.join(over)}; no node can ever fit it",
                "lower the requests or raise the allocator reservation and the overlay "
                "capacity together",
            )


def _node_allocatable_cpu(pool: Pool) -> tuple[Decimal, str] | None:
    note = _get(pool.node_pool.obj, "metadata", "annotations", ANNOTATION_ALLOCATABLE_CPU)
    if note is not None and (q := parse_quantity(note)) is not None:
        return q, f"annotation {ANNOTATION_ALLOCATABLE_CPU}"
    pool_reqs = _requirements(_get(pool.node_pool.obj, "spec", "template", "spec", "requirements"))
    floors = [f for f in [_min_from(pool_reqs, LABEL_INSTANCE_CPU)] if f is not None]
    for overlay in pool.overlays:
        reqs = _requirements(_get(overlay.obj, "spec", "requirements"))
        if (f := _min_from(reqs, LABEL_INSTANCE_CPU)) is not None:
            floors.append(f)
    if not floors:
        return None
    vcpus = max(floors)
    alloc = allocator_of(pool.node_class) if pool.node_class else None
    if alloc is not None and alloc.cpu_count is not None:
        enclave = Decimal(alloc.cpu_count)
    else:
        enclave = pool.capacity().get(RES_ENCLAVE_CPUS, Decimal(0))
    kubelet = _map(_get(pool.node_class.obj, "spec", "kubelet")) if pool.node_class else {}
    kube_reserved = parse_quantity(_get(kubelet, "kubeReserved", "cpu"))
    if kube_reserved is None:
        kube_reserved = eks_kube_reserved_cpu(vcpus)
    system_reserved = parse_quantity(_get(kubelet, "systemReserved", "cpu")) or Decimal(0)
    allocatable = Decimal(vcpus) - enclave - kube_reserved - system_reserved
    how = (
        f"{vcpus} vCPUs (smallest instance allowed) - {enclave.normalize():f} enclave CPUs - "
        f"{_fmt('cpu', kube_reserved + system_reserved)} reserved"
    )
    return allocatable, how


def _check_pool_cpu(pool: Pool, templates: Sequence[PodTemplate], report: _Report) -> None:
    allowed = [p for p in templates if pool.admits(p)]
    if not any(p.needs_enclaves() for p in allowed):
        return
    node = _node_allocatable_cpu(pool)
    if node is None:
        return
    allocatable, how = node
    total = sum(
        (
            p.requests().get("cpu", Decimal(0)) * (1 if p.owner.kind == "DaemonSet" else p.replicas)
            for p in allowed
        ),
        Decimal(0),
    )
    if total > allocatable:
        parts = ", ".join(
            f"{p.owner.ref} {_fmt('cpu', p.requests().get('cpu', Decimal(0)))}"
            + ("" if p.owner.kind == "DaemonSet" or p.replicas == 1 else f" x{p.replicas}")
            for p in allowed
        )
        report.add(
            Code.ENCLAVE_POOL_CPU_OVERCOMMIT,
            pool.node_pool,
            f"standard cpu requests of the pods allowed onto the pool total "
            f"{_fmt('cpu', total)} but a node's actual allocatable CPU is "
            f"{_fmt('cpu', allocatable)} ({how}); Karpenter does not subtract enclave CPUs, "
            f"so it launches nodes the scheduler cannot fill ({parts})",
            "raise the pool's karpenter.k8s.aws/instance-cpu floor (Gt) or lower the cpu "
            "requests / replicas of the pods allowed onto it",
        )


def lint(objects: Sequence[SourcedObject]) -> list[Finding]:
    """Every finding for the given manifests, in a stable order."""
    report = _Report()
    pools = enclave_pools(objects)
    _check_overlays(objects, pools, report)
    _check_device_plugins(objects, pools, report)
    _check_workloads(objects, pools, report)
    _check_inject_opt_in(objects, report)
    return sorted(report.findings, key=lambda f: (f.source, f.code, f.object, f.message))


# ---------------------------------------------------------------------------------------------
# loading and the CLI


class LoadError(Exception):
    pass


def parse_documents(text: str, source: str) -> list[SourcedObject]:
    """Objects of a multi-document YAML text (List kinds expanded; non-objects skipped)."""
    try:
        docs = list(yaml.safe_load_all(text))
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        # ValueError: e.g. an impossible date (2001-02-30) that YAML resolves as a timestamp.
        raise LoadError(f"{source}: not valid YAML: {exc}") from None
    out: list[SourcedObject] = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, Mapping) or "kind" not in doc:
            continue
        if str(doc["kind"]).endswith("List") and isinstance(doc.get("items"), list):
            out.extend(
                SourcedObject(source, i, item) for item in doc["items"] if isinstance(item, Mapping)
            )
        else:
            out.append(SourcedObject(source, i, doc))
    return out


def load_paths(paths: Sequence[str], stdin: TextIO) -> list[SourcedObject]:
    out: list[SourcedObject] = []
    for raw in paths:
        if raw == "-":
            out.extend(parse_documents(stdin.read(), "<stdin>"))
            continue
        path = Path(raw)
        if path.is_dir():
            files = sorted(
                p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file()
            )
        elif path.is_file():
            files = [path]
        else:
            raise LoadError(f"{raw}: no such file or directory")
        for f in files:
            if f.name in ("kustomization.yaml", "kustomization.yml"):
                continue
            out.extend(parse_documents(f.read_text(), str(f)))
    return out


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lint",
        help="check Nitro Enclaves provisioning manifests for the Karpenter guide's pitfalls",
        description=(
            "Check manifests (files, directories of multi-document YAML, or - for stdin) for "
            "Nitro Enclaves provisioning pitfalls. Exit 0: no errors; 1: errors found; "
            "2: usage or input error."
        ),
    )
    parser.add_argument("paths", nargs="+", help="YAML files or directories, or - for stdin")
    parser.add_argument(
        "--warnings-as-errors", action="store_true", help="exit 1 on warnings as well"
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    out = stdout or sys.stdout
    try:
        objects = load_paths(args.paths, sys.stdin)
    except (LoadError, OSError, UnicodeDecodeError) as exc:
        print(f"attestmesh lint: {exc}", file=sys.stderr)
        return 2
    findings = lint(objects)
    for f in findings:
        print(f.render(), file=out)
    errors = sum(f.severity is Severity.ERROR for f in findings)
    warnings = len(findings) - errors
    print(f"{len(objects)} objects, {errors} errors, {warnings} warnings", file=out)
    if errors or (warnings and args.warnings_as_errors):
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point (``python -m attestmesh.lint``)."""
    parser = argparse.ArgumentParser(prog="attestmesh")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    result: int = args.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "Code",
    "Finding",
    "Severity",
    "SourcedObject",
    "add_parser",
    "lint",
    "load_paths",
    "parse_documents",
    "parse_quantity",
    "run",
]
