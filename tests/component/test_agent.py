"""The sidecar agent against the real attestation API over HTTPS on loopback.

The control plane's serving certificate comes from ``certs.ca.build_server_cert``; the agent
trusts only the mesh CA bundle (``client_ssl_context``). TLS checks validity against the real
clock, so the control plane's injected clock starts at the real time here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane.http import build_app
from certs.ca import CertificateAuthority, build_server_cert
from sidecar.agent import (
    Agent,
    AgentCertificate,
    AgentError,
    SimEvidenceSource,
    client_ssl_context,
    next_attestation_at,
)
from tests.unit.fixtures_core import (
    MEASUREMENT,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    Plane,
    make_control_plane,
    policy_doc,
    registration,
)
from xds.state import Status, Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
TOKEN = "join-token"
WEB_ID = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"


class RecordingSink:
    def __init__(self) -> None:
        self.updates: list[tuple[bytes, bytes]] = []
        self.changed = asyncio.Event()

    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        self.updates.append((cert_chain_pem, key_pem))
        self.changed.set()


@dataclass
class Server:
    plane: Plane
    url: str
    clock: Clock
    paths: list[str] = field(default_factory=list)

    @property
    def ca(self) -> CertificateAuthority:
        return self.plane.ca  # type: ignore[no-any-return]


def _server_tls(ca: CertificateAuthority, directory: Path, now: datetime) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build_server_cert(
        ca,
        key,
        spiffe_id=f"spiffe://{TRUST_DOMAIN}/ns/attestmesh-system/sa/controlplane",
        dns_names=["localhost"],
        ips=["127.0.0.1"],
        serial=x509.random_serial_number(),
        now=now,
        ttl=timedelta(hours=1),
    )
    chain, key_file = directory / "server.pem", directory / "server.key"
    chain.write_bytes(ca.chain_pem(cert))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(chain, key_file)
    return ctx


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    clock = Clock(datetime.now(UTC).replace(microsecond=0))
    plane = make_control_plane(
        tmp_path,
        clock=clock,
        platform_key=PLATFORM,
        policies=[policy_doc(certificateTTL="1h", reattestationInterval="20m")],
        registrations=[
            registration("web-1"),
            registration("tok-1", token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest()),
        ],
    )
    paths: list[str] = []

    @web.middleware
    async def record_path(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        paths.append(request.path)
        return await handler(request)

    app = build_app(plane.cp, plane.metrics)
    app.middlewares.append(record_path)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=_server_tls(plane.ca, tmp_path, clock()))
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Server(plane, f"https://127.0.0.1:{port}/", clock, paths)
    finally:
        await runner.cleanup()
        plane.store.close()


def _agent(
    server: Server,
    workload: str = "web-1",
    *,
    sink: RecordingSink | None = None,
    url: str | None = None,
    bundle: bytes | None = None,
    token: str | None = None,
) -> tuple[Agent, RecordingSink, SimEvidenceSource]:
    sink = sink or RecordingSink()
    source = SimEvidenceSource(PLATFORM, MEASUREMENT)
    agent = Agent(
        url=url or server.url,
        workload=workload,
        source=source,
        sink=sink,
        ssl_context=client_ssl_context(bundle or server.ca.bundle_pem),
        token=lambda: token,
        clock=server.clock,
        timeout_s=5.0,
    )
    return agent, sink, source


@contextlib.asynccontextmanager
async def _session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _key_of(key_pem: bytes) -> Any:
    return serialization.load_pem_private_key(key_pem, password=None).public_key()


async def test_attest_once_sets_the_sink_with_matching_chain_and_key(server: Server) -> None:
    agent, sink, _ = _agent(server)
    async with _session() as session:
        cert = await agent.attest_once(session)
    assert server.paths == ["/v1/challenge", "/v1/attest"]
    assert len(sink.updates) == 1
    chain_pem, key_pem = sink.updates[0]
    leaf, intermediate = x509.load_pem_x509_certificates(chain_pem)
    assert leaf.public_key() == _key_of(key_pem)
    assert intermediate == server.ca.intermediate.cert
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [WEB_ID]
    assert agent.current == cert
    assert (cert.chain_pem, cert.key_pem) == (chain_pem, key_pem)
    assert cert.serial == leaf.serial_number and cert.spiffe_id == WEB_ID
    assert cert.not_after == leaf.not_valid_after_utc
    assert cert.reattest_by == server.clock() + timedelta(minutes=20)
    assert server.plane.cp.status_of("web-1") is Status.ATTESTED


async def test_renewal_uses_renew_and_a_new_key_each_time(server: Server) -> None:
    agent, sink, _ = _agent(server)
    async with _session() as session:
        certs = [await agent.attest_once(session) for _ in range(3)]
    # each certificate comes with the nonce for the next attestation: no challenge after the first
    assert server.paths == ["/v1/challenge", "/v1/attest", "/v1/renew", "/v1/renew"]
    keys = {c.key_pem for c in certs}
    assert len(keys) == 3
    assert len({c.serial for c in certs}) == 3
    for chain_pem, key_pem in sink.updates:
        assert x509.load_pem_x509_certificates(chain_pem)[0].public_key() == _key_of(key_pem)
    live = server.plane.cp.state.get("web-1").certificates
    assert [c.serial for c in live] == [c.serial for c in certs]


async def test_agent_sends_its_token(server: Server) -> None:
    agent, _, _ = _agent(server, "tok-1", token=TOKEN)
    async with _session() as session:
        assert (await agent.attest_once(session)).spiffe_id == WEB_ID
    wrong, sink, _ = _agent(server, "tok-1", token="guess")
    async with _session() as session:
        with pytest.raises(AgentError) as info:
            await wrong.attest_once(session)
    assert (info.value.reason, info.value.status) == ("identity_invalid", 401)
    assert sink.updates == []


async def _refused(agent: Agent) -> AgentError:
    async with _session() as session:
        with pytest.raises(AgentError) as info:
            await agent.attest_once(session)
    return info.value


async def test_agent_surfaces_the_control_planes_reasons(server: Server) -> None:
    agent, sink, source = _agent(server)
    source.measurement = OTHER_MEASUREMENT  # a tampered image
    err = await _refused(agent)
    assert (err.reason, err.status) == ("measurement_not_allowed", 403)
    assert "measurement_not_allowed" in err.detail
    assert sink.updates == [] and agent.current is None
    ghost, _, _ = _agent(server, "ghost")
    err = await _refused(ghost)
    assert (err.reason, err.status) == ("identity_invalid", 401)  # like bad credentials


async def test_failed_renewal_quarantines_and_the_agent_reports_it(server: Server) -> None:
    agent, sink, source = _agent(server)
    async with _session() as session:
        await agent.attest_once(session)
        source.measurement = OTHER_MEASUREMENT
        with pytest.raises(AgentError) as info:
            await agent.attest_once(session)
        assert info.value.reason == "measurement_not_allowed"
        source.measurement = MEASUREMENT
        with pytest.raises(AgentError) as info:
            await agent.attest_once(session)
        assert (info.value.reason, info.value.status) == ("quarantined", 403)
    assert len(sink.updates) == 1  # the sink never got a certificate after the failure
    w = server.plane.cp.state.get("web-1")
    assert w.status is Status.QUARANTINED and w.quarantine.trigger is Trigger.APPRAISAL_FAILED


async def test_unreachable_or_untrusted_control_plane(server: Server, tmp_path: Path) -> None:
    other_ca = CertificateAuthority.load_or_create(tmp_path / "other", TRUST_DOMAIN, server.clock())
    untrusting, _, _ = _agent(server, bundle=other_ca.bundle_pem)
    err = await _refused(untrusting)
    assert err.reason == "control_plane_unreachable" and "certificate" in err.detail.lower()
    assert server.paths == []  # TLS failed before any request was served
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    nowhere, _, _ = _agent(server, url=f"https://127.0.0.1:{closed_port}")
    assert (await _refused(nowhere)).reason == "control_plane_unreachable"


async def test_run_recovers_after_release_by_attesting_afresh(server: Server) -> None:
    agent, sink, _ = _agent(server)
    async with _session() as session:
        await agent.attest_once(session)
    cp = server.plane.cp
    cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    cp.release("web-1")
    server.paths.clear()
    sink.changed.clear()
    stop = asyncio.Event()
    agent.attest_now.set()  # do not wait for the schedule
    task = asyncio.create_task(agent.run(stop, retry_s=0.01))
    try:
        await asyncio.wait_for(sink.changed.wait(), timeout=5)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=5)
    # renew (with the nonce offered by the first attestation) is refused (not attested after
    # release), so the agent forgets its certificate and attests from scratch
    assert server.paths[:3] == ["/v1/renew", "/v1/challenge", "/v1/attest"]
    assert cp.status_of("web-1") is Status.ATTESTED
    assert len(sink.updates) == 2


# ---------------------------------------------------------------------------------------------
# next_attestation_at


T0 = datetime(2030, 1, 1, tzinfo=UTC)


def _cert(renew_after: timedelta, reattest_by: timedelta) -> AgentCertificate:
    return AgentCertificate(
        chain_pem=b"",
        key_pem=b"",
        serial=1,
        spiffe_id=WEB_ID,
        not_after=T0 + timedelta(hours=1),
        renew_after=T0 + renew_after,
        reattest_by=T0 + reattest_by,
    )


@pytest.mark.parametrize(
    ("renew_after", "reattest_by", "now", "expected"),
    [
        # renew at half the TTL when the re-attestation deadline is far
        (timedelta(minutes=30), timedelta(hours=2), T0, T0 + timedelta(minutes=30)),
        # otherwise halfway to the re-attestation deadline
        (timedelta(minutes=30), timedelta(minutes=20), T0, T0 + timedelta(minutes=10)),
        (
            timedelta(minutes=30),
            timedelta(minutes=30),
            T0 + timedelta(minutes=10),
            T0 + timedelta(minutes=20),
        ),
        # already late: now (or earlier, which the run loop treats as now)
        (timedelta(minutes=30), timedelta(minutes=20), T0 + timedelta(minutes=40), None),
    ],
)
def test_next_attestation_at(
    renew_after: timedelta, reattest_by: timedelta, now: datetime, expected: datetime | None
) -> None:
    when = next_attestation_at(_cert(renew_after, reattest_by), now)
    if expected is None:
        assert when <= now
    else:
        assert when == expected


# ---------------------------------------------------------------------------------------------
# a misbehaving control plane (plain HTTP fake): the agent raises AgentError, never crashes


def _fake_app(challenge: Any, issued: Any, status: int = 200) -> web.Application:
    async def on_challenge(request: web.Request) -> web.Response:
        return web.json_response(challenge)

    async def on_attest(request: web.Request) -> web.Response:
        return web.json_response(issued, status=status)

    app = web.Application()
    app.router.add_post("/v1/challenge", on_challenge)
    app.router.add_post("/v1/attest", on_attest)
    return app


GOOD_NONCE = base64.b64encode(bytes(32)).decode()
WHEN = "2030-01-01T00:00:00+00:00"
GOOD_ISSUED = {
    "certificate_chain": "chain",
    "serial": "5",
    "spiffe_id": WEB_ID,
    "not_after": WHEN,
    "renew_after": WHEN,
    "reattest_by": WHEN,
}


@pytest.mark.parametrize(
    ("challenge", "issued", "status", "reason"),
    [
        (["not", "an", "object"], GOOD_ISSUED, 200, "response_malformed"),
        ({"nonce": "c2hvcnQ="}, GOOD_ISSUED, 200, "response_malformed"),  # 5-byte nonce
        ({"nonce": "!!"}, GOOD_ISSUED, 200, "response_malformed"),
        ({}, GOOD_ISSUED, 200, "response_malformed"),
        ({"nonce": GOOD_NONCE}, {}, 200, "response_malformed"),
        ({"nonce": GOOD_NONCE}, {**GOOD_ISSUED, "serial": "five"}, 200, "response_malformed"),
        ({"nonce": GOOD_NONCE}, {**GOOD_ISSUED, "not_after": "soon"}, 200, "response_malformed"),
        (  # a time without a UTC offset would break the schedule arithmetic later
            {"nonce": GOOD_NONCE},
            {**GOOD_ISSUED, "reattest_by": "2030-01-01T00:00:00"},
            200,
            "response_malformed",
        ),
        ({"nonce": GOOD_NONCE}, ["error"], 502, "http_error"),
        ({"nonce": GOOD_NONCE}, {"error": "busy", "detail": "later"}, 503, "busy"),
    ],
)
async def test_malformed_answers_are_agent_errors(
    challenge: Any, issued: Any, status: int, reason: str
) -> None:
    sink = RecordingSink()
    async with TestServer(_fake_app(challenge, issued, status), host="127.0.0.1") as fake:
        agent = Agent(
            url=str(fake.make_url("/")),
            workload="web-1",
            source=SimEvidenceSource(PLATFORM, MEASUREMENT),
            sink=sink,
            ssl_context=ssl.create_default_context(),
        )
        async with _session() as session:
            with pytest.raises(AgentError) as info:
                await agent.attest_once(session)
    assert info.value.reason == reason
    assert sink.updates == [] and agent.current is None


class _BrokenDevice:
    def collect(self, report_data: bytes, *, nonce: bytes, spki: bytes) -> Any:
        raise OSError(5, "Input/output error")


async def test_an_evidence_device_failure_is_an_agent_error() -> None:
    async with TestServer(_fake_app({"nonce": GOOD_NONCE}, GOOD_ISSUED), host="127.0.0.1") as f:
        agent = Agent(
            url=str(f.make_url("/")),
            workload="web-1",
            source=_BrokenDevice(),
            sink=RecordingSink(),
            ssl_context=ssl.create_default_context(),
        )
        async with _session() as session:
            with pytest.raises(AgentError) as info:
                await agent.attest_once(session)
    assert info.value.reason == "evidence_unavailable"


async def test_run_keeps_retrying_after_malformed_answers() -> None:
    calls = 0

    async def on_challenge(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response({"nonce": GOOD_NONCE})

    async def on_attest(request: web.Request) -> web.Response:
        return web.json_response({"certificate_chain": 5})

    app = web.Application()
    app.router.add_post("/v1/challenge", on_challenge)
    app.router.add_post("/v1/attest", on_attest)
    async with TestServer(app, host="127.0.0.1") as fake:
        agent = Agent(
            url=str(fake.make_url("/")),
            workload="web-1",
            source=SimEvidenceSource(PLATFORM, MEASUREMENT),
            sink=RecordingSink(),
            ssl_context=ssl.create_default_context(),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop, retry_s=0.01))
        for _ in range(200):
            if calls >= 3:
                break
            await asyncio.sleep(0.01)
        assert not task.done()  # the loop survived every malformed answer
        stop.set()
        await asyncio.wait_for(task, timeout=5)
    assert calls >= 3


async def test_an_offered_nonce_is_used_once_and_a_refused_one_falls_back_to_a_challenge(
    server: Server,
) -> None:
    """The nonce offered with a certificate serves the next attestation once; if the control
    plane no longer knows it (another agent used it, it restarted), the agent asks for a
    challenge at once and still gets its certificate."""
    agent, sink, _ = _agent(server)
    async with _session() as session:
        first = await agent.attest_once(session)
        offered = agent._offered
        assert offered is not None and offered[2] < first.reattest_by  # a challenge's lifetime
        # the workload's offered nonce is taken (as if used from elsewhere): refused, then a
        # challenge
        server.plane.cp._offered.pop("web-1")
        second = await agent.attest_once(session)
        third = await agent.attest_once(session)  # the nonce offered with the second
    assert server.paths == [
        "/v1/challenge", "/v1/attest", "/v1/renew", "/v1/challenge", "/v1/renew", "/v1/renew",
    ]  # fmt: skip
    assert len({first.serial, second.serial, third.serial}) == 3
    assert len(sink.updates) == 3
    assert server.plane.rejections("renew", "nonce_not_offered") == 1.0
