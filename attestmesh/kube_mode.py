"""Kubernetes mode: the control plane fed by the cluster and acting on it.

Wiring only: this module builds the parts and starts their tasks; the behaviour lives in the
Kubernetes adapter ``xds.kube`` (its ``__init__`` lists the modules), ``sidecar.inject`` and the
control plane. What it wires:

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
  labels, conditions, Events, evictions and node taints (``xds.kube.actions``), performed in
  order by one worker (``xds.kube.work``). Those events are the deciding replica's; on
  PostgreSQL a follower's decisions reach the leader as adopted rows, and the leader queues
  the same work for a workload whose row became, or stopped being, quarantined
  (``adopted_work``), so what any replica decides is written once, by the leader. On winning
  the election, and every ``resync``, the quarantines in the persisted state are re-applied
  (idempotent) and pods still labelled quarantined whose workload no longer is are released,
  so actions survive a restart, a failed call or a transition decided while no replica led.
- The sidecar-injection webhook is served in the same process, its serving certificate issued
  from the mesh CA (or given), and its CA bundle written into the MutatingWebhookConfiguration
  (``xds.kube.webhook``); an issued certificate is re-issued at half its lifetime, a failure
  retried with backoff.
- Trust bundle: the leader keeps the ConfigMap ``attestmesh-trust-bundle`` (key ``root.pem``,
  the mesh root bundle the API serves) in every namespace labelled ``attestmesh.dev/inject=
  enabled`` and every namespace where a pod carrying the injected annotation was seen (seen
  before it is registered: an injected pod cannot start until the ConfigMap exists). Injected
  agents verify the attestation API with it, injected Envoys the xDS server. Written when a
  namespace first needs it and re-checked on every re-apply (drift, a changed bundle, a
  deleted ConfigMap); never deleted (public data, and pods may still mount it)
  (``xds.kube.trustbundle``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from aiohttp import web

from attestmesh.controlplane import ControlPlane, Publisher
from attestmesh.controlplane.secrets import SecretPolicies
from attestmesh.listen import ListenLimits, start_aiohttp
from attestmesh.metrics import Metrics
from attestmesh.serve import (
    PROBE_OK,
    Hooks,
    ProbeVerdict,
    add_probe_routes,
    liveness_of,
    readiness_of,
)
from certs.ca import CertificateAuthority, issue_serving_credentials
from certs.errors import PolicyError
from certs.policy import AttestationPolicy
from sidecar.inject import InjectConfig, NamespaceLabels, build_app, webhook_counter
from xds.kube import (
    ActionQueue,
    KubeActions,
    KubeClient,
    KubeConfigError,
    KubeMetrics,
    KubePublisher,
    KubeSource,
    LeaderElector,
    ServingCertRotator,
    SourceCallbacks,
    TokenReviewer,
    TokenReviewIdentity,
    TrustBundles,
    Watcher,
    WatchSpec,
    WebhookConfiguration,
    Work,
    WorkKind,
    WorkPerformer,
    build_work,
    connect,
    departed,
    is_recreated,
    parse_namespace,
    renewal_wait,
    should_evict,
)
from xds.kube.names import LABEL_INJECT, LABEL_QUARANTINED, TOKEN_AUDIENCE
from xds.kube.work import adopted_work
from xds.meshpolicy import MeshPolicy
from xds.publisher import XdsPublisher
from xds.secretpolicy import SecretPolicy
from xds.state import MeshState, Registration

log = logging.getLogger(__name__)

WEBHOOK_CERT_TTL = timedelta(hours=24)


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


def _issue_webhook_tls(
    ca: CertificateAuthority,
    spiffe_id: str,
    dns_names: Sequence[str],
    now: datetime,
    directory: Path,
    ttl: timedelta = WEBHOOK_CERT_TTL,
) -> tuple[Path, Path]:
    """The webhook's serving certificate from the mesh CA (a module attribute: tests make it
    fail)."""
    return issue_serving_credentials(
        ca, directory, "webhook", spiffe_id=spiffe_id, dns_names=dns_names,
        ips=("127.0.0.1",), now=now, ttl=ttl,
    )  # fmt: skip


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
        self._cp: ControlPlane | None = None
        self.synced = asyncio.Event()
        self.webhook_url: str | None = None
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
            is_leader=self._is_leader,
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
            is_leader=self._is_leader,
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
        self.trust = TrustBundles(kube, self.trust_bundle, own_namespace=settings.namespace)
        self.webhook_config = (
            None
            if settings.webhook_configuration is None
            else WebhookConfiguration(kube, settings.webhook_configuration)
        )
        self.queue = ActionQueue(
            WorkPerformer(
                self.actions,
                self.trust,
                is_leader=self._is_leader,
                synced=self.synced,
                state=lambda: self.cp.state,
                policies=lambda: self.policies,
                retry=lambda: self.queue.retry(),
                webhook=self.webhook_config,
                labelled=self._labelled_pods,
            ),
            is_leader=self._is_leader,
            resync=settings.resync,
        )
        # what the worker did lately, in order (ops and tests read it); bounded
        self.completed = self.queue.completed

    def _is_leader(self) -> bool:
        return self.elector.is_leader

    def _labelled_pods(self) -> list[str]:
        """The watched pods carrying the quarantine label (the re-apply releases those whose
        workload is no longer quarantined)."""
        return [n for n, reg in self.source.pods.items() if reg.labels.get(LABEL_QUARANTINED)]

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
            # on PostgreSQL the database's leader lock follows the Lease (read on its thread)
            leader_eligible=self._is_leader,
        )

    def _wrap(self, inner: XdsPublisher) -> Publisher:
        return KubePublisher(inner, self.submit, lambda: self.policies)

    def submit(self, work: Work) -> None:
        self.queue.submit(work)

    @property
    def cp(self) -> ControlPlane:
        if self._cp is None:
            raise RuntimeError("Kubernetes mode is not running")
        return self._cp

    def trust_bundle(self) -> bytes:
        """The mesh root bundle injected pods trust: the one the attestation API serves."""
        return self.cp.ca.bundle_pem

    async def drained(self) -> None:
        """Wait until every transition decided so far was announced (the control plane
        announces once durable) and every action queued was attempted (tests, shutdown)."""
        if self._cp is not None:
            await self._cp.flushed()
            await asyncio.sleep(0)  # the announcement itself is a callback of durability
        await self.queue.join()

    # -- source callbacks -> the control plane ------------------------------------------------

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
        if current is not None and is_recreated(current.registration.pod_uid, reg):
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
        parsed = parse_namespace(etype, obj)
        if parsed is None:
            return
        name, labels = parsed
        self.namespaces.set(name, labels)
        if etype == "DELETED":
            self.trust.forget(name)
        elif labels.get(LABEL_INJECT) == "enabled":
            self._need_trust_bundle(name)

    async def _on_injected_pod(self, namespace: str) -> None:
        self._need_trust_bundle(namespace)

    def _need_trust_bundle(self, namespace: str) -> None:
        if self.trust.need(namespace, can_write=self._is_leader() and self._cp is not None):
            self.submit(Work(WorkKind.TRUST_BUNDLE, namespace=namespace))

    def _on_leader_change(self, leader: bool) -> None:
        if leader:
            self.submit(Work(WorkKind.REAPPLY))

    def _on_adopted(self, before: MeshState, after: MeshState, names: Collection[str]) -> None:
        """Rows another replica decided became this one's view: the deciding replica's events
        queued the work there, but only the leader writes, so the leader does it here. Not
        leading: nothing (the re-apply on winning the election takes over quarantines)."""
        if self._is_leader():
            for work in adopted_work(before, after, names, self.policies):
                self.submit(work)

    # -- webhook TLS --------------------------------------------------------------------------

    def _webhook_tls(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        s = self.settings
        if s.webhook_cert is not None and s.webhook_key is not None:
            ctx.load_cert_chain(s.webhook_cert, s.webhook_key)
            return ctx
        self._load_issued(ctx)
        if self.webhook_config is not None:
            self.webhook_config.bundle = self.cp.ca.bundle_pem
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

    def _webhook_rotator(self, ctx: ssl.SSLContext) -> ServingCertRotator:
        counter = self.metrics.serving_cert_renewals
        return ServingCertRotator(
            lambda: self._load_issued(ctx),
            ttl=self.settings.webhook_cert_ttl,
            retry=self.settings.webhook_cert_retry,
            on_result=lambda result: counter.labels(listener="webhook", result=result).inc(),
        )

    # -- probes -------------------------------------------------------------------------------

    def _probe_app(self) -> web.Application:
        def liveness() -> ProbeVerdict:
            return PROBE_OK if self._cp is None else liveness_of(self._cp)

        def readiness() -> ProbeVerdict:
            # the ops port's verdicts (attestmesh.serve), and synced: the kubelet probes this
            # port, so a replica cut off from its database leaves the Service
            verdict = PROBE_OK if self._cp is None else readiness_of(self._cp)
            if verdict is not PROBE_OK:
                return verdict
            if not self.synced.is_set():
                return 503, {"status": "syncing"}
            return 200, {"status": "ok", "leader": self.elector.is_leader}

        app = web.Application()
        add_probe_routes(app, self.metrics.registry, liveness, readiness)
        return app

    async def run(self, cp: ControlPlane, stop: asyncio.Event) -> None:
        """Watch, elect, act and serve the webhook until ``stop`` is set."""
        self._cp = cp
        cp.add_adoption_listener(self._on_adopted)
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
                    tg.create_task(self.queue.worker()),
                    tg.create_task(self.queue.resync_loop(stop)),
                    tg.create_task(self._after_sync()),
                ]
                if webhook_ctx is not None and s.webhook_cert is None:
                    rotator = self._webhook_rotator(webhook_ctx)
                    tasks.append(tg.create_task(rotator.run(stop)))
                await stop.wait()
                was_leader = self.elector.is_leader
                for t in tasks:
                    t.cancel()
            if was_leader:
                await self.elector.release()
        finally:
            for runner in runners:
                await runner.cleanup()

    async def _after_sync(self) -> None:
        await self.source.wait_synced()
        await self.namespace_watcher.synced.wait()
        # pods deleted while no replica was watching: forget them
        for name in departed(self.cp.state.workloads, self.source.pods):
            self.cp.unregister(name)
        self.synced.set()


# Re-exported for the callers and tests that import them from here (their home is xds.kube).
__all__ = [
    "TOKEN_AUDIENCE",
    "WEBHOOK_CERT_TTL",
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
