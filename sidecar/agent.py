"""The agent: key -> challenge -> evidence -> CSR -> certificate -> renew / re-attest.

Runs inside the workload's trust boundary. Every attestation makes a fresh P-256 key that never
leaves this process except to the local Envoy over the SDS Unix socket.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from certs.errors import AttestmeshError
from certs.evidence import sim
from sidecar.endpoints import (
    ControlPlaneEndpoint,
    Target,
    backoff_s,
    is_outage,
    parse_endpoints,
    rotate,
    targets_of,
)

log = logging.getLogger(__name__)


class AgentError(AttestmeshError):
    """The control plane refused, or could not be reached."""

    def __init__(self, reason: str, detail: str = "", status: int = 0) -> None:
        super().__init__(reason, detail)
        self.status = status


@dataclass(frozen=True, slots=True)
class Evidence:
    tee: str
    evidence: bytes
    collateral: Mapping[str, bytes] = field(default_factory=dict)


class EvidenceSource(Protocol):
    """A TEE evidence collector: binds ``report_data`` into fresh hardware evidence."""

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence: ...


class CertSink(Protocol):
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None: ...


class SimEvidenceSource:
    """The simulated TEE's 'hardware': signs reports with the simulated platform key.

    ``measurement`` can be changed to model a tampered image."""

    def __init__(self, platform_key: ec.EllipticCurvePrivateKey, measurement: bytes) -> None:
        self._key = platform_key
        self.measurement = measurement

    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Evidence:
        report = sim.build_report(self._key, report_data=report_data, measurement=self.measurement)
        return Evidence("sim", report)


@dataclass(frozen=True, slots=True)
class AgentCertificate:
    chain_pem: bytes
    key_pem: bytes
    serial: int
    spiffe_id: str
    not_after: datetime
    renew_after: datetime
    reattest_by: datetime


def build_csr(key: ec.EllipticCurvePrivateKey) -> bytes:
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.PEM)


def next_attestation_at(cert: AgentCertificate, now: datetime) -> datetime:
    """Renew at about half the TTL, and re-attest well before the deadline."""
    return now + min(cert.renew_after - now, (cert.reattest_by - now) / 2)


Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (TCP), in the resolver's order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Agent:
    """``url``: one control-plane API URL, a comma-separated list, or a sequence of them; a
    host name may resolve to several replicas. An outage of one replica (refused, timeout, TLS
    failure, 502/503/504) moves the attestation to the next after a jittered delay; the
    challenge and its attest/renew always go to the same replica (a nonce is valid only where
    it was issued), so a replica lost in between restarts the pair on the next one."""

    def __init__(
        self,
        *,
        url: str | Sequence[str],
        workload: str,
        source: EvidenceSource,
        sink: CertSink,
        ssl_context: ssl.SSLContext,
        token: Callable[[], str | None] = lambda: None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        timeout_s: float = 10.0,
        connect_timeout_s: float = 3.0,
        resolve: Resolver = resolve_host,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._endpoints: tuple[ControlPlaneEndpoint, ...] = parse_endpoints(url)
        self._resolve = resolve
        self._sleep = sleep
        self._rand = rand
        self._preferred: Target | None = None  # the replica that answered last
        self._workload = workload
        self._source = source
        self._sink = sink
        self._ssl = ssl_context
        self._token = token
        self._clock = clock
        self._timeout = aiohttp.ClientTimeout(
            total=timeout_s, sock_connect=min(connect_timeout_s, timeout_s)
        )
        self.current: AgentCertificate | None = None
        self.attest_now = asyncio.Event()
        # the nonce the control plane offered with the last certificate, where, and until when
        self._offered: tuple[Target, str, datetime] | None = None

    async def _post(
        self, session: aiohttp.ClientSession, target: Target, path: str, body: Any
    ) -> Any:
        headers = {}
        token = self._token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        extra: dict[str, Any] = {}
        if target.address != target.endpoint.host:  # dialled a resolved address: TLS and
            headers["Host"] = target.host_header  # HTTP still name the configured host
            if target.endpoint.scheme == "https":
                extra["server_hostname"] = target.server_hostname
        try:
            async with session.post(
                target.base_url + path,
                json=body,
                ssl=self._ssl,
                headers=headers,
                timeout=self._timeout,
                **extra,
            ) as resp:
                try:
                    data = await resp.json(content_type=None)
                except ValueError:
                    if resp.status == 200:
                        raise
                    data = None  # a refusal without a JSON body is still a refusal
                if resp.status != 200:
                    err = data if isinstance(data, dict) else {}
                    raise AgentError(
                        str(err.get("error", "http_error")),
                        str(err.get("detail", "")),
                        resp.status,
                    )
                if not isinstance(data, dict):
                    raise AgentError("response_malformed", f"{path}: not a JSON object")
                return data
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise AgentError("control_plane_unreachable", repr(exc)) from exc

    async def _targets(self) -> tuple[list[Target], AgentError | None]:
        """Every replica to try, the one that answered last first; and the last resolution
        failure (raised when no target is left)."""
        targets: list[Target] = []
        failure: AgentError | None = None
        for endpoint in self._endpoints:
            if endpoint.is_ip:
                targets += targets_of(endpoint, ())
                continue
            try:
                addresses = await self._resolve(endpoint.host, endpoint.port)
            except OSError as exc:  # socket.gaierror included
                failure = AgentError("control_plane_unreachable", f"{endpoint.url}: {exc!r}")
                log.warning("%s: cannot resolve %s: %r", self._workload, endpoint.host, exc)
                continue
            targets += targets_of(endpoint, addresses)
        return rotate(targets, self._preferred), failure

    async def attest_once(self, session: aiohttp.ClientSession) -> AgentCertificate:
        """One full attestation: a fresh key, fresh evidence, a new certificate. Replicas are
        tried in turn while they fail with an outage; a refusal is raised at once."""
        targets, last = await self._targets()
        for i, target in enumerate(targets):
            if i:
                await self._sleep(backoff_s(i - 1, self._rand))
            try:
                cert = await self._attest_at(session, target)
            except AgentError as exc:
                if not is_outage(exc.reason, exc.status):
                    raise
                log.warning("%s: control plane %s unavailable: %s", self._workload, target, exc)
                last = exc
                continue
            self._preferred = target
            return cert
        raise last or AgentError("control_plane_unreachable", "no control-plane address")

    async def _attest_at(self, session: aiohttp.ClientSession, target: Target) -> AgentCertificate:
        """Challenge and attest/renew at one replica. The nonce the replica offered with the
        last certificate saves the challenge; if it is refused (used, expired, or the replica
        restarted), the agent asks for a challenge and attests again."""
        offered, self._offered = self._offered, None  # one use, whatever the outcome
        if offered is not None and offered[0] == target and self._clock() < offered[2]:
            try:
                return await self._attest_with(session, target, offered[1])
            except AgentError as exc:
                if not exc.reason.startswith("nonce_"):
                    raise
                log.info("%s: offered nonce refused (%s): challenge", self._workload, exc)
        challenge = await self._post(session, target, "/v1/challenge", {})
        return await self._attest_with(session, target, challenge.get("nonce"))

    async def _attest_with(
        self, session: aiohttp.ClientSession, target: Target, nonce_b64: object
    ) -> AgentCertificate:
        key = ec.generate_private_key(ec.SECP256R1())
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        try:
            if not isinstance(nonce_b64, str):
                raise TypeError("nonce must be a base64 string")
            nonce = base64.b64decode(nonce_b64, validate=True)
            report_data = expected_report_data(nonce, spki)
        except (TypeError, ValueError) as exc:
            raise AgentError("response_malformed", f"challenge: {exc!r}") from None
        try:
            evidence = self._source.collect(report_data, nonce=nonce, spki=spki)
        except (AttestmeshError, OSError) as exc:
            raise AgentError("evidence_unavailable", repr(exc)) from exc
        body = {
            "workload": self._workload,
            "tee": evidence.tee,
            "evidence": base64.b64encode(evidence.evidence).decode(),
            "collateral": {k: base64.b64encode(v).decode() for k, v in evidence.collateral.items()},
            "csr": build_csr(key).decode(),
            "nonce": nonce_b64,
        }
        path = "/v1/renew" if self.current is not None else "/v1/attest"
        data = await self._post(session, target, path, body)
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        cert = _issued(data, key_pem)
        self._sink.update(cert.chain_pem, cert.key_pem)
        self.current = cert
        self._offered = _offered_nonce(data, target)
        return cert

    async def run(self, stop: asyncio.Event, retry_s: float = 1.0) -> None:
        """Attest, then renew/re-attest on schedule until ``stop``; retry with backoff."""
        backoff = retry_s
        async with aiohttp.ClientSession() as session:
            if self.current is not None:  # attested already: wait for the schedule first
                first = next_attestation_at(self.current, self._clock()) - self._clock()
                await _wait_any(stop, self.attest_now, max(first.total_seconds(), 0.0))
                self.attest_now.clear()
            while not stop.is_set():
                try:
                    cert = await self.attest_once(session)
                    backoff = retry_s
                    wait = (
                        next_attestation_at(cert, self._clock()) - self._clock()
                    ).total_seconds()
                    log.info(
                        "%s attested as %s, next in %.1fs", self._workload, cert.spiffe_id, wait
                    )
                except AgentError as exc:
                    log.warning("%s attestation failed: %s", self._workload, exc)
                    wait, backoff = backoff, min(backoff * 2, 30.0)
                    if exc.reason == "not_attested":
                        self.current = None
                await _wait_any(stop, self.attest_now, max(wait, 0.0))
                self.attest_now.clear()


def _issued(data: Mapping[str, Any], key_pem: bytes) -> AgentCertificate:
    """The control plane's answer as an AgentCertificate; AgentError if it is malformed."""
    try:
        times = [
            datetime.fromisoformat(data[k]) for k in ("not_after", "renew_after", "reattest_by")
        ]
        if any(t.tzinfo is None for t in times):
            raise ValueError("times must carry a UTC offset")
        return AgentCertificate(
            chain_pem=data["certificate_chain"].encode(),
            key_pem=key_pem,
            serial=int(data["serial"]),
            spiffe_id=str(data["spiffe_id"]),
            not_after=times[0],
            renew_after=times[1],
            reattest_by=times[2],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise AgentError("response_malformed", f"certificate response: {exc!r}") from None


def _offered_nonce(data: Mapping[str, Any], target: Target) -> tuple[Target, str, datetime] | None:
    """The nonce offered for the next attestation, if the answer carries a well-formed one."""
    nonce, expires = data.get("next_nonce"), data.get("next_nonce_expires_at")
    if not isinstance(nonce, str) or not isinstance(expires, str):
        return None
    try:
        at = datetime.fromisoformat(expires)
    except ValueError:
        return None
    return None if at.tzinfo is None else (target, nonce, at)


async def _wait_any(a: asyncio.Event, b: asyncio.Event, seconds: float) -> None:
    tasks = [asyncio.create_task(a.wait()), asyncio.create_task(b.wait())]
    try:
        await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def client_ssl_context(bundle_pem: bytes) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=bundle_pem.decode())
