"""Kubernetes mode: the control plane fed by the cluster and acting on it.

Wiring only (behaviour lives in ``xds.kube``, ``sidecar.inject`` and the control plane):

- AttestationPolicy CRs -> ``ControlPlane.set_policies`` (the documents in force; an invalid CR
  is refused by the adapter with a status condition and an Event, its previous version stays);
  MeshPolicy CRs -> ``set_mesh_policies``; injected Pods -> ``register`` / removal. The Service
  selecting a pod names its mesh service and its EndpointSlice endpoint's readiness decides
  whether it receives traffic: a Service or slice change re-registers the pods it affects.
- Nodes are watched: their labels and taints (``KubeSource.nodes``) spare quarantine a read of
  a node already tainted; nodes carrying the platform-untrusted taint are logged and counted
  (``attestmesh_kube_untrusted_nodes``).
- Agent identity is per pod: the projected service-account token is checked with TokenReview
  (audience ``attestmesh``); the pod it is bound to (``user.extra`` pod-name and pod-uid) must
  be the registration's pod, so a sibling pod of the same service account can neither attest,
  fail nor renew in its name (``TokenReviewIdentity``). A pod recreated under the same name is
  a new workload: nothing of the previous pod's standing carries over.
- Lease leader election: only the leader writes to Kubernetes; every replica serves attestation.
- ``KubePublisher`` wraps the xDS publisher: quarantine, release and audit events become pod
  labels, conditions, Events, evictions and node taints (``KubeActions``), performed in order
  by one worker. On winning the election, and every ``resync``, the quarantines in the
  persisted state are re-applied (idempotent), so actions survive a restart or a failed call.
- The sidecar-injection webhook is served in the same process, its serving certificate issued
  from the mesh CA (or given), and its CA bundle written into the MutatingWebhookConfiguration.
- Trust bundle: the leader keeps the ConfigMap ``attestmesh-trust-bundle`` (key ``root.pem``,
  the mesh root bundle the API serves) in every namespace labelled ``attestmesh.dev/inject=
  enabled`` and every namespace where a pod carrying the injected annotation was seen (seen
  before it is registered: an injected pod cannot start until the ConfigMap exists). Injected
  agents verify the attestation API with it, injected Envoys the xDS server. Written when a
  namespace first needs it and re-checked on every re-apply (drift, a changed bundle, a
  deleted ConfigMap); never deleted (public data, and pods may still mount it).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import enum
import logging
import ssl
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from attestmesh.controlplane import ControlPlane, Publisher
from attestmesh.listen import ListenLimits, start_aiohttp
from attestmesh.metrics import Metrics
from attestmesh.serve import Hooks
from certs.ca import CertificateAuthority, issue_serving_credentials
from certs.errors import AttestmeshError, PolicyError
from certs.issuance import IdentityError
from certs.policy import AttestationPolicy, Mode, OnFailure, policies_for
from certs.secrets_api import SecretPolicies
from sidecar.inject import (
    LABEL_INJECT,
    TRUST_CONFIGMAP,
    TRUST_KEY,
    InjectConfig,
    NamespaceLabels,
    build_app,
    webhook_counter,
)
from xds.build import TrustMaterial
from xds.kube import (
    KubeActions,
    KubeClient,
    KubeError,
    KubeMetrics,
    KubeSource,
    LeaderElector,
    SourceCallbacks,
    TokenReviewer,
    TokenReviewError,
    Watcher,
    WatchSpec,
    WorkloadRef,
    check_pod_binding,
)
from xds.meshpolicy import MeshPolicy
from xds.publisher import XdsPublisher
from xds.secretpolicy import SecretPolicy
from xds.state import Event, EventKind, MeshState, Registration, Trigger

log = logging.getLogger(__name__)

TOKEN_AUDIENCE = "attestmesh"  # noqa: S105 (an audience, the one the injector projects)
WEBHOOK_CERT_TTL = timedelta(hours=24)


class KubeConfigError(AttestmeshError):
    """No usable Kubernetes client configuration."""


@dataclass(frozen=True, slots=True)
class KubeSettings:
    """Kubernetes-mode settings, read once in main()."""

    namespace: str = "attestmesh-system"
    identity: str = "attestmesh-controlplane"  # this replica's name in the Lease
    lease_name: str = "attestmesh-controlplane-leader"
    lease_duration: timedelta = timedelta(seconds=15)
    retry_period: timedelta = timedelta(seconds=2)
    service_name: str = "attestmesh-controlplane"
    token_audience: str = TOKEN_AUDIENCE
    webhook_host: str = "0.0.0.0"
    webhook_port: int | None = 9443  # None: no webhook in this process
    webhook_cert: Path | None = None  # with webhook_key; else issued from the mesh CA
    webhook_key: Path | None = None
    webhook_configuration: str | None = None  # MutatingWebhookConfiguration to write caBundle to
    # an issued webhook certificate's lifetime (renewed at half of it), and the first and
    # longest wait before retrying a failed renewal (doubling in between)
    webhook_cert_ttl: timedelta = WEBHOOK_CERT_TTL
    webhook_cert_retry: tuple[timedelta, timedelta] = (timedelta(seconds=10), timedelta(minutes=10))
    probe_host: str = "0.0.0.0"
    probe_port: int | None = None  # /metrics, /healthz, /readyz on the pod network (no admin)
    resync: timedelta = timedelta(minutes=5)
    watch_timeout: int = 300
    request_timeout: float = 10.0
    threads: int = 16  # worker threads for API calls, beside one per watch
    inject: InjectConfig = field(default_factory=InjectConfig)

    def service_dns_names(self) -> tuple[str, ...]:
        svc, ns = self.service_name, self.namespace
        return (svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local")


def connect(kubeconfig: Path | None, request_timeout: float = 10.0) -> KubeClient:
    """A client from a kubeconfig file, or the in-cluster service account when None."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig is not None:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=str(kubeconfig), client_configuration=cfg
            )
        else:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    except (config.ConfigException, OSError, ValueError) as exc:
        where = str(kubeconfig) if kubeconfig else "the in-cluster service account"
        raise KubeConfigError(
            "kube_config_invalid", f"cannot load Kubernetes configuration from {where}: {exc}"
        ) from None
    return KubeClient(client.ApiClient(cfg), request_timeout=request_timeout)


# ---------------------------------------------------------------------------------------------
# identity


class TokenReviewIdentity:
    """IdentityCheck: the agent's projected service-account token, checked with TokenReview,
    must be bound to the registration's pod: namespace, service account, pod name and pod uid
    (``xds.kube.check_pod_binding``). A refusal is logged; the API counts it."""

    def __init__(self, reviewer: TokenReviewer, audience: str = TOKEN_AUDIENCE) -> None:
        self._reviewer = reviewer
        self._audience = audience

    async def check(self, reg: Registration, token: str | None) -> None:
        try:
            check_pod_binding(await self._reviewer.verify_token(token or "", self._audience), reg)
        except TokenReviewError as exc:
            log.warning("identity refused for %s: %s: %s", reg.name, exc.reason, exc.detail)
            raise IdentityError("identity_invalid", f"{exc.reason}: {exc.detail}") from None


# ---------------------------------------------------------------------------------------------
# actions: events -> work items, performed in order by one worker


class WorkKind(enum.StrEnum):
    QUARANTINE = "quarantine"
    RELEASE = "release"
    AUDIT = "audit"
    REAPPLY = "reapply"
    TRUST_BUNDLE = "trust_bundle"


@dataclass(frozen=True, slots=True)
class Work:
    kind: WorkKind
    workload: str = ""
    reason: str = ""
    trigger: Trigger = Trigger.OPERATOR
    evict: bool = False
    platform_failed: bool = False
    namespace: str = ""  # TRUST_BUNDLE: where


def should_evict(policies: Sequence[AttestationPolicy], reg: Registration) -> bool:
    """Evict when an enforcing policy governing the workload says quarantineAndEvict."""
    return any(
        p.mode is Mode.ENFORCE and p.on_failure is OnFailure.QUARANTINE_AND_EVICT
        for p in policies_for(policies, reg.namespace, reg.service_account, reg.labels)
    )


def build_work(
    state: MeshState, events: Sequence[Event], policies: Sequence[AttestationPolicy]
) -> list[Work]:
    """What Kubernetes should do about these events. Pure. Workloads that are not pods
    (names that are not ``<namespace>/<pod>``) are left alone."""
    out: list[Work] = []
    for e in events:
        try:
            WorkloadRef.parse(e.workload)
        except ValueError:
            continue
        if e.kind is EventKind.QUARANTINED:
            trigger = e.trigger or Trigger.OPERATOR
            w = state.workloads.get(e.workload)
            evict = w is not None and should_evict(policies, w.registration)
            out.append(
                Work(
                    WorkKind.QUARANTINE,
                    e.workload,
                    e.reason,
                    trigger,
                    evict=evict,
                    platform_failed=e.platform,
                )
            )
        elif e.kind is EventKind.RELEASED:
            out.append(Work(WorkKind.RELEASE, e.workload))
        elif e.kind is EventKind.AUDIT:
            out.append(Work(WorkKind.AUDIT, e.workload, e.reason, Trigger.APPRAISAL_FAILED))
        elif e.kind is EventKind.REFUSED:
            out.append(Work(WorkKind.AUDIT, e.workload, e.reason, Trigger.VERIFICATION_FAILED))
    return out


class KubePublisher:
    """Publisher: xDS as before, then the events' Kubernetes actions queued for the worker."""

    def __init__(self, inner: Publisher, mode: KubeMode) -> None:
        self._inner = inner
        self._mode = mode

    def publish(
        self,
        state: MeshState,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None:
        self._inner.publish(state, mesh_policies, trust, changed)

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None:
        self._inner.on_events(state, events)
        for work in build_work(state, events, self._mode.policies):
            self._mode.submit(work)


# ---------------------------------------------------------------------------------------------
# TLS for the webhook


def _issue_webhook_tls(
    ca: CertificateAuthority,
    spiffe_id: str,
    dns_names: Sequence[str],
    now: datetime,
    directory: Path,
    ttl: timedelta = WEBHOOK_CERT_TTL,
) -> tuple[Path, Path]:
    return issue_serving_credentials(
        ca, directory, "webhook", spiffe_id=spiffe_id, dns_names=dns_names,
        ips=("127.0.0.1",), now=now, ttl=ttl,
    )  # fmt: skip


def renewal_wait(
    failures: int, renew: timedelta, first_retry: timedelta, max_retry: timedelta
) -> timedelta:
    """How long to wait before the next re-issue of a serving certificate: ``renew`` after a
    success (``failures == 0``); after consecutive failures ``first_retry`` doubling up to
    ``max_retry``, never later than ``renew``."""
    if failures < 0:
        raise ValueError(f"failures must be >= 0, not {failures}")
    if failures == 0:
        return renew
    backoff: timedelta = first_retry * (2 ** min(failures - 1, 32))
    return min(backoff, max_retry, renew)


# ---------------------------------------------------------------------------------------------
# the mode


class KubeMode:
    """Everything Kubernetes mode adds to the control plane; ``hooks()`` plugs it in."""

    def __init__(
        self,
        kube: KubeClient,
        settings: KubeSettings,
        metrics: Metrics,
        *,
        state_dir: Path,
        secret_policies: SecretPolicies | None = None,
    ) -> None:
        self.kube, self.settings, self.metrics = kube, settings, metrics
        self.state_dir = state_dir
        self.secret_policies = secret_policies  # secret release on: fed from SecretPolicy CRs
        self.kube_metrics = KubeMetrics(metrics.registry)
        self.namespaces = NamespaceLabels()
        self.elector = LeaderElector(
            kube,
            settings.identity,
            namespace=settings.namespace,
            name=settings.lease_name,
            lease_duration=settings.lease_duration,
            retry_period=settings.retry_period,
            on_change=self._on_leader_change,
        )
        self.actions = KubeActions(
            kube,
            is_leader=lambda: self.elector.is_leader,
            metrics=self.kube_metrics,
            instance=settings.identity,
            nodes=lambda name: self.source.nodes.get(name),
        )
        self.source = KubeSource(
            kube,
            SourceCallbacks(
                on_mesh_policies=self._on_mesh_policies,
                on_registration=self._on_registration,
                on_removed=self._on_removed,
                on_policy_documents=self._on_policy_documents,
                on_injected_pod=self._on_injected_pod,
                on_secret_policies=self._on_secret_policies if secret_policies else None,
            ),
            is_leader=lambda: self.elector.is_leader,
            metrics=self.kube_metrics,
            watch_timeout=settings.watch_timeout,
            watch_nodes=True,
            instance=settings.identity,
        )
        self.namespace_watcher = Watcher(
            kube,
            WatchSpec(
                "namespaces",
                kube.core.list_namespace,
                (),
                self._namespaces_listed,
                self._namespace_event,
            ),
            metrics=self.kube_metrics,
            watch_timeout=settings.watch_timeout,
        )
        self.identity = TokenReviewIdentity(TokenReviewer(kube), settings.token_audience)
        self.synced = asyncio.Event()
        self.webhook_url: str | None = None
        # what the worker did lately, in order (ops and tests read it); bounded
        self.completed: collections.deque[Work] = collections.deque(maxlen=1000)
        self._queue: asyncio.Queue[Work] = asyncio.Queue()
        self._retry = asyncio.Event()
        self._cp: ControlPlane | None = None
        self._ca_bundle: bytes | None = None
        # namespaces that need the trust-bundle ConfigMap, and the bundle last written there
        self.trust_namespaces: set[str] = set()
        self._trust_written: dict[str, bytes] = {}
        self._trust_queued: set[str] = set()

    @property
    def policies(self) -> tuple[AttestationPolicy, ...]:
        """The attestation policies in force (the control plane's; none before it runs)."""
        return () if self._cp is None else self._cp.policies

    def hooks(self) -> Hooks:
        return Hooks(
            identity=self.identity,
            wrap_publisher=self._wrap,
            run=self.run,
            secret_policies=self.secret_policies,
        )

    def _wrap(self, inner: XdsPublisher) -> Publisher:
        return KubePublisher(inner, self)

    def submit(self, work: Work) -> None:
        self._queue.put_nowait(work)

    @property
    def cp(self) -> ControlPlane:
        if self._cp is None:
            raise RuntimeError("Kubernetes mode is not running")
        return self._cp

    # -- source callbacks ---------------------------------------------------------------------

    async def _on_policy_documents(self, docs: list[dict[str, Any]]) -> None:
        try:
            # set_policies puts them in force before it quarantines anything, so eviction
            # decisions (build_work, via self.policies) already follow the new policy
            policies = self.cp.set_policies(docs)
        except PolicyError as exc:  # each CR was valid alone; together they are not
            log.error("refused AttestationPolicies: %s", "; ".join(exc.problems))
            return
        log.info("attestation policies in force: %s", [p.name for p in policies])

    async def _on_mesh_policies(self, policies: list[MeshPolicy]) -> None:
        self.cp.set_mesh_policies(policies)

    async def _on_secret_policies(self, policies: list[SecretPolicy]) -> None:
        if self.secret_policies is not None:
            kept = self.secret_policies.set_policies(policies)
            log.info("secret policies in force: %s", [f"{p.namespace}/{p.name}" for p in kept])

    async def _on_registration(self, reg: Registration) -> None:
        current = self.cp.state.workloads.get(reg.name)
        if current is not None and current.registration.pod_uid not in (None, reg.pod_uid):
            # another pod under the same name (a StatefulSet pod recreated, possibly while this
            # replica was down): the previous pod's attestation or quarantine is not this one's
            self.cp.unregister(reg.name)
            log.info("pod %s was recreated (uid %s): registered afresh", reg.name, reg.pod_uid)
        self.cp.register([reg])

    async def _on_removed(self, name: str) -> None:
        if self.cp.unregister(name):
            log.info("pod %s is gone: registration removed", name)

    async def _namespaces_listed(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            await self._namespace_event("ADDED", item)

    async def _namespace_event(self, etype: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if isinstance(name, str):
            labels = {} if etype == "DELETED" else (meta.get("labels") or {})
            self.namespaces.set(name, {str(k): str(v) for k, v in labels.items()})
            if etype == "DELETED":
                self.trust_namespaces.discard(name)
                self._trust_written.pop(name, None)
            elif labels.get(LABEL_INJECT) == "enabled":
                self._need_trust_bundle(name)

    async def _on_injected_pod(self, namespace: str) -> None:
        self._need_trust_bundle(namespace)

    def _need_trust_bundle(self, namespace: str) -> None:
        if namespace == self.settings.namespace:
            return  # never injected (sidecar.inject)
        self.trust_namespaces.add(namespace)
        if not self.elector.is_leader or self._cp is None:
            return  # a new leader's re-apply covers every namespace in trust_namespaces
        if self._trust_written.get(namespace) == self.trust_bundle():
            return
        if namespace not in self._trust_queued:
            self._trust_queued.add(namespace)
            self.submit(Work(WorkKind.TRUST_BUNDLE, namespace=namespace))

    # -- leadership ---------------------------------------------------------------------------

    def _on_leader_change(self, leader: bool) -> None:
        if leader:
            self.submit(Work(WorkKind.REAPPLY))

    # -- the worker ---------------------------------------------------------------------------

    async def _perform(self, work: Work) -> None:
        if work.kind is WorkKind.QUARANTINE:
            await self.actions.quarantine(
                work.workload,
                work.reason,
                work.trigger,
                evict=work.evict,
                platform_failed=work.platform_failed,
            )
        elif work.kind is WorkKind.RELEASE:
            await self.actions.release(work.workload)
        elif work.kind is WorkKind.AUDIT:
            await self.actions.record_audit(work.workload, work.reason, work.trigger)
        elif work.kind is WorkKind.TRUST_BUNDLE:
            self._trust_queued.discard(work.namespace)
            if self.elector.is_leader and work.namespace in self.trust_namespaces:
                await self.ensure_trust_bundle(work.namespace)
        else:
            if not self.elector.is_leader:
                return
            await self.synced.wait()  # the policies (eviction) and pods are known
            state = self.cp.state
            await self.actions.reapply(
                state, lambda name: should_evict(self.policies, state.get(name).registration)
            )
            await self._write_ca_bundle()
            failed: list[str] = []
            for namespace in sorted(self.trust_namespaces):
                try:
                    await self.ensure_trust_bundle(namespace, cached=False)
                except KubeError as exc:  # one namespace does not hold up the others
                    log.warning("trust bundle in %s: %s", namespace, exc)
                    failed.append(namespace)
            if failed:
                self._retry.set()

    # -- trust bundle -------------------------------------------------------------------------

    def trust_bundle(self) -> bytes:
        """The mesh root bundle injected pods trust: the one the attestation API serves."""
        return self.cp.ca.bundle_pem

    async def ensure_trust_bundle(self, namespace: str, *, cached: bool = True) -> bool:
        """Create or update the ``attestmesh-trust-bundle`` ConfigMap in ``namespace`` so that
        ``root.pem`` is the current bundle; True when it wrote. Idempotent: reads first, and an
        unchanged ConfigMap is not written (``cached``: not even read when this replica wrote
        the same bundle there)."""
        bundle = self.trust_bundle()
        if cached and self._trust_written.get(namespace) == bundle:
            return False
        kube, text = self.kube, bundle.decode()
        labels = {
            "app.kubernetes.io/managed-by": "attestmesh",
            "app.kubernetes.io/part-of": "attestmesh",
        }
        for _ in range(2):  # a create that lost a race is followed by one read-and-update
            try:
                current = await kube.call(
                    kube.core.read_namespaced_config_map, TRUST_CONFIGMAP, namespace
                )
            except KubeError as exc:
                if exc.status != 404:
                    raise
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": TRUST_CONFIGMAP, "namespace": namespace, "labels": labels},
                    "data": {TRUST_KEY: text},
                }
                try:
                    await kube.call(kube.core.create_namespaced_config_map, namespace, body)
                except KubeError as exc2:
                    if exc2.status == 409:
                        continue
                    raise
                log.info("created ConfigMap %s/%s (mesh trust bundle)", namespace, TRUST_CONFIGMAP)
                self._trust_written[namespace] = bundle
                return True
            meta = current.get("metadata") or {}
            data = current.get("data") or {}
            have_labels = meta.get("labels") or {}
            if data.get(TRUST_KEY) == text and labels.items() <= have_labels.items():
                self._trust_written[namespace] = bundle
                return False
            current["data"] = {**data, TRUST_KEY: text}
            binary = current.get("binaryData")
            if isinstance(binary, dict):
                binary.pop(TRUST_KEY, None)  # a key may not be in both
            meta["labels"] = {**have_labels, **labels}
            current["metadata"] = meta  # resourceVersion kept: a concurrent writer gets 409
            await kube.call(
                kube.core.replace_namespaced_config_map, TRUST_CONFIGMAP, namespace, current
            )
            log.info("updated ConfigMap %s/%s (mesh trust bundle)", namespace, TRUST_CONFIGMAP)
            self._trust_written[namespace] = bundle
            return True
        raise KubeError("conflict", f"ConfigMap {namespace}/{TRUST_CONFIGMAP} keeps changing", 409)

    async def _worker(self) -> None:
        while True:
            work = await self._queue.get()
            try:
                await self._perform(work)
            except (KubeError, AttestmeshError) as exc:
                # idempotent actions: the next re-apply repairs what this one missed
                what = work.workload or work.namespace
                log.warning("kubernetes %s of %s failed: %s", work.kind, what, exc)
                self._retry.set()
            finally:
                self.completed.append(work)
                self._queue.task_done()

    async def _resync(self, stop: asyncio.Event) -> None:
        backoff = 1.0
        while not stop.is_set():
            wait = self.settings.resync.total_seconds()
            if self._retry.is_set():
                wait, backoff = min(backoff, wait), min(backoff * 2, wait)
            else:
                backoff = 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            if stop.is_set():
                return
            self._retry.clear()
            if self.elector.is_leader:
                self.submit(Work(WorkKind.REAPPLY))

    async def drained(self) -> None:
        """Wait until every transition decided so far was announced (the control plane
        announces once durable) and every action queued was attempted (tests, shutdown)."""
        if self._cp is not None:
            await self._cp.flushed()
            await asyncio.sleep(0)  # the announcement itself is a callback of durability
        await self._queue.join()

    # -- webhook ------------------------------------------------------------------------------

    def _webhook_tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        s = self.settings
        if s.webhook_cert is not None and s.webhook_key is not None:
            ctx.load_cert_chain(s.webhook_cert, s.webhook_key)
            return ctx
        self._load_issued(ctx)
        self._ca_bundle = self.cp.ca.bundle_pem
        return ctx

    def _load_issued(self, ctx: ssl.SSLContext) -> None:
        s = self.settings
        cert, key = _issue_webhook_tls(
            self.cp.ca,
            f"spiffe://{self.cp.state.trust_domain}/ns/{s.namespace}/sa/{s.service_name}",
            (*s.service_dns_names(), "localhost"),
            datetime.now(UTC),
            self.state_dir / "tls",
            s.webhook_cert_ttl,
        )
        ctx.load_cert_chain(cert, key)

    async def _rotate_webhook_cert(self, ctx: ssl.SSLContext, stop: asyncio.Event) -> None:
        """Re-issue the webhook's serving certificate at half its lifetime (new handshakes
        use the new one). A failed re-issue is logged, counted and retried with backoff: it
        must not end the task group, and with it the control plane (the current certificate
        stays valid for the other half)."""
        s = self.settings
        renew, (first, cap) = s.webhook_cert_ttl / 2, s.webhook_cert_retry
        counter = self.metrics.serving_cert_renewals
        failures = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                wait = renewal_wait(failures, renew, first, cap)
                await asyncio.wait_for(stop.wait(), wait.total_seconds())
            if stop.is_set():
                return
            try:
                self._load_issued(ctx)
            except Exception:  # any failure: the webhook keeps serving its current certificate
                failures += 1
                counter.labels(listener="webhook", result="failed").inc()
                log.exception("could not renew the webhook's serving certificate (%d)", failures)
            else:
                failures = 0
                counter.labels(listener="webhook", result="ok").inc()

    async def _write_ca_bundle(self) -> None:
        name = self.settings.webhook_configuration
        if name is None or self._ca_bundle is None or not self.elector.is_leader:
            return
        from kubernetes import client

        api = client.AdmissionregistrationV1Api(self.kube.api_client)
        try:
            current = await self.kube.call(api.read_mutating_webhook_configuration, name)
        except KubeError as exc:
            if exc.status == 404:
                log.warning("MutatingWebhookConfiguration %s not found: caBundle not set", name)
                return
            raise
        bundle = base64.b64encode(self._ca_bundle).decode()
        ops: list[dict[str, Any]] = []
        for i, h in enumerate(current.get("webhooks") or []):
            config = h.get("clientConfig")
            if isinstance(config, dict) and config.get("caBundle") == bundle:
                continue
            # the test op makes a concurrent reordering fail instead of patching the wrong hook
            ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": h.get("name")})
            if isinstance(config, dict):
                ops.append(
                    {"op": "add", "path": f"/webhooks/{i}/clientConfig/caBundle", "value": bundle}
                )
            else:
                ops.append(
                    {
                        "op": "add",
                        "path": f"/webhooks/{i}/clientConfig",
                        "value": {"caBundle": bundle},
                    }
                )
        if not ops:
            return
        await self.kube.call(
            api.patch_mutating_webhook_configuration,
            name,
            ops,
            _content_type="application/json-patch+json",
        )
        log.info("wrote caBundle into MutatingWebhookConfiguration %s", name)

    # -- probes -------------------------------------------------------------------------------

    def _probe_app(self) -> web.Application:
        async def metrics_handler(_: web.Request) -> web.Response:
            body = generate_latest(self.metrics.registry)
            return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def healthz(_: web.Request) -> web.Response:
            if self._cp is not None and not self._cp.healthy:  # a failed store write
                return web.json_response({"status": "store_failed"}, status=503)
            return web.json_response({"status": "ok"})

        async def readyz(_: web.Request) -> web.Response:
            # the same verdicts as the ops port's /readyz (attestmesh.serve): the kubelet
            # probes this port, so a replica cut off from its database leaves the Service
            if self._cp is not None and not self._cp.healthy:
                return web.json_response({"status": "store_failed"}, status=503)
            if self._cp is not None and not self._cp.ready:
                return web.json_response({"status": "store_unreachable"}, status=503)
            if not self.synced.is_set():
                return web.json_response({"status": "syncing"}, status=503)
            return web.json_response({"status": "ok", "leader": self.elector.is_leader})

        app = web.Application()
        app.router.add_get("/metrics", metrics_handler)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        return app

    # -- run ----------------------------------------------------------------------------------

    async def run(self, cp: ControlPlane, stop: asyncio.Event) -> None:
        """Watch, elect, act and serve the webhook until ``stop`` is set."""
        self._cp = cp
        runners: list[web.AppRunner] = []
        s = self.settings
        # Each watch holds a worker thread for as long as it streams (the kubernetes client is
        # synchronous): size the loop's default pool so API calls never queue behind them.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(
                max_workers=len(self.source.watchers) + 1 + s.threads,
                thread_name_prefix="attestmesh-kube",
            )
        )
        try:
            webhook_ctx: ssl.SSLContext | None = None
            if s.webhook_port is not None:
                webhook_ctx = self._webhook_tls()
                # injected bootstraps verify the xDS server's SPIFFE ID in this trust domain
                inject = dataclasses.replace(s.inject, trust_domain=cp.state.trust_domain)
                app = build_app(inject, self.namespaces, webhook_counter(self.metrics.registry))
                runner = web.AppRunner(app, access_log=None)
                runners.append(runner)
                await runner.setup()
                site = await start_aiohttp(
                    runner, s.webhook_host, s.webhook_port, ssl=webhook_ctx, limits=ListenLimits(),
                    name="webhook",
                )  # fmt: skip
                self.webhook_url = f"https://{s.webhook_host}:{site.port}"
            if s.probe_port is not None:
                runner = web.AppRunner(self._probe_app(), access_log=None)
                runners.append(runner)
                await runner.setup()
                await start_aiohttp(
                    runner, s.probe_host, s.probe_port, ssl=None, limits=ListenLimits(),
                    name="probe",
                )  # fmt: skip
            await self.elector.step()  # one attempt before the first reconcile: status writes
            async with asyncio.TaskGroup() as tg:
                tasks = [
                    tg.create_task(self.elector.run()),
                    tg.create_task(self.source.run()),
                    tg.create_task(self.namespace_watcher.run()),
                    tg.create_task(self._worker()),
                    tg.create_task(self._resync(stop)),
                    tg.create_task(self._after_sync()),
                ]
                if webhook_ctx is not None and s.webhook_cert is None:
                    tasks.append(tg.create_task(self._rotate_webhook_cert(webhook_ctx, stop)))
                await stop.wait()
                was_leader = self.elector.is_leader
                for t in tasks:
                    t.cancel()
            if was_leader:
                await self._release_lease()
        finally:
            for runner in runners:
                await runner.cleanup()

    async def _after_sync(self) -> None:
        await self.source.wait_synced()
        await self.namespace_watcher.synced.wait()
        # pods deleted while no replica was watching: forget them
        live = set(self.source.pods)
        for name in sorted(set(self.cp.state.workloads) - live):
            if "/" in name:  # a pod's workload name; local registrations are left alone
                self.cp.unregister(name)
        self.synced.set()

    async def _release_lease(self) -> None:
        """Hand the Lease over at shutdown: the next replica need not wait for it to expire."""
        kube, s = self.kube, self.settings
        try:
            lease = await kube.call(
                kube.coordination.read_namespaced_lease, s.lease_name, s.namespace
            )
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != s.identity:
                return
            lease["spec"] = {**spec, "holderIdentity": None}
            await kube.call(
                kube.coordination.replace_namespaced_lease, s.lease_name, s.namespace, lease
            )
        except KubeError as exc:  # it expires on its own
            log.warning("could not release the lease %s: %s", s.lease_name, exc)


__all__ = [
    "KubeConfigError",
    "KubeMode",
    "KubePublisher",
    "KubeSettings",
    "TokenReviewIdentity",
    "Work",
    "WorkKind",
    "build_work",
    "connect",
    "renewal_wait",
    "should_evict",
]
