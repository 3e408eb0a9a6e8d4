"""Composition of secret release: settings -> OpenBao client, SecretPolicies, mTLS listener.

Wiring only; the decision lives in ``xds.secretpolicy``, the service in
``attestmesh.controlplane.secrets``,
the backend adapter in ``certs.openbao``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from ipaddress import ip_address
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web

from attestmesh.controlplane.secrets import (
    Limiter,
    SecretBackend,
    SecretPolicies,
    SecretService,
    build_secrets_app,
    secrets_tls,
)
from attestmesh.listen import ListenLimits, OnRefused, Site, start_aiohttp
from attestmesh.metrics import Metrics
from certs.errors import AttestmeshError, PolicyError
from certs.openbao import AppRole, Credential, OpenBaoClient, TokenFile
from xds.state import Event, MeshState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SecretReleaseSettings:
    policy_file: Path | None  # None: SecretPolicy CRs (Kubernetes mode)
    openbao_url: str
    port: int = 8444
    token_file: Path | None = None  # exactly one of token_file, approle
    approle: tuple[Path, Path] | None = None  # (role_id file, secret_id file)
    approle_mount: str = "approle"
    openbao_ca: Path | None = None  # PEM bundle for OpenBao's TLS (default: system roots)
    openbao_namespace: str | None = None
    poll: timedelta = timedelta(seconds=2)
    kbs_port: int | None = None  # the KBS resource protocol (CoCo image keys), server TLS

    def check(self) -> None:
        if (self.token_file is None) == (self.approle is None):
            raise AttestmeshError(
                "usage", "secret release needs --openbao-token-file or --openbao-approle-*"
            )
        url = urlsplit(self.openbao_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise AttestmeshError("usage", "--openbao-url must be http(s)://host:port")
        if url.scheme == "http" and not _loopback(url.hostname):
            raise AttestmeshError(
                "usage", "--openbao-url over plain http only on loopback; use https"
            )


def add_arguments(parser: Any) -> None:
    g = parser.add_argument_group(
        "secret release (OpenBao)",
        "release OpenBao KV v2 entries and transit operations to attested workloads, per "
        "SecretPolicy, sealed to their attested certificate key",
    )
    g.add_argument("--secret-policy", type=Path, help="SecretPolicy YAML file (enables release)")
    g.add_argument("--secret-port", type=int, default=8444, help="mutual-TLS port (8444)")
    g.add_argument("--openbao-url", help="OpenBao address, https://host:port")
    g.add_argument("--openbao-token-file", type=Path, help="file holding the control plane's token")
    g.add_argument("--openbao-approle-role-id-file", type=Path, help="AppRole role_id file")
    g.add_argument("--openbao-approle-secret-id-file", type=Path, help="AppRole secret_id file")
    g.add_argument("--openbao-approle-mount", default="approle", help="AppRole auth mount")
    g.add_argument("--openbao-ca", type=Path, help="PEM bundle verifying OpenBao's TLS")
    g.add_argument("--openbao-namespace", help="OpenBao namespace (X-Vault-Namespace)")
    g.add_argument(
        "--kbs-port",
        type=int,
        help="also serve the KBS resource protocol here (CoCo encrypted images: kbsResource)",
    )


def settings_from_args(args: Any) -> SecretReleaseSettings | None:
    """Local mode: on with ``--secret-policy``. Kubernetes mode: on with ``--openbao-url``, the
    policies then come from SecretPolicy resources."""
    kubernetes = bool(getattr(args, "kubernetes", False))
    if args.secret_policy is None and not (kubernetes and args.openbao_url):
        return None
    if args.secret_policy is not None and kubernetes:
        raise AttestmeshError("usage", "in --kubernetes mode SecretPolicies are resources")
    if not args.openbao_url:
        raise AttestmeshError("usage", "--secret-policy needs --openbao-url")
    role, secret = args.openbao_approle_role_id_file, args.openbao_approle_secret_id_file
    if (role is None) != (secret is None):
        raise AttestmeshError("usage", "AppRole needs both role_id and secret_id files")
    s = SecretReleaseSettings(
        policy_file=args.secret_policy,
        openbao_url=args.openbao_url,
        port=args.secret_port,
        token_file=args.openbao_token_file,
        approle=(role, secret) if role is not None else None,
        approle_mount=args.openbao_approle_mount,
        openbao_ca=args.openbao_ca,
        openbao_namespace=args.openbao_namespace,
        kbs_port=args.kbs_port,
    )
    s.check()
    return s


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def build_credential(s: SecretReleaseSettings) -> Credential:
    if s.token_file is not None:
        return TokenFile(s.token_file)
    assert s.approle is not None
    return AppRole(s.approle[0], s.approle[1], mount=s.approle_mount)


def build_backend(s: SecretReleaseSettings, session: aiohttp.ClientSession) -> OpenBaoClient:
    ctx: ssl.SSLContext | None = None
    if urlsplit(s.openbao_url).scheme == "https":
        ctx = ssl.create_default_context(
            cafile=str(s.openbao_ca) if s.openbao_ca is not None else None
        )
    return OpenBaoClient(
        s.openbao_url,
        build_credential(s),
        session,
        ssl_context=ctx,
        namespace=s.openbao_namespace,
    )


def load_secret_policies(path: Path) -> SecretPolicies:
    from attestmesh.serve import load_yaml_docs

    policies = SecretPolicies()
    policies.set_docs(load_yaml_docs(path))
    return policies


def build_service(
    *,
    state: Callable[[], MeshState],
    policies: SecretPolicies,
    backend: SecretBackend,
    record: Callable[[Sequence[Event]], Any],
    metrics: Metrics,
    limiter: Limiter | None = None,
) -> SecretService:
    def on_decision(operation: str, result: str, reason: str) -> None:
        metrics.secret_requests.labels(operation, result, reason).inc()

    async def audit(events: Sequence[Event]) -> None:
        await record(events)
        for e in events:  # the audit trail in the log too (never a value: none is here)
            log.info("audit %s %s %s %s", e.kind.value, e.workload, e.code, e.reason)

    return SecretService(
        state=state,
        policies=policies,
        backend=backend,
        audit=audit,
        on_decision=on_decision,
        clock=lambda: datetime.now(UTC),
        limiter=limiter if limiter is not None else default_limiter(),
    )


def default_limiter() -> Limiter:
    """Per workload: 128 requests at once, then 4 a second (an agent polls each of its secrets
    every 30 s; renewals and restarts ask for all of them at once)."""
    from attestmesh.controlplane import AttestationLimiter

    return AttestationLimiter(burst=128, refill=timedelta(milliseconds=250))


def secret_limits(limits: ListenLimits) -> ListenLimits:
    return replace(limits, max_connections=min(limits.max_connections, 4_096))


async def start_secret_listener(
    service: SecretService,
    tls: ssl.SSLContext,
    host: str,
    port: int,
    limits: ListenLimits,
    on_refused: OnRefused | None = None,
) -> tuple[web.AppRunner, Site]:
    runner = web.AppRunner(build_secrets_app(service), access_log=None)
    await runner.setup()
    site = await start_aiohttp(
        runner, host, port, ssl=tls, limits=secret_limits(limits), name="secrets",
        on_refused=on_refused,
    )  # fmt: skip
    return runner, site


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


async def watch_secret_policies(
    policies: SecretPolicies,
    path: Path,
    poll: timedelta,
    stop: asyncio.Event,
    on_reload: Callable[[str], None] = lambda result: None,
) -> None:
    """Reload ``path`` when it changes; an invalid file leaves the policies in force. The new
    policies apply to the very next request (and to requests in flight: see SecretService)."""
    from attestmesh.serve import load_yaml_docs

    last = _mtime(path)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll.total_seconds())
        mtime = _mtime(path)
        if mtime is None or mtime == last:
            continue
        last = mtime
        try:
            policies.set_docs(load_yaml_docs(path))
            on_reload("ok")
            log.info("reloaded secret policy from %s", path)
        except PolicyError as exc:
            on_reload("invalid")
            log.error(
                "refused invalid secret policy %s; previous policy stays:\n  %s",
                path,
                "\n  ".join(exc.problems),
            )


async def start(
    s: SecretReleaseSettings,
    cp: Any,
    policies: SecretPolicies,
    metrics: Metrics,
    session: aiohttp.ClientSession,
    tls: ssl.SSLContext,
    host: str,
    limits: ListenLimits,
    on_refused: OnRefused | None = None,
    kbs_tls: ssl.SSLContext | None = None,
) -> list[web.AppRunner]:
    """The secret port of a running control plane ``cp`` (its live state decides, its store
    keeps the audit events) and, with ``kbs_port``, the KBS port (server TLS ``kbs_tls``)."""
    backend = build_backend(s, session)
    service = build_service(
        state=lambda: cp.state, policies=policies, backend=backend, record=cp.record_events,
        metrics=metrics,
    )  # fmt: skip
    runner, _ = await start_secret_listener(service, tls, host, s.port, limits, on_refused)
    log.info("secret release up: https://%s:%d (OpenBao %s)", host, s.port, s.openbao_url)
    runners = [runner]
    if s.kbs_port is not None and kbs_tls is not None:
        runners.append(
            await start_kbs(s, cp, policies, metrics, backend, kbs_tls, host, limits, on_refused)
        )
    return runners


async def start_kbs(
    s: SecretReleaseSettings,
    cp: Any,
    policies: SecretPolicies,
    metrics: Metrics,
    backend: SecretBackend,
    tls: ssl.SSLContext,
    host: str,
    limits: ListenLimits,
    on_refused: OnRefused | None = None,
) -> web.AppRunner:
    import secrets as _secrets

    from attestmesh.controlplane.kbs import KbsService, build_kbs_app

    def on_decision(operation: str, result: str, reason: str) -> None:
        metrics.secret_requests.labels(operation, result, reason).inc()

    service = KbsService(
        state=lambda: cp.state,
        verifiers=lambda: cp.verifiers,
        attestation_policies=lambda: cp.policies,
        secret_policies=policies,
        backend=backend,
        audit=cp.record_events,
        on_decision=on_decision,
        clock=lambda: datetime.now(UTC),
        random_bytes=_secrets.token_bytes,
        limiter=default_limiter(),
    )
    runner = web.AppRunner(build_kbs_app(service), access_log=None)
    await runner.setup()
    await start_aiohttp(
        runner, host, s.kbs_port or 0, ssl=tls, limits=secret_limits(limits), name="kbs",
        on_refused=on_refused,
    )  # fmt: skip
    log.info("KBS up: https://%s:%s/kbs/v0", host, s.kbs_port)
    return runner


async def watch(
    s: SecretReleaseSettings, policies: SecretPolicies, metrics: Metrics, stop: asyncio.Event
) -> None:
    if s.policy_file is not None:
        await watch_secret_policies(policies, s.policy_file, s.poll, stop)


__all__ = [
    "SecretReleaseSettings",
    "add_arguments",
    "build_backend",
    "build_credential",
    "build_service",
    "load_secret_policies",
    "secrets_tls",
    "settings_from_args",
    "start",
    "start_secret_listener",
    "watch",
    "watch_secret_policies",
]
