"""Kubernetes adapter: CR, Pod, Service, EndpointSlice and Node watchers, TokenReview, Lease
leader election, quarantine actions.

Pure translation (top of the module) is separate from I/O (``KubeClient`` and below). The
``kubernetes`` client is synchronous; every call runs in a worker thread and answers raw JSON
(``_preload_content=False``), so the adapter works on the same dicts the API server sends.

Pods become registrations; the Service selecting a pod names its mesh service, and its
EndpointSlice endpoints say whether it is ready (``registration_from_pod``). A Service or slice
change re-derives the registrations of the pods it affects.

Watchers list, then watch from the list's resourceVersion with bookmarks; a broken watch (the
API server restarted, the connection dropped) resumes from the last resourceVersion, a 410 Gone
relists; failures back off exponentially. Invalid custom resources are refused one by one: each
problem is listed in a status condition ``Accepted=False`` (reason ``Invalid``) and an Event,
and the resource's previous valid version stays in force.

Only the Lease holder writes (status conditions, Events, quarantine actions); every replica
reads. Quarantine actions are idempotent, so re-deriving them from persisted state after a
restart (``KubeActions.reapply``) changes nothing that is already in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import random
import threading
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from certs.errors import AttestmeshError, PolicyError
from certs.policy import parse_policies
from xds.meshpolicy import MeshPolicy, parse_mesh_policies
from xds.secretpolicy import SecretPolicy, parse_secret_policies
from xds.state import Endpoint, MeshState, Registration, Status, Trigger

log = logging.getLogger(__name__)

GROUP = "attestmesh.dev"
VERSION = "v1alpha1"
ANNOTATION_INJECTED = "attestmesh.dev/injected"
ANNOTATION_INBOUND_PORT = "attestmesh.dev/inbound-port"
ANNOTATION_APP_PORT = "attestmesh.dev/app-port"
ANNOTATION_OUTBOUND = "attestmesh.dev/outbound"
LABEL_QUARANTINED = "attestmesh.dev/quarantined"
LABEL_PLATFORM_UNTRUSTED = "attestmesh.dev/platform-untrusted"
TAINT_PLATFORM_UNTRUSTED = "attestmesh.dev/platform-untrusted"
CONDITION_ATTESTED = "AttestmeshAttested"
CONDITION_ACCEPTED = "Accepted"
COMPONENT = "attestmesh-controlplane"
DEFAULT_INBOUND_PORT = 15006
# TokenReview ``status.user.extra`` keys the API server sets for a token bound to a pod (a
# projected service-account token): the pod's name and uid.
EXTRA_POD_NAME = "authentication.kubernetes.io/pod-name"
EXTRA_POD_UID = "authentication.kubernetes.io/pod-uid"


class KubeError(AttestmeshError):
    """A Kubernetes API call failed. ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, reason: str, detail: str = "", status: int = 0) -> None:
        super().__init__(reason, detail)
        self.status = status


class TokenReviewError(AttestmeshError):
    """A workload's service-account token was not accepted."""


# ---------------------------------------------------------------------------------------------
# pure translation


def workload_name(namespace: str, pod: str) -> str:
    """The registration name (and Envoy node id) of a pod. The one place this is decided."""
    return f"{namespace}/{pod}"


@dataclass(frozen=True, slots=True)
class WorkloadRef:
    namespace: str
    pod: str

    @classmethod
    def parse(cls, name: str) -> WorkloadRef:
        ns, sep, pod = name.partition("/")
        if not sep or not ns or not pod:
            raise ValueError(f"not a <namespace>/<pod> workload name: {name!r}")
        return cls(ns, pod)

    @property
    def name(self) -> str:
        return workload_name(self.namespace, self.pod)


def _port(value: Any) -> int | None:
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def parse_outbound(text: str) -> dict[str, int]:
    """``"billing=15001, ledger=15002"`` -> {service: local port}; bad entries are skipped."""
    out: dict[str, int] = {}
    for item in text.split(","):
        name, sep, port = item.strip().partition("=")
        p = _port(port)
        if sep and name.strip() and p is not None:
            out[name.strip()] = p
    return out


@dataclass(frozen=True, slots=True)
class ServiceSelector:
    """A Service with a pod selector: it names the mesh service of the pods it selects."""

    namespace: str
    name: str
    selector: Mapping[str, str]

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        return namespace == self.namespace and all(
            labels.get(k) == v for k, v in self.selector.items()
        )


def parse_service(obj: Mapping[str, Any]) -> ServiceSelector | None:
    """A Service -> its selector; a Service without one (ExternalName, hand-written endpoints)
    selects no pod -> None."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    name = meta.get("name")
    selector = spec.get("selector")
    if not isinstance(name, str) or not name or not isinstance(selector, Mapping) or not selector:
        return None
    return ServiceSelector(
        str(meta.get("namespace") or "default"),
        name,
        {str(k): str(v) for k, v in selector.items()},
    )


def select_service(
    namespace: str, labels: Mapping[str, str], services: Iterable[ServiceSelector]
) -> str | None:
    """The Service naming a pod's mesh service: of those selecting it, the lowest name (a pod
    selected by several Services belongs to one mesh service; the choice must not depend on
    watch order)."""
    names = [s.name for s in services if s.selects(namespace, labels)]
    return min(names) if names else None


def not_ready_endpoints(endpoint_slice: Mapping[str, Any]) -> frozenset[WorkloadRef]:
    """The pods an EndpointSlice (discovery.k8s.io/v1) says must not receive traffic: endpoints
    whose ``conditions.ready`` is false or ``conditions.terminating`` true. An absent ``ready``
    means ready, as the API defines it. Endpoints that are not pods are ignored."""
    meta = endpoint_slice.get("metadata") or {}
    namespace = str(meta.get("namespace") or "default")
    out: set[WorkloadRef] = set()
    for ep in endpoint_slice.get("endpoints") or []:
        if not isinstance(ep, Mapping):
            continue
        ref = ep.get("targetRef") or {}
        conditions = ep.get("conditions") or {}
        if not isinstance(ref, Mapping) or not isinstance(conditions, Mapping):
            continue
        name = ref.get("name")
        if ref.get("kind") != "Pod" or not isinstance(name, str) or not name:
            continue
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            out.add(WorkloadRef(str(ref.get("namespace") or namespace), name))
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What the control plane knows of a Node: its labels and taints (key, effect)."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[tuple[str, str], ...] = ()

    @property
    def platform_untrusted(self) -> bool:
        """Tainted by attestmesh: a workload's platform on this node failed attestation."""
        return (TAINT_PLATFORM_UNTRUSTED, "NoSchedule") in self.taints

    @property
    def quarantine_applied(self) -> bool:
        """The taint and the label a platform failure puts on the node are both in place."""
        return self.platform_untrusted and self.labels.get(LABEL_PLATFORM_UNTRUSTED) == "true"


def parse_node(obj: Mapping[str, Any]) -> NodeInfo | None:
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    taints = tuple(
        sorted(
            (str(t.get("key")), str(t.get("effect")))
            for t in (obj.get("spec") or {}).get("taints") or []
            if isinstance(t, Mapping)
        )
    )
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    return NodeInfo(name, labels, taints)


def pod_ports(pod: Mapping[str, Any]) -> tuple[int, int | None]:
    """(inbound, app) ports a pod's Registration has: the inbound port from the
    ``attestmesh.dev/inbound-port`` annotation, else ``DEFAULT_INBOUND_PORT``; the app port from
    ``attestmesh.dev/app-port``, else the first declared containerPort, else None (such a pod
    is not registered). The injector reads them the same way."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    ann = meta.get("annotations") or {}
    inbound = _port(ann.get(ANNOTATION_INBOUND_PORT)) or DEFAULT_INBOUND_PORT
    app_port = _port(ann.get(ANNOTATION_APP_PORT))
    if app_port is None:
        for c in spec.get("containers") or []:
            ports = (c.get("ports") or []) if isinstance(c, Mapping) else []
            first = ports[0] if ports else None
            if isinstance(first, Mapping) and (app_port := _port(first.get("containerPort"))):
                break
    return inbound, app_port


def registration_from_pod(
    pod: Mapping[str, Any],
    services: Iterable[ServiceSelector] = (),
    not_ready: Collection[WorkloadRef] = frozenset(),
) -> Registration | None:
    """An injected, running pod with an IP -> its Registration; anything else -> None.

    Its mesh service is (its namespace, the Service in its namespace selecting it); a pod no
    Service selects serves no mesh service (it may still call others). It is not ready when
    listed in ``not_ready`` (from EndpointSlices). Its ``pod_uid`` is the pod's
    ``metadata.uid``: agents' tokens must be bound to that very pod."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    ann = meta.get("annotations") or {}
    if ann.get(ANNOTATION_INJECTED) != "true" or meta.get("deletionTimestamp"):
        return None
    if status.get("phase") in ("Succeeded", "Failed") or not status.get("podIP"):
        return None
    namespace, name = meta.get("namespace") or "default", meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
    inbound, app_port = pod_ports(pod)
    if app_port is None:
        return None
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    uid = meta.get("uid")
    # Membership only through what the pod's own namespace declares: a Service there selecting
    # it. Nothing the pod says of itself (annotations, labels) makes it a member of a service.
    service = select_service(namespace, labels, services) or ""
    return Registration(
        name=workload_name(namespace, name),
        namespace=namespace,
        service_account=sa,
        service=service,
        inbound=Endpoint(status["podIP"], inbound),
        app_port=app_port,
        outbound=parse_outbound(str(ann.get(ANNOTATION_OUTBOUND, ""))),
        labels=labels,
        ready=WorkloadRef(namespace, name) not in not_ready,
        pod_uid=uid if isinstance(uid, str) and uid else None,
    )


def _micro(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _seconds(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: Any) -> datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def build_condition(
    ctype: str, status: bool, reason: str, message: str, now: datetime, generation: int | None
) -> dict[str, Any]:
    cond: dict[str, Any] = {
        "type": ctype,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": _seconds(now),
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def _same_condition(current: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> bool:
    if current is None:
        return False
    keys = ("status", "reason", "message", "observedGeneration")
    return all(current.get(k) == wanted.get(k) for k in keys)


def find_condition(obj: Mapping[str, Any], ctype: str) -> Mapping[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == ctype:
            return c
    return None


def _key(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def _clean(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a CR the parsers read (server-set metadata dropped)."""
    meta = obj.get("metadata") or {}
    return {
        "apiVersion": obj.get("apiVersion"),
        "kind": obj.get("kind"),
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "generation", "labels") if k in meta
        },
        "spec": obj.get("spec"),
    }


@dataclass(frozen=True, slots=True)
class Refused:
    namespace: str
    name: str
    generation: int | None
    problems: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reconciled:
    """Policies in force (valid current versions, or the last valid version of a refused
    resource), and the resources refused this round."""

    in_force: Mapping[tuple[str, str], Any]
    accepted: tuple[tuple[str, str, int | None], ...]
    refused: tuple[Refused, ...]


def reconcile(
    objects: Sequence[Mapping[str, Any]],
    previous: Mapping[tuple[str, str], Any],
    parse: Callable[[list[Any]], Sequence[Any]],
) -> Reconciled:
    """Parse each CR on its own; a refused CR keeps its previous valid version in force; a
    deleted CR leaves. Pure."""
    in_force: dict[tuple[str, str], Any] = {}
    accepted: list[tuple[str, str, int | None]] = []
    refused: list[Refused] = []
    for obj in objects:
        key = _key(obj)
        gen = (obj.get("metadata") or {}).get("generation")
        gen = gen if isinstance(gen, int) else None
        try:
            (policy,) = parse([_clean(obj)])
        except PolicyError as exc:
            refused.append(Refused(key[0], key[1], gen, tuple(exc.problems)))
            if key in previous:
                in_force[key] = previous[key]
            continue
        in_force[key] = policy
        accepted.append((key[0], key[1], gen))
    return Reconciled(in_force, tuple(accepted), tuple(refused))


def parse_secret_policy(docs: list[Any]) -> Sequence[SecretPolicy]:
    return parse_secret_policies(docs)


def _condition_reason(trigger: Trigger) -> str:
    return "".join(part.capitalize() for part in trigger.value.split("_"))


# Leader election (pure decision) ----------------------------------------------------------


class LeaseAction(enum.StrEnum):
    CREATE = "create"
    RENEW = "renew"
    TAKEOVER = "takeover"
    WAIT = "wait"


def decide_lease(
    lease: Mapping[str, Any] | None, identity: str, now: datetime
) -> tuple[LeaseAction, str | None]:
    """What to do with the Lease (and who holds it). Pure."""
    if lease is None:
        return LeaseAction.CREATE, None
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or None
    if holder == identity:
        return LeaseAction.RENEW, holder
    renewed = parse_time(spec.get("renewTime")) or parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds")
    if holder is None or renewed is None or not isinstance(duration, int):
        return LeaseAction.TAKEOVER, holder
    if now >= renewed + timedelta(seconds=duration):
        return LeaseAction.TAKEOVER, holder
    return LeaseAction.WAIT, holder


# ---------------------------------------------------------------------------------------------
# I/O


class KubeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.actions = Counter(
            "attestmesh_kube_actions_total",
            "Kubernetes writes by action and result",
            ["action", "result"],
            registry=registry,
        )
        self.watch_restarts = Counter(
            "attestmesh_kube_watch_restarts_total",
            "Watch restarts by resource and reason (gone: relist after 410; error: backoff; "
            "not_served: the server does not serve the resource)",
            ["resource", "reason"],
            registry=registry,
        )
        self.audits = Counter(
            "attestmesh_kube_audit_events_total",
            "Audit-mode failures recorded without action, by trigger",
            ["trigger"],
            registry=registry,
        )
        self.refused = Counter(
            "attestmesh_kube_refused_resources_total",
            "Custom resources refused as invalid, by kind",
            ["kind"],
            registry=registry,
        )
        self.untrusted_nodes = Gauge(
            "attestmesh_kube_untrusted_nodes",
            "Watched nodes carrying the attestmesh platform-untrusted taint",
            registry=registry,
        )


Sleep = Callable[[float], Awaitable[None]]
Clock = Callable[[], datetime]


class KubeClient:
    """The seam to the API server: the real ``kubernetes`` client, run in threads, raw JSON."""

    def __init__(self, api_client: Any, *, request_timeout: float = 10.0) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self.discovery = client.DiscoveryV1Api(api_client)
        self.auth = client.AuthenticationV1Api(api_client)
        self.request_timeout = request_timeout

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call an API method in a worker thread; return the decoded JSON body."""
        from kubernetes.client.exceptions import ApiException

        def run() -> Any:
            resp = fn(
                *args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs
            )
            data = resp.data if hasattr(resp, "data") else resp.read()
            return json.loads(data) if data else None

        try:
            return await asyncio.to_thread(run)
        except ApiException as exc:
            raise _translate(exc) from None
        except (OSError, ValueError) as exc:
            raise KubeError("kube_unreachable", str(exc)) from None
        except Exception as exc:  # urllib3's errors are not OSError subclasses
            if type(exc).__module__.startswith("urllib3"):
                raise KubeError("kube_unreachable", str(exc)) from None
            raise


def _translate(exc: Any) -> KubeError:
    status = int(getattr(exc, "status", 0) or 0)
    reason = {
        404: "not_found",
        409: "conflict",
        410: "gone",
        422: "invalid",
        429: "too_many_requests",
        403: "forbidden",
    }.get(status, "api_error")
    body = getattr(exc, "body", None) or getattr(exc, "reason", "")
    try:
        message = json.loads(body).get("message", body) if isinstance(body, str | bytes) else body
    except ValueError:
        message = body
    return KubeError(reason, str(message), status)


# TokenReview ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReviewedToken:
    """What the API server says a valid service-account token stands for. ``pod_name`` and
    ``pod_uid`` are set for a token bound to a pod (the projected token the kubelet mounts);
    a legacy secret-based token, or one requested without a pod binding, has neither."""

    namespace: str
    service_account: str
    pod_name: str | None = None
    pod_uid: str | None = None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _extra_value(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != 1:
        raise TokenReviewError("token_review_malformed", f"user.extra {key!r} must hold one value")
    value = values[0]
    if not isinstance(value, str) or not value:
        raise TokenReviewError("token_review_malformed", f"user.extra {key!r} is not a name")
    return value


def parse_token_review(review: Any, audience: str) -> ReviewedToken:
    """A TokenReview the API server answered -> the service account (and pod) its token stands
    for. Refused (``TokenReviewError``): not authenticated; ``audience`` not among
    ``status.audiences`` (the server must confirm the audience it was asked for); not a
    service account; a malformed pod claim."""
    status = _mapping(_mapping(review).get("status"))
    if status.get("authenticated") is not True:
        raise TokenReviewError("token_invalid", str(status.get("error", "not authenticated")))
    audiences = status.get("audiences")
    if not isinstance(audiences, list) or audience not in audiences:
        raise TokenReviewError("token_audience", f"token is not for audience {audience!r}")
    user = _mapping(status.get("user"))
    username = str(user.get("username", ""))
    parts = username.split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not all(parts[2:]):
        raise TokenReviewError("token_not_service_account", f"user {username!r}")
    extra = user.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise TokenReviewError("token_review_malformed", "user.extra is not a map")
    return ReviewedToken(
        parts[2], parts[3], _extra_value(extra, EXTRA_POD_NAME), _extra_value(extra, EXTRA_POD_UID)
    )


def check_pod_binding(token: ReviewedToken, reg: Registration) -> None:
    """The token must stand for the very pod ``reg`` was derived from: its namespace, service
    account, pod name and pod uid. A token of a sibling pod (same service account) or of an
    earlier pod of the same name is not this pod's. Raises ``TokenReviewError`` naming the
    claim that is missing or differs (never the registration's uid)."""
    if (token.namespace, token.service_account) != (reg.namespace, reg.service_account):
        raise TokenReviewError(
            "token_service_account_mismatch",
            f"token of {token.namespace}/{token.service_account} presented for {reg.name} "
            f"({reg.namespace}/{reg.service_account})",
        )
    for key, value in ((EXTRA_POD_NAME, token.pod_name), (EXTRA_POD_UID, token.pod_uid)):
        if value is None:
            raise TokenReviewError(
                "token_not_pod_bound",
                f"token of {token.namespace}/{token.service_account} has no {key} claim (a "
                f"legacy or unbound token); {reg.name} needs the projected token bound to its pod",
            )
    try:
        ref = WorkloadRef.parse(reg.name)
    except ValueError:
        raise TokenReviewError("registration_not_a_pod", f"{reg.name} is not a pod") from None
    if (token.namespace, token.pod_name) != (ref.namespace, ref.pod):
        raise TokenReviewError(
            "token_pod_mismatch",
            f"token bound to pod {token.namespace}/{token.pod_name} presented for {reg.name}",
        )
    if reg.pod_uid is None:
        raise TokenReviewError("registration_without_pod_uid", f"{reg.name} has no pod uid")
    if token.pod_uid != reg.pod_uid:
        raise TokenReviewError(
            "token_pod_uid_mismatch",
            f"token bound to pod uid {token.pod_uid} presented for {reg.name}, a different pod "
            "of that name",
        )


class TokenReviewer:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    async def verify_token(self, token: str, audience: str = "attestmesh") -> ReviewedToken:
        """A TokenReview for ``audience`` -> what a valid service-account token stands for
        (``parse_token_review``)."""
        if not token:
            raise TokenReviewError("token_missing", "no service-account token presented")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        try:
            review = await self.kube.call(self.kube.auth.create_token_review, body)
        except KubeError as exc:
            raise TokenReviewError("token_review_failed", exc.detail) from None
        return parse_token_review(review, audience)


# Leader election --------------------------------------------------------------------------


class LeaderElector:
    """coordination.k8s.io/v1 Lease election. ``step()`` is one attempt (tests drive it with an
    injected clock); ``run()`` repeats it every ``retry_period``."""

    def __init__(
        self,
        kube: KubeClient,
        identity: str,
        *,
        namespace: str = "attestmesh-system",
        name: str = "attestmesh-controlplane-leader",
        lease_duration: timedelta = timedelta(seconds=15),
        retry_period: timedelta = timedelta(seconds=2),
        clock: Clock = lambda: datetime.now(UTC),
        sleep: Sleep = asyncio.sleep,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.kube, self.identity, self.namespace, self.name = kube, identity, namespace, name
        self.lease_duration, self.retry_period = lease_duration, retry_period
        self.clock, self.sleep, self.on_change = clock, sleep, on_change
        self._leader = False
        self._renewed: datetime | None = None
        self.holder: str | None = None

    @property
    def is_leader(self) -> bool:
        renewed = self._renewed
        if self._leader and renewed is not None and self.clock() >= renewed + self.lease_duration:
            self._set(False)  # could not renew in time: stop acting
        return self._leader

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            log.info("leader election: %s is %s", self.identity, "leader" if leader else "follower")
            if self.on_change is not None:
                self.on_change(leader)

    def _spec(
        self, now: datetime, lease: Mapping[str, Any] | None, takeover: bool
    ) -> dict[str, Any]:
        old = (lease or {}).get("spec") or {}
        transitions = int(old.get("leaseTransitions") or 0) + (1 if takeover else 0)
        acquire = old.get("acquireTime") if lease and not takeover else _micro(now)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_duration.total_seconds()),
            "acquireTime": acquire,
            "renewTime": _micro(now),
            "leaseTransitions": transitions,
        }

    async def step(self) -> bool:
        now = self.clock()
        try:
            lease = await self.kube.call(
                self.kube.coordination.read_namespaced_lease, self.name, self.namespace
            )
        except KubeError as exc:
            if exc.status != 404:
                log.warning("leader election: cannot read lease: %s", exc)
                return self.is_leader
            lease = None
        action, holder = decide_lease(lease, self.identity, now)
        self.holder = holder
        try:
            if action is LeaseAction.CREATE:
                body = {
                    "apiVersion": "coordination.k8s.io/v1",
                    "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, None, False),
                }
                await self.kube.call(
                    self.kube.coordination.create_namespaced_lease, self.namespace, body
                )
            elif action in (LeaseAction.RENEW, LeaseAction.TAKEOVER):
                assert lease is not None
                body = {
                    **lease,
                    "spec": self._spec(now, lease, action is LeaseAction.TAKEOVER),
                }
                await self.kube.call(
                    self.kube.coordination.replace_namespaced_lease,
                    self.name,
                    self.namespace,
                    body,
                )
            else:
                self._set(False)
                return False
        except KubeError as exc:
            # conflict (someone else wrote first) or an error: not the leader unless our last
            # renewal is still valid
            log.info("leader election: %s on %s", exc.reason, action)
            if exc.status == 409:
                self._set(False)
            return self.is_leader
        self.holder = self.identity
        self._renewed = now
        self._set(True)
        return True

    async def run(self) -> None:
        try:
            while True:
                await self.step()
                await self.sleep(self.retry_period.total_seconds())
        finally:
            self._set(False)


# Watchers ---------------------------------------------------------------------------------


class _Gone(Exception):
    pass


@dataclass(slots=True)
class _WatchSpec:
    resource: str
    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    on_snapshot: Callable[[list[dict[str, Any]]], Awaitable[None]]
    on_event: Callable[[str, dict[str, Any]], Awaitable[None]]
    # A server that does not serve the resource (404 on the list) yields an empty snapshot and
    # no watch, instead of retrying forever (discovery.k8s.io/v1 EndpointSlices, Kubernetes
    # 1.21: an older server lists none, so every pod counts as ready).
    optional: bool = False


WatchSpec = _WatchSpec  # public name: what a Watcher lists and watches, and whom it tells


class Watcher:
    """list + watch with resourceVersion; relist on 410 Gone; exponential backoff on errors."""

    def __init__(
        self,
        kube: KubeClient,
        spec: _WatchSpec,
        *,
        metrics: KubeMetrics | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 30.0),
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.kube, self.spec, self.metrics = kube, spec, metrics
        self.watch_timeout, self.backoff, self.sleep = watch_timeout, backoff, sleep
        self.rng = rng or random.Random()  # jitter only
        self._watch: Any = None
        self.synced = asyncio.Event()
        self.resource_version: str | None = None
        self.lists = 0

    def _restart(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.watch_restarts.labels(resource=self.spec.resource, reason=reason).inc()

    async def run(self) -> None:
        delay = self.backoff[0]
        try:
            while True:
                try:
                    try:
                        listed = await self.kube.call(self.spec.list_fn, *self.spec.args)
                    except KubeError as exc:
                        if exc.status != 404 or not self.spec.optional:
                            raise
                        self._restart("not_served")
                        log.warning(
                            "%s: not served by this API server; none watched", self.spec.resource
                        )
                        await self.spec.on_snapshot([])
                        self.synced.set()
                        return
                    self.lists += 1
                    self.resource_version = str(listed["metadata"]["resourceVersion"])
                    await self.spec.on_snapshot(list(listed.get("items") or []))
                    self.synced.set()
                    delay = self.backoff[0]
                    while True:
                        # A broken stream (the API server restarted, the connection dropped)
                        # resumes from the last resourceVersion after a backoff: no relist
                        # unless the server answers 410 Gone (history compacted since).
                        try:
                            if await self._stream():
                                delay = self.backoff[0]
                            else:  # ended with nothing delivered: never spin
                                await self.sleep(self.backoff[0])
                        except KubeError as exc:
                            self._restart("error")
                            log.warning(
                                "watch %s: %s; resuming from %s in %.1fs",
                                self.spec.resource, exc, self.resource_version, delay,
                            )  # fmt: skip
                            await self.sleep(delay * (0.5 + self.rng.random()))
                            delay = min(delay * 2, self.backoff[1])
                except _Gone:
                    self._restart("gone")
                except KubeError as exc:
                    self._restart("error")
                    log.warning("watch %s: %s; retrying in %.1fs", self.spec.resource, exc, delay)
                    await self.sleep(delay * (0.5 + self.rng.random()))
                    delay = min(delay * 2, self.backoff[1])
        finally:
            self.stop_stream()

    def stop_stream(self) -> None:
        w = self._watch
        if w is not None:
            w.stop()

    async def _stream(self) -> bool:
        """One watch request from ``resource_version``; True if it delivered anything."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        self._watch = w
        rv = self.resource_version

        def pump() -> None:
            def put(item: tuple[str, Any]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    loop.call_soon_threadsafe(queue.put_nowait, item)

            try:
                for ev in w.stream(
                    self.spec.list_fn,
                    *self.spec.args,
                    resource_version=rv,
                    timeout_seconds=self.watch_timeout,
                    allow_watch_bookmarks=True,
                    _request_timeout=(self.kube.request_timeout, self.watch_timeout + 30),
                ):
                    put(("event", ev))
            except ApiException as exc:
                put(("error", exc))
            except Exception as exc:  # socket shut down by stop(), or a broken stream
                put(("error", exc))
            finally:
                put(("end", None))

        # A daemon thread, never awaited: a blocking read cannot be interrupted, and awaiting it
        # (or the default executor, at loop shutdown) would wait for the watch timeout.
        threading.Thread(target=pump, name=f"watch-{self.spec.resource}", daemon=True).start()
        delivered = False
        try:
            while True:
                kind, item = await queue.get()
                if kind == "end":
                    return delivered
                if kind == "error":
                    if getattr(item, "status", None) == 410:
                        raise _Gone()
                    if w._stop:
                        return delivered
                    if hasattr(item, "status"):
                        raise _translate(item)
                    raise KubeError("watch_broken", str(item))
                etype, obj = item.get("type"), item.get("raw_object") or {}
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise KubeError("watch_error", str(obj.get("message")), int(obj.get("code", 0)))
                if new_rv:
                    self.resource_version = str(new_rv)
                delivered = True
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    await self.spec.on_event(etype, obj)
        finally:
            w.stop()
            self._watch = None


# Events -----------------------------------------------------------------------------------


class EventRecorder:
    """core/v1 Events with client-side aggregation: the same (object, reason, message) bumps
    ``count`` on one Event instead of creating another."""

    def __init__(self, kube: KubeClient, clock: Clock, instance: str = "") -> None:
        self.kube, self.clock, self.instance = kube, clock, instance

    async def record(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        *,
        warning: bool = True,
    ) -> None:
        ns = involved.get("namespace") or "default"
        digest = hashlib.sha256(
            json.dumps([involved.get("kind"), involved.get("name"), reason, message]).encode()
        ).hexdigest()[:16]
        name = f"{involved.get('name')}.{digest}"
        now = _seconds(self.clock())
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": ns},
            "involvedObject": dict(involved),
            "reason": reason,
            "message": message[:1024],
            "type": "Warning" if warning else "Normal",
            "count": 1,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": COMPONENT, "host": self.instance},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.instance,
        }
        try:
            await self.kube.call(self.kube.core.create_namespaced_event, ns, body)
        except KubeError as exc:
            if exc.status != 409:
                raise
            current = await self.kube.call(self.kube.core.read_namespaced_event, name, ns)
            patch = {"count": int(current.get("count") or 1) + 1, "lastTimestamp": now}
            await self.kube.call(self.kube.core.patch_namespaced_event, name, ns, patch)


# Source: CRs, Pods, Services, EndpointSlices, Nodes -> callbacks --------------------------


@dataclass(slots=True)
class SourceCallbacks:
    # The AttestationPolicy documents in force (each the accepted version of its CR, server-set
    # metadata dropped): the consumer parses them itself (``ControlPlane.set_policies``).
    on_policy_documents: Callable[[list[dict[str, Any]]], Awaitable[None]]
    on_mesh_policies: Callable[[list[MeshPolicy]], Awaitable[None]]
    on_registration: Callable[[Registration], Awaitable[None]]
    on_removed: Callable[[str], Awaitable[None]]
    # Nodes (``watch_nodes``): a node seen or changed, a node gone. ``KubeSource.nodes`` holds
    # the current map either way.
    on_node: Callable[[NodeInfo], Awaitable[None]] | None = None
    on_node_removed: Callable[[str], Awaitable[None]] | None = None
    # A pod carrying the injected annotation was listed or changed (its namespace), whether or
    # not it is registered yet: it may still wait for volumes (the trust bundle) to start.
    on_injected_pod: Callable[[str], Awaitable[None]] | None = None
    # Secret release is on: SecretPolicy CRs are watched (the CRD may be missing: none then)
    # and the policies in force handed over whole on every change.
    on_secret_policies: Callable[[list[SecretPolicy]], Awaitable[None]] | None = None


@dataclass(slots=True)
class _CrKind:
    kind: str
    plural: str
    parse: Callable[[list[Any]], Sequence[Any]]
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    in_force: Mapping[tuple[str, str], Any] = field(default_factory=dict)
    docs: Mapping[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    announced: bool = False


class KubeSource:
    """Feeds the control plane from the cluster. ``run()`` supervises every watcher.

    ``pods`` holds the registrations announced; ``services`` (namespace -> name -> selector)
    and ``not_ready`` (from EndpointSlices) are what they were derived with. Pods are first
    listed once Services and EndpointSlices are, so no registration is announced with a
    service name only to be corrected a moment later."""

    def __init__(
        self,
        kube: KubeClient,
        callbacks: SourceCallbacks,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Clock = lambda: datetime.now(UTC),
        metrics: KubeMetrics | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 30.0),
        watch_nodes: bool = False,
        instance: str = "",
    ) -> None:
        self.kube, self.cb, self.is_leader, self.clock = kube, callbacks, is_leader, clock
        self.metrics = metrics
        self.events = EventRecorder(kube, clock, instance)
        self.kinds = {
            "AttestationPolicy": _CrKind(
                "AttestationPolicy", "attestationpolicies", parse_policies
            ),
            "MeshPolicy": _CrKind("MeshPolicy", "meshpolicies", parse_mesh_policies),
        }
        if callbacks.on_secret_policies is not None:
            self.kinds["SecretPolicy"] = _CrKind(
                "SecretPolicy", "secretpolicies", parse_secret_policy
            )
        self.pods: dict[str, Registration] = {}
        self._pod_objects: dict[str, dict[str, Any]] = {}  # of the pods in ``pods``
        self.services: dict[str, dict[str, ServiceSelector]] = {}
        self.slices: dict[tuple[str, str], frozenset[WorkloadRef]] = {}
        self.not_ready: frozenset[WorkloadRef] = frozenset()
        self.nodes: dict[str, NodeInfo] = {}
        self._lock = asyncio.Lock()
        self.watchers: list[Watcher] = []

        def watcher(spec: _WatchSpec) -> Watcher:
            w = Watcher(kube, spec, metrics=metrics, watch_timeout=watch_timeout, backoff=backoff)
            self.watchers.append(w)
            return w

        for k in self.kinds.values():
            watcher(
                _WatchSpec(
                    k.plural,
                    kube.custom.list_cluster_custom_object,
                    (GROUP, VERSION, k.plural),
                    self._cr_snapshot(k),
                    self._cr_event(k),
                    optional=k.kind == "SecretPolicy",  # its CRD is installed with the feature
                )
            )
        self._inputs = (
            watcher(
                _WatchSpec(
                    "services",
                    kube.core.list_service_for_all_namespaces,
                    (),
                    self._service_snapshot,
                    self._service_event,
                )
            ),
            watcher(
                _WatchSpec(
                    "endpointslices",
                    kube.discovery.list_endpoint_slice_for_all_namespaces,
                    (),
                    self._slice_snapshot,
                    self._slice_event,
                    optional=True,
                )
            ),
        )
        watcher(
            _WatchSpec(
                "pods",
                kube.core.list_pod_for_all_namespaces,
                (),
                self._pod_snapshot,
                self._pod_event,
            )
        )
        if watch_nodes:
            watcher(
                _WatchSpec("nodes", kube.core.list_node, (), self._node_snapshot, self._node_event)
            )

    def watcher(self, resource: str) -> Watcher:
        """The watcher of one resource (``pods``, ``services``, ``nodes``, ...)."""
        return next(w for w in self.watchers if w.spec.resource == resource)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for w in self.watchers:
                    tg.create_task(w.run())
        finally:
            for w in self.watchers:
                w.stop_stream()

    async def wait_synced(self) -> None:
        await asyncio.gather(*(w.synced.wait() for w in self.watchers))

    # custom resources

    def _cr_snapshot(self, k: _CrKind) -> Callable[[list[dict[str, Any]]], Awaitable[None]]:
        async def snapshot(items: list[dict[str, Any]]) -> None:
            async with self._lock:
                k.objects = {_key(o): o for o in items}
                await self._reconcile(k)

        return snapshot

    def _cr_event(self, k: _CrKind) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
        async def event(etype: str, obj: dict[str, Any]) -> None:
            async with self._lock:
                if etype == "DELETED":
                    k.objects.pop(_key(obj), None)
                else:
                    k.objects[_key(obj)] = obj
                await self._reconcile(k)

        return event

    async def _reconcile(self, k: _CrKind) -> None:
        result = reconcile(list(k.objects.values()), k.in_force, k.parse)
        changed = dict(result.in_force) != dict(k.in_force)
        k.in_force = result.in_force
        accepted = {(ns, name) for ns, name, _ in result.accepted}
        k.docs = {
            key: _clean(k.objects[key]) if key in accepted else k.docs[key]
            for key in result.in_force
            if key in accepted or key in k.docs
        }
        if changed or not k.announced:
            k.announced = True
            values = [result.in_force[key] for key in sorted(result.in_force)]
            if k.kind == "AttestationPolicy":
                await self.cb.on_policy_documents([k.docs[key] for key in sorted(k.docs)])
            elif k.kind == "SecretPolicy":
                if self.cb.on_secret_policies is not None:
                    await self.cb.on_secret_policies(values)
            else:
                await self.cb.on_mesh_policies(values)
        if not self.is_leader():
            return
        for ns, name, gen in result.accepted:
            await self._set_accepted(k, ns, name, gen, None)
        for refused in result.refused:
            if self.metrics is not None:
                self.metrics.refused.labels(kind=k.kind).inc()
            await self._set_accepted(
                k, refused.namespace, refused.name, refused.generation, refused
            )

    async def _set_accepted(
        self, k: _CrKind, ns: str, name: str, gen: int | None, refused: Refused | None
    ) -> None:
        obj = k.objects.get((ns, name))
        if obj is None:
            return
        if refused is None:
            wanted = build_condition(
                CONDITION_ACCEPTED, True, "Valid", "policy accepted", self.clock(), gen
            )
        else:
            kept = "; the previous valid version stays in force" if (ns, name) in k.in_force else ""
            message = f"{len(refused.problems)} problem(s): " + "; ".join(refused.problems) + kept
            wanted = build_condition(
                CONDITION_ACCEPTED, False, "Invalid", message, self.clock(), gen
            )
        current = find_condition(obj, CONDITION_ACCEPTED)
        if _same_condition(current, wanted):
            return
        if current is not None and current.get("status") == wanted["status"]:
            wanted["lastTransitionTime"] = current.get("lastTransitionTime")
        others = [
            c
            for c in (obj.get("status") or {}).get("conditions") or []
            if c.get("type") != CONDITION_ACCEPTED
        ]
        patch = {"status": {"observedGeneration": gen, "conditions": [*others, wanted]}}
        try:
            await self.kube.call(
                self.kube.custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                ns,
                k.plural,
                name,
                patch,
                _content_type="application/merge-patch+json",
            )
            if refused is not None:
                await self.events.record(
                    {
                        "apiVersion": f"{GROUP}/{VERSION}",
                        "kind": k.kind,
                        "name": name,
                        "namespace": ns,
                        "uid": (obj.get("metadata") or {}).get("uid", ""),
                    },
                    "Invalid",
                    wanted["message"],
                )
        except KubeError as exc:
            log.warning("cannot update status of %s %s/%s: %s", k.kind, ns, name, exc)

    # pods, and the Services and EndpointSlices their registrations are derived with

    def _derive(self, pod: Mapping[str, Any]) -> Registration | None:
        ns = str((pod.get("metadata") or {}).get("namespace") or "default")
        return registration_from_pod(pod, self.services.get(ns, {}).values(), self.not_ready)

    async def _announce(self, name: str, reg: Registration | None) -> None:
        """Tell the consumer about a pod's registration if it changed. Holds ``_lock``."""
        if reg is None:
            self._pod_objects.pop(name, None)
            if self.pods.pop(name, None) is not None:
                await self.cb.on_removed(name)
        elif self.pods.get(name) != reg:
            self.pods[name] = reg
            await self.cb.on_registration(reg)

    async def _rederive(self, names: Iterable[str]) -> None:
        """Re-derive known pods' registrations after a Service or readiness change."""
        for name in sorted(set(names)):
            obj = self._pod_objects.get(name)
            if obj is not None:
                await self._announce(name, self._derive(obj))

    def _in_namespaces(self, namespaces: Collection[str]) -> list[str]:
        return [name for name, reg in self.pods.items() if reg.namespace in namespaces]

    async def _pod_snapshot(self, items: list[dict[str, Any]]) -> None:
        for w in self._inputs:  # the first list waits for Services and EndpointSlices
            await w.synced.wait()
        async with self._lock:
            seen: dict[str, tuple[Registration, dict[str, Any]]] = {}
            for item in items:
                await self._injected_pod(item)
                reg = self._derive(item)
                if reg is not None:
                    seen[reg.name] = (reg, item)
            for name in sorted(set(self.pods) - set(seen)):
                await self._announce(name, None)
            for name, (reg, item) in sorted(seen.items()):
                self._pod_objects[name] = item
                await self._announce(name, reg)

    async def _pod_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            ns, pod = _key(obj)
            name = workload_name(ns, pod)
            reg = None if etype == "DELETED" else self._derive(obj)
            if etype != "DELETED":
                await self._injected_pod(obj)
            if reg is not None:
                self._pod_objects[name] = obj
            await self._announce(name, reg)

    async def _injected_pod(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        ann = meta.get("annotations") or {}
        if self.cb.on_injected_pod is not None and ann.get(ANNOTATION_INJECTED) == "true":
            await self.cb.on_injected_pod(str(meta.get("namespace") or "default"))

    async def _service_snapshot(self, items: list[dict[str, Any]]) -> None:
        async with self._lock:
            services: dict[str, dict[str, ServiceSelector]] = {}
            for item in items:
                sel = parse_service(item)
                if sel is not None:
                    services.setdefault(sel.namespace, {})[sel.name] = sel
            changed = {
                ns
                for ns in set(services) | set(self.services)
                if services.get(ns) != self.services.get(ns)
            }
            self.services = services
            await self._rederive(self._in_namespaces(changed))

    async def _service_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            ns, name = _key(obj)
            sel = None if etype == "DELETED" else parse_service(obj)
            current = self.services.get(ns, {})
            if current.get(name) == sel:
                return  # e.g. a status or port change: the selector is what matters
            updated = {k: v for k, v in current.items() if k != name}
            if sel is not None:
                updated[name] = sel
            if updated:
                self.services[ns] = updated
            else:
                self.services.pop(ns, None)
            await self._rederive(self._in_namespaces({ns}))

    async def _set_not_ready(self) -> None:
        old = self.not_ready
        self.not_ready = frozenset().union(*self.slices.values())
        await self._rederive(ref.name for ref in old ^ self.not_ready)

    async def _slice_snapshot(self, items: list[dict[str, Any]]) -> None:
        async with self._lock:
            self.slices = {_key(item): not_ready_endpoints(item) for item in items}
            await self._set_not_ready()

    async def _slice_event(self, etype: str, obj: dict[str, Any]) -> None:
        async with self._lock:
            if etype == "DELETED":
                self.slices.pop(_key(obj), None)
            else:
                self.slices[_key(obj)] = not_ready_endpoints(obj)
            await self._set_not_ready()

    # nodes

    async def _node_snapshot(self, items: list[dict[str, Any]]) -> None:
        seen = {n.name: n for n in map(parse_node, items) if n is not None}
        for name in sorted(set(self.nodes) - set(seen)):
            await self._node_gone(name)
        for _, info in sorted(seen.items()):
            await self._node_seen(info)

    async def _node_event(self, etype: str, obj: dict[str, Any]) -> None:
        info = parse_node(obj)
        if info is None:
            return
        if etype == "DELETED":
            await self._node_gone(info.name)
        else:
            await self._node_seen(info)

    async def _node_seen(self, info: NodeInfo) -> None:
        old = self.nodes.get(info.name)
        if old == info:
            return
        self.nodes[info.name] = info
        was_untrusted = old is not None and old.platform_untrusted
        if info.platform_untrusted and not was_untrusted:
            log.warning(
                "node %s carries the %s taint: a platform on it failed attestation",
                info.name,
                TAINT_PLATFORM_UNTRUSTED,
            )
        elif was_untrusted and not info.platform_untrusted:
            log.info("node %s: the %s taint was removed", info.name, TAINT_PLATFORM_UNTRUSTED)
        self._count_untrusted()
        if self.cb.on_node is not None:
            await self.cb.on_node(info)

    async def _node_gone(self, name: str) -> None:
        if self.nodes.pop(name, None) is None:
            return
        self._count_untrusted()
        if self.cb.on_node_removed is not None:
            await self.cb.on_node_removed(name)

    def _count_untrusted(self) -> None:
        if self.metrics is not None:
            self.metrics.untrusted_nodes.set(sum(n.platform_untrusted for n in self.nodes.values()))


# Quarantine actions -----------------------------------------------------------------------


class ActionResult(enum.StrEnum):
    DONE = "done"
    NOT_LEADER = "not_leader"
    POD_GONE = "pod_gone"
    EVICTION_BLOCKED = "eviction_blocked"


@dataclass(frozen=True, slots=True)
class QuarantineOutcome:
    result: ActionResult
    evicted: bool = False
    node_tainted: str | None = None


class KubeActions:
    """What quarantine does in Kubernetes. Every method is idempotent and leader-only."""

    def __init__(
        self,
        kube: KubeClient,
        *,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Clock = lambda: datetime.now(UTC),
        metrics: KubeMetrics | None = None,
        instance: str = "",
        nodes: Callable[[str], NodeInfo | None] = lambda _: None,
    ) -> None:
        self.kube, self.is_leader, self.clock, self.metrics = kube, is_leader, clock, metrics
        self.events = EventRecorder(kube, clock, instance)
        self.nodes = nodes  # the watched nodes (KubeSource.nodes), when there is a watch

    def _count(self, action: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.actions.labels(action=action, result=result).inc()

    async def quarantine(
        self,
        workload: WorkloadRef | str,
        reason: str,
        trigger: Trigger,
        *,
        evict: bool,
        platform_failed: bool,
        node: str | None = None,
    ) -> QuarantineOutcome:
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if not self.is_leader():
            return QuarantineOutcome(ActionResult.NOT_LEADER)
        ns, name = ref.namespace, ref.pod
        try:
            pod = await self.kube.call(self.kube.core.read_namespaced_pod, name, ns)
        except KubeError as exc:
            if exc.status == 404:
                self._count("quarantine", "pod_gone")
                return QuarantineOutcome(ActionResult.POD_GONE)
            raise
        if (pod["metadata"].get("labels") or {}).get(LABEL_QUARANTINED) != "true":
            await self.kube.call(
                self.kube.core.patch_namespaced_pod,
                name,
                ns,
                {"metadata": {"labels": {LABEL_QUARANTINED: "true"}}},
            )
            self._count("pod_label", "done")
        message = f"quarantined ({trigger.value}): {reason}"
        wanted = build_condition(
            CONDITION_ATTESTED, False, _condition_reason(trigger), message, self.clock(), None
        )
        current = find_condition(pod, CONDITION_ATTESTED)
        if not _same_condition(current, wanted):
            if current is not None and current.get("status") == "False":
                wanted["lastTransitionTime"] = current.get("lastTransitionTime")
            await self.kube.call(
                self.kube.core.patch_namespaced_pod_status,
                name,
                ns,
                {"status": {"conditions": [wanted]}},
            )
            self._count("pod_condition", "done")
        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": name,
            "namespace": ns,
            "uid": pod["metadata"].get("uid", ""),
        }
        await self.events.record(involved, "Quarantined", message)
        tainted = None
        node = node or (pod.get("spec") or {}).get("nodeName")
        if platform_failed and node:
            await self._taint(node, message)
            tainted = node
        evicted = False
        if evict:
            try:
                await self._evict(name, ns)
                evicted = True
                self._count("evict", "done")
            except KubeError as exc:
                if exc.status == 429:
                    self._count("evict", "blocked")
                    await self.events.record(involved, "EvictionBlocked", exc.detail)
                    return QuarantineOutcome(ActionResult.EVICTION_BLOCKED, False, tainted)
                if exc.status != 404:
                    raise
        self._count("quarantine", "done")
        return QuarantineOutcome(ActionResult.DONE, evicted, tainted)

    async def _evict(self, name: str, ns: str) -> None:
        """policy/v1 Eviction; a server older than Kubernetes 1.22 answers 400 for that
        version (measured on 1.20), and is asked again with policy/v1beta1."""
        for version in ("policy/v1", "policy/v1beta1"):
            body = {
                "apiVersion": version,
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": ns},
            }
            try:
                await self.kube.call(self.kube.core.create_namespaced_pod_eviction, name, ns, body)
                return
            except KubeError as exc:
                if exc.status != 400 or f'version "{version}"' not in exc.detail:
                    raise

    async def _taint(self, node: str, message: str) -> None:
        known = self.nodes(node)
        if known is not None and known.quarantine_applied:
            return  # the watch saw taint and label in place: nothing to read or write
        current = await self.kube.call(self.kube.core.read_node, node)
        taints = (current.get("spec") or {}).get("taints") or []
        labels = (current.get("metadata") or {}).get("labels") or {}
        has_taint = any(
            t.get("key") == TAINT_PLATFORM_UNTRUSTED and t.get("effect") == "NoSchedule"
            for t in taints
        )
        if has_taint and labels.get(LABEL_PLATFORM_UNTRUSTED) == "true":
            return
        patch: dict[str, Any] = {"metadata": {"labels": {LABEL_PLATFORM_UNTRUSTED: "true"}}}
        if not has_taint:
            patch["spec"] = {
                "taints": [
                    {"key": TAINT_PLATFORM_UNTRUSTED, "value": "true", "effect": "NoSchedule"}
                ]
            }
        await self.kube.call(self.kube.core.patch_node, node, patch)
        self._count("node_taint", "done")
        await self.events.record(
            {"apiVersion": "v1", "kind": "Node", "name": node, "namespace": "default"},
            "PlatformUntrusted",
            message,
        )

    async def record_audit(
        self, workload: WorkloadRef | str, reason: str, trigger: Trigger
    ) -> None:
        """Audit mode: an Event and a metric, nothing else."""
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if self.metrics is not None:
            self.metrics.audits.labels(trigger=trigger.value).inc()
        if not self.is_leader():
            return
        await self.events.record(
            {"apiVersion": "v1", "kind": "Pod", "name": ref.pod, "namespace": ref.namespace},
            "AttestationAudit",
            f"would quarantine ({trigger.value}): {reason}",
        )

    async def release(self, workload: WorkloadRef | str) -> ActionResult:
        """After a fresh successful attestation: label removed, condition True."""
        ref = WorkloadRef.parse(workload) if isinstance(workload, str) else workload
        if not self.is_leader():
            return ActionResult.NOT_LEADER
        try:
            pod = await self.kube.call(self.kube.core.read_namespaced_pod, ref.pod, ref.namespace)
        except KubeError as exc:
            if exc.status == 404:
                return ActionResult.POD_GONE
            raise
        if LABEL_QUARANTINED in (pod["metadata"].get("labels") or {}):
            await self.kube.call(
                self.kube.core.patch_namespaced_pod,
                ref.pod,
                ref.namespace,
                {"metadata": {"labels": {LABEL_QUARANTINED: None}}},
            )
        wanted = build_condition(
            CONDITION_ATTESTED, True, "Attested", "attested", self.clock(), None
        )
        if not _same_condition(find_condition(pod, CONDITION_ATTESTED), wanted):
            await self.kube.call(
                self.kube.core.patch_namespaced_pod_status,
                ref.pod,
                ref.namespace,
                {"status": {"conditions": [wanted]}},
            )
        return ActionResult.DONE

    async def reapply(
        self, state: MeshState, evict_for: Callable[[str], bool] = lambda _: False
    ) -> dict[str, QuarantineOutcome]:
        """Re-derive every quarantine from persisted state (after a restart or on election).
        Idempotent: what is already in place is left as it is."""
        out: dict[str, QuarantineOutcome] = {}
        for name, w in sorted(state.workloads.items()):
            if w.status is not Status.QUARANTINED or w.quarantine is None:
                continue
            try:
                ref = WorkloadRef.parse(name)
            except ValueError:
                continue  # not a Kubernetes workload (local registration)
            q = w.quarantine
            out[name] = await self.quarantine(
                ref,
                q.reason,
                q.trigger,
                evict=evict_for(name),
                platform_failed=q.platform,
            )
        return out


__all__ = [
    "EXTRA_POD_NAME",
    "EXTRA_POD_UID",
    "ActionResult",
    "KubeActions",
    "KubeClient",
    "KubeError",
    "KubeMetrics",
    "KubeSource",
    "LeaderElector",
    "LeaseAction",
    "NodeInfo",
    "QuarantineOutcome",
    "Reconciled",
    "Refused",
    "ReviewedToken",
    "ServiceSelector",
    "SourceCallbacks",
    "TokenReviewError",
    "TokenReviewer",
    "WatchSpec",
    "Watcher",
    "WorkloadRef",
    "build_condition",
    "check_pod_binding",
    "decide_lease",
    "not_ready_endpoints",
    "parse_node",
    "parse_outbound",
    "parse_service",
    "parse_token_review",
    "pod_ports",
    "reconcile",
    "registration_from_pod",
    "select_service",
    "workload_name",
]
