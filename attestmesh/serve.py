"""Composition of the control plane: settings -> CA, store, verifiers, policies, servers.

Everything here is wiring; behaviour lives in the packages it composes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import logging
import os
import secrets
import ssl
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import grpclib.server
import yaml
from aiohttp import web
from cryptography import x509
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from attestmesh import secret_release, status_cmd
from attestmesh.controlplane import (
    AttestationLimiter,
    CollateralSource,
    ControlPlane,
    IdentityCheck,
    Publisher,
    RegistrationTokenCheck,
    WorkerProcesses,
)
from attestmesh.controlplane import http as api
from attestmesh.controlplane.secrets import SecretPolicies
from attestmesh.controlplane.service import CRL_VALIDITY
from attestmesh.cp_attest import SelfAttestation
from attestmesh.gcpolicy import GcPolicy, hold_collections, release_collections
from attestmesh.listen import ListenLimits, start_aiohttp, start_grpc, start_h2
from attestmesh.metrics import Metrics
from attestmesh.replication import CrlSigner, PgReplication
from attestmesh.secret_release import SecretReleaseSettings
from attestmesh.tcb_monitor import build_tcb_monitor
from certs.ca import CertificateAuthority, issue_serving_credentials
from certs.collateral.amd_kds import KdsCollateralSource
from certs.collateral.cache import DiskCache, http_fetcher
from certs.collateral.intel_pcs import (
    INTEL_ROOT_CA_CRL_URL,
    PcsCollateralSource,
    http_fetcher_with_headers,
)
from certs.collateral.roots import load_roots
from certs.errors import AttestmeshError, PolicyError
from certs.evidence.claims import Tee
from certs.keystore import open_key_store
from certs.offload import VerifierRecipe, configured_verifiers
from certs.policy import parse_policies
from sidecar.agent import EvidenceSource
from xds import native as xds_native
from xds.adsconn import LeanAds
from xds.cache import SnapshotCache
from xds.meshpolicy import parse_mesh_policies
from xds.pb import install_validator_cache
from xds.publisher import XdsPublisher
from xds.registrations import parse_registrations
from xds.resources import control_plane_spiffe_id as control_plane_spiffe_id
from xds.server import AdsServer, PeerIdentity, warm
from xds.state import MeshState, Registration, Status, Trigger, WorkloadState
from xds.store import GroupCommitStore
from xds.store_pg import Changes, Leadership, follow, is_postgres_url, open_store, share_ca

log = logging.getLogger(__name__)

# A replica on PostgreSQL waits this long at start for the one CRL set (a leader's, stored, or
# its own if it leads) before it serves one it signs itself (a database no leader signed in yet)
CRL_FIRST_WAIT_SECONDS = 5.0


class CountedCrlSigner(CrlSigner):
    """``CrlSigner`` whose counts (signed, followed, refused) are on /metrics."""

    def __init__(self, url: str, *, metrics: Metrics, **kwargs: Any) -> None:
        super().__init__(url, **kwargs)
        self._metrics = metrics
        self._counted = (0, 0, 0)

    def step(self, conn: Any) -> None:
        try:
            super().step(conn)
        finally:
            signed, followed, refused = self.signed, self.followed, self.refused
            was = self._counted
            self._counted = (signed, followed, refused)
            if signed > was[0]:
                self._metrics.crl_signed.labels("leader").inc(signed - was[0])
            if followed > was[1]:
                self._metrics.crl_followed.inc(followed - was[1])
            if refused > was[2]:
                self._metrics.crl_refused.inc(refused - was[2])


@dataclass(frozen=True, slots=True)
class ControlPlaneSettings:
    state_dir: Path
    policy_file: Path | None = None  # local mode; in Kubernetes mode policies come from CRs
    trust_domain: str = "attestmesh.local"
    host: str = "127.0.0.1"
    api_port: int = 8443
    xds_port: int = 18000
    xds_plaintext: bool = False  # only for loopback experiments: xDS is mutual TLS by default
    # the ADS port's HTTP/2: "lean" (xds.adsconn, our own) or "grpclib" (the fallback)
    ads_transport: str = "lean"
    ops_port: int = 9090
    mesh_policy_file: Path | None = None
    registrations_file: Path | None = None
    # A registration without tokenSha256 lets anyone who reaches the API attest (or fail) in its
    # name: refused at start-up unless this says so explicitly.
    allow_unauthenticated_registrations: bool = False
    # per workload: attestations at once, then one more per attest_refill
    attest_burst: int = 8
    attest_refill: timedelta = timedelta(seconds=60)
    # worker processes verifying evidence and signing leaves (0: threads of this process); the
    # command line's default is default_attest_processes()
    attest_processes: int = 0
    sim_platform_keys: tuple[Path, ...] = ()
    roots_dir: Path | None = None
    amd_kds_url: str | None = None
    intel_pcs_url: str | None = None
    intel_root_ca_crl_url: str | None = None
    deadline_check: timedelta = timedelta(seconds=1)
    policy_poll: timedelta = timedelta(seconds=2)
    server_names: tuple[str, ...] = field(default=("localhost",))
    listen: ListenLimits = field(default_factory=ListenLimits)  # every port: timeouts, caps
    # evidence of the control plane's own TEE, bound to its serving key (attestmesh.cp_attest)
    self_attestation: EvidenceSource | None = None
    secrets: SecretReleaseSettings | None = None  # secret release (OpenBao) on its own port
    ca_key_store: str | None = None  # None/"file": keys in state_dir/ca; "pkcs11:...": a token
    # None: SQLite at <state_dir>/state.sqlite3 (one replica); postgresql://...: the shared
    # PostgreSQL store of several replicas (xds.store_pg)
    store: str | None = None


def load_yaml_docs(path: Path) -> list[Any]:
    try:
        # libyaml's safe loader when present (a 10,000-workload file: ~10x faster)
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        return [d for d in yaml.load_all(path.read_text(), Loader=loader) if d is not None]
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyError([f"{path}: {exc}"]) from None


@dataclass(frozen=True, slots=True)
class Hooks:
    """What another deployment mode (Kubernetes) adds; local mode uses none of them.

    ``identity`` replaces the registration-token check; ``wrap_publisher`` wraps the xDS
    publisher (e.g. to act on events); ``run`` is supervised beside the control plane's own
    tasks once its servers are up, and must return when ``stop`` is set."""

    identity: IdentityCheck | None = None
    wrap_publisher: Callable[[XdsPublisher], Publisher] | None = None
    run: Callable[[ControlPlane, asyncio.Event], Coroutine[Any, Any, None]] | None = None
    # secret release in Kubernetes mode: the SecretPolicies its CR watcher keeps current
    secret_policies: SecretPolicies | None = None
    # several replicas on PostgreSQL: may this replica lead (CA rotation, the CRL)? Kubernetes
    # mode: only while it holds the Lease, so one replica does all the leader's work
    leader_eligible: Callable[[], bool] | None = None


SERVER_CERT_TTL = timedelta(hours=24)
# A new CRL reaches at once the nodes that could accept a certificate it revokes (rules that
# admit its identity; callers of its service), and every node patched for any other reason;
# the rest, which deny its identity anyway, get it in one coalesced fan-out this much later:
# at N=10,000 a fan-out costs ~0.5-1 s CPU, so renewals' superseded certificates and a burst
# of quarantines cost at most that once a minute. (A new bundle is never deferred.)
TRUST_FANOUT_DELAY = timedelta(seconds=60)


def _load_server_cert(
    contexts: Sequence[ssl.SSLContext],
    ca: CertificateAuthority,
    settings: ControlPlaneSettings,
    now: datetime,
) -> None:
    """Issue the control plane's serving certificate (attestation API and xDS) from the mesh CA
    and load it into every context; new handshakes use it."""
    cert_path, key_path = issue_serving_credentials(
        ca,
        settings.state_dir / "tls",
        "server",
        spiffe_id=control_plane_spiffe_id(settings.trust_domain),
        dns_names=settings.server_names,
        ips=("127.0.0.1",),
        now=now,
        ttl=SERVER_CERT_TTL,
    )
    for ctx in contexts:
        ctx.load_cert_chain(cert_path, key_path)


def _api_tls() -> ssl.SSLContext:
    """The attestation API: server-authenticated TLS (agents prove themselves with evidence
    and their identity token, not with a certificate they do not have yet)."""
    return ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)


def api_limits(limits: ListenLimits) -> ListenLimits:
    """The attestation API: agents connect briefly (challenge, attest, renew); a few thousand
    concurrent connections cover a mesh of tens of thousands renewing every half hour."""
    return replace(limits, max_connections=min(limits.max_connections, 4_096))


def ops_limits(limits: ListenLimits) -> ListenLimits:
    """The ops port is on loopback: probes, metrics scrapes and the operator's CLI."""
    return replace(limits, max_connections=64, max_connections_per_source=64)


def _xds_tls(ca: CertificateAuthority) -> ssl.SSLContext:
    """xDS: mutual TLS. Envoys present their mesh certificate; the node they ask for must be
    the one their certificate names (see ``authorize_node``). Under the root, the store holds
    the CA's live intermediates (see :class:`XdsTrust`): a sidecar presents its leaf alone
    (``workload-leaf-cert``), and the connection keeps one certificate less for its life; a
    full chain is accepted as well. Revocation is not checked here but on every push
    (``node_may_fetch``: the certificate's serial must be one of the workload's live ones)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca.bundle_pem.decode())
    XdsTrust(ctx).refresh(ca)
    # the chain may end at a trusted intermediate: one signature verified per handshake, not
    # two (~0.09 of ~0.87 ms of server CPU, measured). OpenSSL still checks that anchor's
    # validity: an expired intermediate left in the store vouches for nothing.
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    # ADS streams are long-lived: resumption tickets buy nothing and cost ~0.3 ms per stream.
    # num_tickets covers TLS 1.3; OP_NO_TICKET covers TLS 1.2, what Envoy's upstream TLS
    # negotiates by default (its maximum; it asks for a ticket): ~0.25 ms of server CPU per
    # handshake, measured in process. No session is cached in its place (none is kept).
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_TICKET
    # no TLS 1.2 renegotiation (OpenSSL 3 refuses client-initiated already; Envoy's client
    # default maximum is TLS 1.2, so the minimum stays there)
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    return ctx


class XdsTrust:
    """The live intermediates in the ADS context's trust store, refreshed on the deadline tick
    right after the CA may have rotated (``refresh``: a no-op while the CA value is the same).
    A prepared intermediate enters the store at 1/2 of the signing one's life, long before it
    signs the first leaf (at 2/3); on the leader a catch-up that prepares and activates at once
    is loaded in the same synchronous tick, before any leaf is issued. OpenSSL's store only
    grows: a retired intermediate stays (a handful over years), harmless since every leaf it
    signed has expired or it has itself."""

    __slots__ = ("_ca", "_ctx")

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self._ctx = ctx
        self._ca: CertificateAuthority | None = None

    def refresh(self, ca: CertificateAuthority) -> None:
        if ca is self._ca:
            return
        # a certificate already in the store is skipped by OpenSSL
        self._ctx.load_verify_locations(cadata=b"".join(i.pem for i in ca.issuers).decode())
        self._ca = ca


def node_may_fetch(state: MeshState, node: str, peer: PeerIdentity) -> bool:
    """An Envoy may fetch only its own workload's configuration, with a certificate issued to
    that very workload and still live: not a sibling's of the same service account, not one
    revoked by a quarantine, superseded or withdrawn (the workload's live serials are the
    CRL's complement for its own certificates)."""
    w = state.workloads.get(node)
    if w is None or w.status is not Status.ATTESTED:
        return False
    if w.registration.spiffe_id(state.trust_domain) not in peer.uris:
        return False
    return any(c.serial == peer.serial for c in w.certificates)


class NodeAuthorizer:
    """``authorize(node, peer)``: :func:`node_may_fetch` against the control plane's current
    state, asked on every push. The answer is a pure function of the node's workload record
    (immutable: any change of status, certificates or registration makes a new one), the
    trust domain and the peer, so the last answer per node is kept with the record it was
    decided on and given again only while the node's record is that very object: within one
    state (a fan-out) it costs an identity check; after the state changed, a lookup of the
    node's record; a changed record (a quarantine, a renewal, a release) is decided afresh on
    the next push. Bounded: entries are made only for nodes that exist, and cleared when they
    outnumber the mesh; no old state is kept (only the current one, and per node its record
    as last decided).

    As a state listener (:meth:`changed`), it is told which records a transition changed:
    their answers are forgotten and the others stay confirmed for the new state, so the
    pushes of the fan-out after it (a quarantine wakes 5,000 callers) cost an identity check
    each, not a look-up of their records. A state it was not told about (the control plane
    changes revocations alone without announcing them) is met as before: a look-up per node."""

    __slots__ = ("_cp", "_epoch", "_memo", "_state")

    def __init__(self, cp: ControlPlane) -> None:
        self._cp = cp
        self._state: MeshState | None = None  # the state the current epoch's checks read
        self._epoch = 0
        # node -> (epoch it was last confirmed in, record, trust domain, peer, answer)
        self._memo: dict[str, tuple[int, WorkloadState, str, PeerIdentity, bool]] = {}

    def __call__(self, node: str, peer: PeerIdentity) -> bool:
        state = self._cp.state
        if state is not self._state:
            self._state = state
            self._epoch += 1
        epoch, memo = self._epoch, self._memo
        hit = memo.get(node)
        if hit is not None and hit[3] is peer:
            if hit[0] == epoch:
                return hit[4]
            w = state.workloads.get(node)
            if w is not None and hit[1] is w and hit[2] == state.trust_domain:
                memo[node] = (epoch, w, hit[2], peer, hit[4])
                return hit[4]
        else:
            w = state.workloads.get(node)
        if w is None:
            memo.pop(node, None)
            return False
        ok = node_may_fetch(state, node, peer)
        if len(memo) > 2 * len(state.workloads) + 1024:
            memo.clear()  # nodes that left
        memo[node] = (epoch, w, state.trust_domain, peer, ok)
        return ok

    def changed(self, state: MeshState, names: Collection[str]) -> None:
        """A transition to ``state`` changed the records of ``names`` (the control plane's
        state listener: every change of a workload record is announced so). From the state
        the current answers were confirmed in, only records change between announcements
        that ``names`` list (revocations alone are not announced, and no answer depends on
        them), so the other answers hold for ``state`` as they are."""
        if self._state is None or self._state.trust_domain != state.trust_domain:
            return  # nothing confirmed yet, or everything changes: met on the next push
        memo = self._memo
        for name in names:
            memo.pop(name, None)
        self._state = state


def authorize_node(cp: ControlPlane) -> Callable[[str, PeerIdentity], bool]:
    authorizer = NodeAuthorizer(cp)
    cp.add_state_listener(authorizer.changed)
    return authorizer


async def _rotate_server_cert(
    contexts: Sequence[ssl.SSLContext],
    current_ca: Callable[[], CertificateAuthority],
    settings: ControlPlaneSettings,
    stop: asyncio.Event,
) -> None:
    """Re-issue the serving certificate at half its lifetime from the CA's current signing
    intermediate (it rotates); new handshakes use it. A failure is logged and retried."""
    wait = SERVER_CERT_TTL / 2
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait.total_seconds())
        if stop.is_set():
            return
        try:
            _load_server_cert(contexts, current_ca(), settings, datetime.now(UTC))
            wait = SERVER_CERT_TTL / 2
        except (AttestmeshError, OSError, ssl.SSLError) as exc:
            log.error("could not renew the control plane's serving certificate: %s", exc)
            wait = timedelta(minutes=1)


def default_attest_processes(cpus: float | None = None) -> int:
    """One worker process per core this process may use but the one the event loop needs, at
    most 4 (the control plane's process still parses, answers and persists every attestation);
    none on one core."""
    return max(0, min(4, int(available_cpus() if cpus is None else cpus) - 1))


def available_cpus(cgroup: Path = Path("/sys/fs/cgroup")) -> float:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's limit; ``os.cpu_count`` sees the whole node)."""
    cores = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    try:
        return max(1.0, min(cores, int(quota) / int(period)))
    except (ValueError, ZeroDivisionError):
        return cores


def build_collateral_sources(
    settings: ControlPlaneSettings, session: aiohttp.ClientSession
) -> dict[Tee, CollateralSource]:
    """Online vendor collateral (AMD KDS, Intel PCS) through an on-disk cache, when configured."""
    cache = DiskCache(settings.state_dir / "collateral")
    sources: dict[Tee, CollateralSource] = {}
    if settings.amd_kds_url:
        sources[Tee.SEV_SNP] = KdsCollateralSource(
            settings.amd_kds_url, cache, http_fetcher(session)
        )
    if settings.intel_pcs_url:
        pcs = PcsCollateralSource(
            settings.intel_pcs_url,
            cache,
            http_fetcher_with_headers(session),
            root_ca_crl_url=settings.intel_root_ca_crl_url or INTEL_ROOT_CA_CRL_URL,
        )
        sources[Tee.TDX] = pcs
        sources[Tee.SGX] = pcs
    return sources


def build_control_plane(
    settings: ControlPlaneSettings,
    metrics: Metrics,
    cache: SnapshotCache,
    collateral_sources: Mapping[Tee, CollateralSource] | None = None,
    hooks: Hooks | None = None,
) -> tuple[ControlPlane, XdsPublisher, GroupCommitStore]:
    hooks = hooks or Hooks()
    # Everything that can be refused is read before any state is opened.
    policies = parse_policies(load_yaml_docs(settings.policy_file)) if settings.policy_file else ()
    mesh_policies = (
        parse_mesh_policies(load_yaml_docs(settings.mesh_policy_file))
        if settings.mesh_policy_file
        else ()
    )
    registrations: tuple[Registration, ...] = ()
    if settings.registrations_file:
        docs = load_yaml_docs(settings.registrations_file)
        registrations = parse_registrations(docs[0] if docs else {})
        tokenless = [reg.name for reg in registrations if reg.token_sha256 is None]
        if tokenless and not settings.allow_unauthenticated_registrations:
            raise PolicyError(
                [
                    f"{settings.registrations_file}: registration {name} has no tokenSha256 "
                    "(anyone who reaches the API could attest, or fail an attestation, in its "
                    "name); give it a join token or pass --allow-unauthenticated-registrations"
                    for name in tokenless
                ]
            )
        for name in tokenless:
            log.warning(
                "registration %s has no tokenSha256 (allowed by "
                "--allow-unauthenticated-registrations): anyone who reaches the API can attest "
                "(or fail an attestation) in its name",
                name,
            )
    # SEV-SNP / TDX evidence may carry attached NVIDIA GPU reports (certs.evidence.composite);
    # worker processes build the same verifiers from the same recipe
    recipe = VerifierRecipe(
        configured_verifiers,
        (settings.roots_dir, tuple(p.read_bytes() for p in settings.sim_platform_keys)),
    )
    verifiers = recipe.build(*recipe.args)
    processes = (
        WorkerProcesses(settings.attest_processes, recipe) if settings.attest_processes else None
    )
    now = datetime.now(UTC)

    def load_ca() -> CertificateAuthority:
        return CertificateAuthority.load_or_create(
            settings.state_dir / "ca",
            settings.trust_domain,
            datetime.now(UTC),
            key_store=open_key_store(settings.ca_key_store),
        )

    if settings.store and is_postgres_url(settings.store):  # one CA for every replica
        share_ca(settings.store, settings.state_dir / "ca", load_ca)
    ca = CertificateAuthority.load_or_create(
        settings.state_dir / "ca",
        settings.trust_domain,
        now,
        key_store=open_key_store(settings.ca_key_store),
    )
    # Group commit: one writer thread, one fsync for every transition waiting for it; the loop
    # never waits on the disk (a transition is announced, and answered, once durable).
    store = open_store(settings.store or settings.state_dir / "state.sqlite3")
    loop = asyncio.get_running_loop()
    adopt: list[Callable[[Changes], None]] = []
    # PostgreSQL (several replicas): what the others commit reaches this one's view and xDS
    state, feed = follow(
        store, settings.trust_domain, lambda ch: loop.call_soon_threadsafe(adopt[0], ch)
    )
    replication = None
    crl: CrlSigner | None = None
    made: list[ControlPlane] = []
    if feed is not None and settings.store is not None:  # one leader (CA rotation), one CA
        replication = PgReplication(
            settings.store, settings.state_dir / "ca", feed, load_ca,
            leadership=Leadership(settings.store, eligible=hooks.leader_eligible),
        )  # fmt: skip
        replication.start()  # the election first: the CRL signer signs only while leading

        def deliver_crl(pem: bytes) -> None:  # on the loop, once the control plane exists
            if made:
                made[0].crl_delivered(pem)

        # one CRL set for every replica, signed by the leader (issue 9: CRL refresh done once)
        crl = CountedCrlSigner(
            settings.store,
            metrics=metrics,
            origin=replication.origin,
            leadership=replication.leadership,
            ca=lambda: made[0].ca if made else ca,
            deliver=lambda pem: loop.call_soon_threadsafe(deliver_crl, pem),
            clock=lambda: datetime.now(UTC),
            validity=CRL_VALIDITY,
        ).start()
        # Blocks the start (nothing is served yet): a replica joining a running mesh serves
        # the stored set at once and never signs; on a database no leader signed in yet it
        # signs its own until the first set is stored (then it serves that one).
        if not crl.wait_first(CRL_FIRST_WAIT_SECONDS):
            log.warning(
                "no shared CRL set within %.0f s: serving this replica's own until the leader "
                "stores one",
                CRL_FIRST_WAIT_SECONDS,
            )
    publisher = XdsPublisher(
        cache, defer=lambda fanout: loop.call_later(TRUST_FANOUT_DELAY.total_seconds(), fanout)
    )
    cp = ControlPlane(
        state=state,
        store=store,
        ca=ca,
        verifiers=verifiers,
        policies=policies,
        mesh_policies=mesh_policies,
        metrics=metrics,
        publisher=hooks.wrap_publisher(publisher) if hooks.wrap_publisher else publisher,
        identity=hooks.identity
        or RegistrationTokenCheck(allow_tokenless=settings.allow_unauthenticated_registrations),
        clock=lambda: datetime.now(UTC),
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
        collateral_sources=collateral_sources,
        limiter=AttestationLimiter(settings.attest_burst, settings.attest_refill),
        replication=replication,
        crl_source=crl,
        processes=processes,
    )
    adopt.append(cp.adopt_changes)
    made.append(cp)
    if feed is not None and replication is not None:
        store.attach(feed)  # closed with the store (in this order)
        if crl is not None:
            store.attach(crl)
        store.attach(replication)
        feed.start()
    cp.register(registrations)  # persists what changed (awaited before serving: cp.flushed)
    return cp, publisher, store


OPS_TOKEN_FILE = "ops-token"  # noqa: S105 (a file name, not a secret)
OPEN_OPS_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})  # read-only, for probes
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def ops_token_path(state_dir: Path) -> Path:
    return state_dir / OPS_TOKEN_FILE


def _read_ops_token(path: Path) -> str:
    """The token in ``path``; FileNotFoundError if there is none; refused if others may read
    it or it is not a token."""
    mode = path.stat().st_mode
    if mode & 0o077:
        raise AttestmeshError(
            "ops_token_insecure",
            f"{path} is readable by others (mode {mode & 0o777:o}); chmod 600 it, or delete it "
            "to have a new one made",
        )
    token = path.read_text(encoding="ascii", errors="replace").strip()
    if len(token) < 32 or not token.isascii() or not token.isprintable() or " " in token:
        raise AttestmeshError("ops_token_invalid", f"{path} does not hold an ops token")
    return token


def ensure_ops_token(state_dir: Path, random: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """The ops API's bearer token, ``<state_dir>/ops-token``: made once (32 random bytes,
    base64url; mode 0600; written to a private temporary file and hard-linked into place, so
    it appears whole or not at all and never replaces an existing one), reused across
    restarts. The ``attestmesh quarantine`` CLI reads it from the same place."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = ops_token_path(state_dir)
    try:
        return _read_ops_token(path)
    except FileNotFoundError:
        pass
    token = base64.urlsafe_b64encode(random(32)).rstrip(b"=").decode()
    tmp = state_dir / f".{OPS_TOKEN_FILE}.{os.getpid()}.{random(8).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it meanwhile: theirs holds
            return _read_ops_token(path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return token


def _ops_refusal(status: int, error: str, detail: str, **headers: str) -> web.Response:
    return web.json_response({"error": error, "detail": detail}, status=status, headers=headers)


def ops_guard(token: str) -> Any:
    """aiohttp middleware: every path but /metrics, /healthz and /readyz needs
    ``Authorization: Bearer <token>`` (compared in constant time), a loopback Host, no Origin
    header (no browser, so no cross-site request), and JSON for a request body."""
    expected = token.encode()

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Coroutine[Any, Any, Any]]
    ) -> Any:
        if request.path in OPEN_OPS_PATHS:
            return await handler(request)
        if "Origin" in request.headers:
            return _ops_refusal(
                403, "origin_refused", "the ops API answers no browser (cross-site) requests"
            )
        if request.url.host not in _LOOPBACK_HOSTS:
            return _ops_refusal(403, "host_refused", "the ops API answers loopback names only")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(errors="replace"), expected
        ):
            return _ops_refusal(
                401,
                "unauthenticated",
                f"send Authorization: Bearer <the token in the control plane's "
                f"<state-dir>/{OPS_TOKEN_FILE}>",
                **{"WWW-Authenticate": "Bearer"},
            )
        if request.body_exists and request.content_type != "application/json":
            return _ops_refusal(
                415, "unsupported_media_type", "a request body must be application/json"
            )
        return await handler(request)

    return guard


ProbeVerdict = tuple[int, dict[str, object]]
PROBE_OK: ProbeVerdict = (200, {"status": "ok"})


def liveness_of(cp: ControlPlane) -> ProbeVerdict:
    """/healthz: a failed store write makes the process unhealthy (restart to load what is
    durable)."""
    if not cp.healthy:
        return 503, {"status": "store_failed"}
    return PROBE_OK


def readiness_of(cp: ControlPlane) -> ProbeVerdict:
    """/readyz: healthy, and (several replicas) not cut off from the database."""
    if not cp.healthy:
        return 503, {"status": "store_failed"}
    if not cp.ready:  # several replicas: cut off from the database, issuing nothing
        return 503, {"status": "store_unreachable"}
    return PROBE_OK


def add_probe_routes(
    app: web.Application,
    registry: CollectorRegistry,
    liveness: Callable[[], ProbeVerdict],
    readiness: Callable[[], ProbeVerdict],
) -> None:
    """/metrics, /healthz and /readyz, the same on the ops port and Kubernetes' probe port."""

    async def metrics_handler(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def verdict(of: Callable[[], ProbeVerdict]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            status, body = of()
            return web.json_response(body, status=status)

        return handler

    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/healthz", verdict(liveness))
    app.router.add_get("/readyz", verdict(readiness))


def build_ops_app(cp: ControlPlane, metrics: Metrics, token: str) -> web.Application:
    """Loopback-only operations endpoint: metrics, health (open), quarantine administration
    (``ops_guard``: bearer ``token``, no browser requests, JSON bodies)."""

    def workload_json(name: str) -> dict[str, Any]:
        w = cp.state.get(name)
        q = w.quarantine
        return {
            "name": name,
            "spiffe_id": w.registration.spiffe_id(cp.state.trust_domain),
            "status": w.status.value,
            "quarantine": None
            if q is None
            else {"trigger": q.trigger.value, "reason": q.reason, "at": q.at.isoformat()},
            "next_attestation_due": w.next_attestation_due.isoformat()
            if w.next_attestation_due
            else None,
        }

    async def workloads(request: web.Request) -> web.Response:
        only = request.query.get("status")
        items = [workload_json(n) for n in sorted(cp.state.workloads)]
        return web.json_response([i for i in items if only is None or i["status"] == only])

    def known(name: str) -> None:
        if name not in cp.state.workloads:
            raise web.HTTPNotFound(
                text=f'{{"error": "unknown_identity", "detail": "no workload {name}"}}',
                content_type="application/json",
            )

    async def quarantine(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        known(name)
        body: Any = {}
        if request.body_exists:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError, RecursionError):
                return _ops_refusal(400, "request_malformed", "body is not JSON")
        reason = str(body.get("reason", "operator command")) if isinstance(body, dict) else ""
        changed = cp.quarantine(name, Trigger.OPERATOR, reason or "operator command")
        await cp.flushed()  # answered once durable
        return web.json_response({"changed": changed, **workload_json(name)})

    async def release(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        known(name)
        changed = cp.release(name)
        await cp.flushed()
        return web.json_response({"changed": changed, **workload_json(name)})

    async def events(request: web.Request) -> web.Response:
        return web.json_response(
            [
                {
                    "at": e.at.isoformat(),
                    "kind": e.kind.value,
                    "workload": e.workload,
                    "trigger": e.trigger.value if e.trigger else None,
                    "reason": e.reason,
                }
                for e in cp.events(request.query.get("workload"))
            ]
        )

    app = web.Application(middlewares=[ops_guard(token)], client_max_size=64 * 1024)
    add_probe_routes(app, metrics.registry, lambda: liveness_of(cp), lambda: readiness_of(cp))
    app.router.add_get("/v1/admin/workloads", workloads)
    app.router.add_post("/v1/admin/workloads/{name}/quarantine", quarantine)
    app.router.add_post("/v1/admin/workloads/{name}/release", release)
    app.router.add_get("/v1/admin/events", events)
    return app


async def _policy_watch(
    cp: ControlPlane, settings: ControlPlaneSettings, stop: asyncio.Event
) -> None:
    path = settings.policy_file
    if path is None:
        return
    last = path.stat().st_mtime_ns
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.policy_poll.total_seconds())
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            continue
        if mtime == last:
            continue
        last = mtime
        try:
            cp.set_policies(load_yaml_docs(path))
            log.info("reloaded attestation policy from %s", path)
        except PolicyError as exc:
            log.error(
                "refused invalid policy %s; previous policy stays:\n  %s",
                path,
                "\n  ".join(exc.problems),
            )


async def _deadlines(
    cp: ControlPlane,
    settings: ControlPlaneSettings,
    stop: asyncio.Event,
    xds_trust: XdsTrust | None = None,
) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), settings.deadline_check.total_seconds())
        cp.check_deadlines()
        if xds_trust is not None:  # the CA may have rotated (here, or a follower's reload)
            try:
                xds_trust.refresh(cp.ca)
            except ssl.SSLError as exc:
                log.error("could not load the CA's intermediates into the ADS context: %s", exc)
        await cp.recover_store()  # several replicas: after a failed write, once it is back


@dataclass
class Running:
    cp: ControlPlane
    publisher: XdsPublisher
    metrics: Metrics
    bundle_pem: bytes


def _start_processes(cp: ControlPlane, metrics: Metrics) -> None:
    """Warm the attestation worker processes up, in the background (until they answer,
    attestations verify and sign on threads); none when the CA's key store cannot be opened
    in another process."""
    procs = cp.processes
    if procs is None:
        return
    if cp.ca.signing_material() is None:
        log.info("the CA's key store opens in this process only: attestations sign here")
        return
    metrics.attest_worker_processes.set_function(lambda: procs.count if procs.ready else 0)
    procs.start()


async def run_control_plane(
    settings: ControlPlaneSettings,
    stop: asyncio.Event,
    ready: asyncio.Future[Running] | None = None,
    metrics: Metrics | None = None,
    hooks: Hooks | None = None,
) -> None:
    """Run until ``stop`` is set: attestation API (HTTPS), ADS (gRPC), ops (HTTP, loopback),
    and whatever ``hooks.run`` adds (Kubernetes mode). Start-up runs with automatic cycle
    collection held (``gcpolicy.hold_collections``): what it builds lives on, and the
    collections it triggered scanned it all again and again (8 full ones, ~1.7 s of ~10 s at
    N=10,000); ``GcPolicy.start`` freezes what is alive once serving and ends the hold."""
    hold_collections()
    try:
        await _run_control_plane(settings, stop, ready, metrics, hooks)
    finally:
        release_collections()  # (start-up failed before GcPolicy started: collect again)


async def _run_control_plane(
    settings: ControlPlaneSettings,
    stop: asyncio.Event,
    ready: asyncio.Future[Running] | None,
    metrics: Metrics | None,
    hooks: Hooks | None,
) -> None:
    metrics = metrics or Metrics()
    install_validator_cache()  # see xds/pb.py: one pydantic validator per class
    warm()
    cache = SnapshotCache()
    async with aiohttp.ClientSession() as session:
        secret_policies = None
        if settings.secrets is not None:  # refused before any state is opened
            settings.secrets.check()
            if hooks is not None and hooks.secret_policies is not None:
                secret_policies = hooks.secret_policies  # SecretPolicy CRs (Kubernetes mode)
            elif settings.secrets.policy_file is not None:
                secret_policies = secret_release.load_secret_policies(settings.secrets.policy_file)
            else:
                raise AttestmeshError("usage", "secret release needs --secret-policy")
        sources = build_collateral_sources(settings, session)
        cp, publisher, store = build_control_plane(settings, metrics, cache, sources, hooks)
        # continuous TCB re-evaluation over the online collateral (none: nothing to watch)
        tcb = build_tcb_monitor(
            cp, metrics, sources, load_roots(settings.roots_dir), lambda: datetime.now(UTC)
        )
        await cp.flushed()  # the registrations file is durable before anything is served
        tls = _api_tls()
        xds_tls = None if settings.xds_plaintext else _xds_tls(cp.ca)
        xds_trust = None if xds_tls is None else XdsTrust(xds_tls)
        contexts = [tls] if xds_tls is None else [tls, xds_tls]
        _load_server_cert(contexts, cp.ca, settings, datetime.now(UTC))
        api_app = api.build_app(cp, metrics)
        if settings.self_attestation is not None:  # the control plane runs in a TEE
            tls_chain = settings.state_dir / "tls" / "server.pem"
            SelfAttestation(
                settings.self_attestation, tls_chain.read_bytes, lambda: cp.ca.bundle_pem
            ).route(api_app)
        api_runner = web.AppRunner(api_app, access_log=None)
        ops_app = build_ops_app(cp, metrics, ensure_ops_token(settings.state_dir))
        status_cmd.add_route(ops_app, lambda: cp.state, cache, lambda: datetime.now(UTC))
        ops_runner = web.AppRunner(ops_app, access_log=None)
        authorize = None if xds_tls is None else authorize_node(cp)
        ads = AdsServer(cache, metrics, authorize=authorize)
        grpc: LeanAds | grpclib.server.Server = (
            grpclib.server.Server([ads]) if settings.ads_transport == "grpclib" else LeanAds(ads)
        )
        secret_runners: list[web.AppRunner] = []
        try:
            await api_runner.setup()
            await ops_runner.setup()
            lim = settings.listen
            refused = metrics.listener_closed.labels

            def on_refused(listener: str, reason: str) -> None:
                refused(listener, reason).inc()

            await start_aiohttp(
                api_runner, settings.host, settings.api_port, ssl=tls, limits=api_limits(lim),
                name="api", on_refused=on_refused,
            )  # fmt: skip
            await start_aiohttp(
                ops_runner, "127.0.0.1", settings.ops_port, ssl=None, limits=ops_limits(lim),
                name="ops", on_refused=on_refused,
            )  # fmt: skip
            if isinstance(grpc, LeanAds):
                await start_h2(
                    grpc, settings.host, settings.xds_port, ssl=xds_tls, limits=lim, name="xds",
                    on_refused=on_refused,
                )  # fmt: skip
            else:
                await start_grpc(
                    grpc, settings.host, settings.xds_port, ssl=xds_tls, limits=lim, name="xds",
                    on_refused=on_refused,
                )  # fmt: skip
            if settings.secrets is not None and secret_policies is not None:
                secret_tls = secret_release.secrets_tls(cp.ca.bundle_pem)
                contexts.append(secret_tls)
                _load_server_cert([secret_tls], cp.ca, settings, datetime.now(UTC))
                kbs_tls = _api_tls() if settings.secrets.kbs_port is not None else None
                if kbs_tls is not None:  # server TLS: a KBS client has no mesh certificate
                    contexts.append(kbs_tls)
                    _load_server_cert([kbs_tls], cp.ca, settings, datetime.now(UTC))
                secret_runners = await secret_release.start(
                    settings.secrets, cp, secret_policies, metrics, session, secret_tls,
                    settings.host, lim, on_refused, kbs_tls,
                )  # fmt: skip
            log.info(
                "control plane up: api https://%s:%d xds %s:%d ops http://127.0.0.1:%d; "
                "ADS hot path: %s",
                settings.host,
                settings.api_port,
                settings.host,
                settings.xds_port,
                settings.ops_port,
                xds_native.mode,
            )
            _start_processes(cp, metrics)
            if ready is not None:
                ready.set_result(Running(cp, publisher, metrics, cp.ca.bundle_pem))
            async with asyncio.TaskGroup() as tg:
                # long-lived objects out of the cycle collector's scans (attestmesh/gcpolicy.py)
                tg.create_task(GcPolicy().run(stop))
                tg.create_task(_deadlines(cp, settings, stop, xds_trust))
                tg.create_task(_rotate_server_cert(contexts, lambda: cp.ca, settings, stop))
                tg.create_task(_policy_watch(cp, settings, stop))
                if tcb is not None:
                    tg.create_task(tcb.run(stop))
                if secret_policies is not None and settings.secrets is not None:
                    tg.create_task(
                        secret_release.watch(settings.secrets, secret_policies, metrics, stop)
                    )
                if hooks is not None and hooks.run is not None:
                    tg.create_task(hooks.run(cp, stop))
        except AttestmeshError as exc:
            if ready is not None and not ready.done():
                ready.set_exception(exc)
            raise
        finally:
            if cp.processes is not None:
                await cp.processes.aclose()
            grpc.close()
            await grpc.wait_closed()
            await api_runner.cleanup()
            await ops_runner.cleanup()
            for runner in secret_runners:
                await runner.cleanup()
            store.close()
