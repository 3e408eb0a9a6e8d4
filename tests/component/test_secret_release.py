"""Secret release end to end against a real OpenBao (``bao server -dev`` on loopback).

The real control plane (SQLite store, CA, sim verifier) attests the agent over the real HTTPS
API; the agent's ``SecretFetcher`` then asks the secret port over mutual TLS with that attested
certificate; the control plane reads OpenBao KV v2 / transit with its own credential and seals
the answer to the certificate's key. Quarantine, a policy change, a sibling's or a superseded
certificate, and claims that do not match are refused; every release and refusal is a durable
audit event and a metric, never the value.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane.http import build_app
from attestmesh.controlplane.secrets import SecretPolicies, SecretService, secrets_tls
from attestmesh.listen import ListenLimits
from attestmesh.secret_release import build_service, start_secret_listener
from certs.ca import issue_serving_credentials
from certs.openbao import AppRole, KvSecret, OpenBaoClient, OpenBaoError, TokenFile
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.secrets import FanOut, SecretFetcher, SecretFetchError
from tests.bao_harness import Bao, start_bao
from tests.unit.fixtures_core import (
    MEASUREMENT,
    MEASUREMENT_HEX,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    Plane,
    make_control_plane,
    policy_doc,
    registration,
)
from xds.state import EventKind, Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
PASSWORD_V1 = "pw-one-4b1d0c"
PASSWORD_V2 = "pw-two-9e77aa"


def secret_policy(
    *, service_accounts: tuple[str, ...] = ("web",), measurement: str = MEASUREMENT_HEX
) -> dict[str, Any]:
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "SecretPolicy",
        "metadata": {"name": "payments", "namespace": "default"},
        "spec": {
            "secrets": [
                {"name": "db", "kv": {"mount": "secret", "path": "payments/db"}},
                {
                    "name": "model-key",
                    "transit": {"mount": "transit", "key": "model", "operations": ["unwrap"]},
                },
            ],
            "rules": [
                {
                    "from": [{"serviceAccount": sa} for sa in service_accounts],
                    "secrets": ["db", "model-key"],
                    "whenClaims": {"tees": ["sim"], "measurements": {"measurement": [measurement]}},
                }
            ],
        },
    }


class RecordingSink:
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        self.last = (cert_chain_pem, key_pem)


@dataclass
class Mesh:
    plane: Plane
    bao: Bao
    policies: SecretPolicies
    service: SecretService
    api_url: str
    secret_url: str
    tmp: Path

    def agent(
        self, workload: str, measurement: bytes = MEASUREMENT
    ) -> tuple[Agent, SecretFetcher, SimEvidenceSource]:
        fetcher = SecretFetcher(
            url=self.secret_url,
            workload=workload,
            secrets=["db"],
            bundle_pem=self.plane.ca.bundle_pem,
            directory=self.tmp / workload / "secrets",
            tls_dir=self.tmp / workload / "tls",
        )
        source = SimEvidenceSource(PLATFORM, measurement)
        agent = Agent(
            url=self.api_url,
            workload=workload,
            source=source,
            sink=FanOut(RecordingSink(), fetcher),
            ssl_context=client_ssl_context(self.plane.ca.bundle_pem),
            timeout_s=5.0,
        )
        return agent, fetcher, source

    def sample(self, result: str, reason: str, operation: str = "read") -> float:
        return self.plane.sample(
            "attestmesh_secret_requests_total", operation=operation, result=result, reason=reason
        )

    def events(self, workload: str, kind: EventKind) -> list[Any]:
        return [e for e in self.plane.cp.events(workload) if e.kind is kind]


def _server_tls(plane: Plane, directory: Path, ctx: ssl.SSLContext) -> ssl.SSLContext:
    cert, key = issue_serving_credentials(
        plane.ca,
        directory,
        "server",
        spiffe_id=f"spiffe://{TRUST_DOMAIN}/ns/attestmesh-system/sa/controlplane",
        dns_names=["localhost"],
        ips=["127.0.0.1"],
        now=datetime.now(UTC),
        ttl=timedelta(hours=1),
    )
    ctx.load_cert_chain(cert, key)
    return ctx


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    bao = await start_bao(tmp_path / "bao")
    try:
        await bao.kv_put("payments/db", {"password": PASSWORD_V1, "user": "app"})
        await bao.call("POST", "transit/keys/model", {"type": "aes256-gcm96"})
        token_file = tmp_path / "bao-token"
        token_file.write_text(bao.root_token)
        token_file.chmod(0o600)
        plane = make_control_plane(
            tmp_path / "cp",
            clock=Clock(datetime.now(UTC)),
            platform_key=PLATFORM,
            policies=[policy_doc(service_accounts=["web", "api"], certificateTTL="1h")],
            registrations=[
                registration("web-1"),
                registration("web-2"),
                registration("api-1", service_account="api", service="api"),
            ],
        )
        plane.cp._clock = lambda: datetime.now(UTC)  # TLS checks validity on the real clock
        policies = SecretPolicies()
        policies.set_docs([secret_policy()])
        async with aiohttp.ClientSession() as session:
            service = build_service(
                state=lambda: plane.cp.state,
                policies=policies,
                backend=OpenBaoClient(bao.url, TokenFile(token_file), session),
                record=plane.cp.record_events,
                metrics=plane.metrics,
            )
            api = web.AppRunner(build_app(plane.cp, plane.metrics), access_log=None)
            await api.setup()
            api_tls = _server_tls(
                plane, tmp_path, ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            )
            api_site = web.TCPSite(api, "127.0.0.1", 0, ssl_context=api_tls)
            await api_site.start()
            tls = _server_tls(plane, tmp_path, secrets_tls(plane.ca.bundle_pem))
            runner, site = await start_secret_listener(service, tls, "127.0.0.1", 0, ListenLimits())
            try:
                yield Mesh(
                    plane,
                    bao,
                    policies,
                    service,
                    f"https://127.0.0.1:{api.addresses[0][1]}/",
                    f"https://127.0.0.1:{site.port}",
                    tmp_path,
                )
            finally:
                await runner.cleanup()
                await api.cleanup()
                await plane.cp.flushed()
                plane.store.close()
    finally:
        bao.stop()


async def _attested(mesh: Mesh, workload: str, **kw: Any) -> tuple[Agent, SecretFetcher]:
    agent, fetcher, _ = mesh.agent(workload, **kw)
    async with aiohttp.ClientSession() as session:
        await agent.attest_once(session)
    return agent, fetcher


def _files(fetcher: SecretFetcher, mesh: Mesh, workload: str) -> dict[str, str]:
    d = mesh.tmp / workload / "secrets" / "db"
    return {p.name: p.read_text() for p in d.iterdir()} if d.exists() else {}


async def test_release_rotation_audit_and_no_value_in_logs(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    _, fetcher = await _attested(mesh, "web-1")
    async with aiohttp.ClientSession() as session:
        await fetcher.fetch_all(session)
        assert fetcher.last_error == {}
        assert _files(fetcher, mesh, "web-1") == {"password": PASSWORD_V1, "user": "app"}
        mode = (mesh.tmp / "web-1" / "secrets" / "db" / "password").stat().st_mode
        assert stat.S_IMODE(mode) == 0o400
        assert fetcher.held["db"].version == 1
        # the mesh key reached the TLS context through anonymous memory, never a file
        assert not (mesh.tmp / "web-1" / "tls").exists()
        # polling: the same version is answered unchanged, nothing is sealed or audited again
        await fetcher.fetch_all(session)
        await fetcher.fetch_all(session)
        assert mesh.sample("unchanged", "ok") == 2
        assert mesh.sample("released", "ok") == 1
        # rotation: a new KV version reaches the agent on its next poll
        assert await mesh.bao.kv_put("payments/db", {"password": PASSWORD_V2}) == 2
        await fetcher.fetch_all(session)
    assert _files(fetcher, mesh, "web-1") == {"password": PASSWORD_V2}  # "user" left with v1
    assert fetcher.held["db"].version == 2
    released = mesh.events("web-1", EventKind.SECRET_RELEASED)
    assert [e.reason for e in released] == [
        f"read default/db version {v} to spiffe://{TRUST_DOMAIN}/ns/default/sa/web" for v in (1, 2)
    ]
    assert mesh.sample("released", "ok") == 2
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for value in (PASSWORD_V1, PASSWORD_V2, mesh.bao.root_token):
        assert value not in logged
        assert all(value not in e.reason for e in mesh.plane.cp.events())


async def test_quarantine_stops_release_at_once_and_the_agent_drops_the_secret(
    mesh: Mesh,
) -> None:
    _, fetcher = await _attested(mesh, "web-1")
    async with aiohttp.ClientSession() as session:
        await fetcher.fetch_all(session)
        assert _files(fetcher, mesh, "web-1")["password"] == PASSWORD_V1
        mesh.plane.cp.quarantine("web-1", Trigger.OPERATOR, "test")
        await fetcher.fetch_all(session)  # no wait: the very next request is refused
    assert fetcher.last_error["db"].reason == "quarantined"
    assert fetcher.last_error["db"].status == 403
    assert _files(fetcher, mesh, "web-1") == {}
    assert "db" not in fetcher.held
    assert mesh.sample("refused", "quarantined") == 1
    refused = mesh.events("web-1", EventKind.SECRET_REFUSED)
    assert [e.code for e in refused] == ["quarantined"]


async def test_policy_change_stops_release_at_once(mesh: Mesh) -> None:
    _, fetcher = await _attested(mesh, "web-1")
    async with aiohttp.ClientSession() as session:
        await fetcher.fetch_all(session)
        assert fetcher.held["db"].version == 1
        mesh.policies.set_docs([secret_policy(service_accounts=("api",))])
        await fetcher.fetch_all(session)
    assert fetcher.last_error["db"].reason == "not_allowed"
    assert _files(fetcher, mesh, "web-1") == {}
    assert mesh.sample("refused", "not_allowed") == 1


async def test_a_change_while_openbao_is_read_wins(mesh: Mesh) -> None:
    """The decision is taken again after the backend was awaited: a quarantine that lands
    while the read is in flight refuses the release."""
    _, fetcher = await _attested(mesh, "web-1")
    inner = mesh.service._backend

    class QuarantineDuringRead:
        async def kv_read(self, mount: str, path: str, version: int | None = None) -> KvSecret:
            entry = await inner.kv_read(mount, path, version)
            mesh.plane.cp.quarantine("web-1", Trigger.OPERATOR, "during the read")
            return entry

    mesh.service._backend = QuarantineDuringRead()  # type: ignore[assignment]
    async with aiohttp.ClientSession() as session:
        await fetcher.fetch_all(session)
    assert fetcher.last_error["db"].reason == "quarantined"
    assert "db" not in fetcher.held
    assert mesh.events("web-1", EventKind.SECRET_RELEASED) == []


async def test_who_asks_decides(mesh: Mesh) -> None:
    # another service account: no rule names it (answered like an unknown secret)
    _, api = await _attested(mesh, "api-1")
    # the right service account but claims the rule does not accept
    mesh.policies.set_docs([secret_policy(measurement=OTHER_MEASUREMENT.hex())])
    _, web1 = await _attested(mesh, "web-1")
    async with aiohttp.ClientSession() as session:
        await api.fetch_all(session)
        await web1.fetch_all(session)
    assert api.last_error["db"].reason == "not_allowed"
    assert web1.last_error["db"].reason == "not_allowed"  # claims_not_allowed, not told
    assert mesh.sample("refused", "not_allowed") == 1
    assert mesh.sample("refused", "claims_not_allowed") == 1


async def test_only_the_workloads_own_newest_certificate(mesh: Mesh) -> None:
    """web-2 has the same SPIFFE ID (service account web) but its certificate is not web-1's;
    after a renewal web-1's previous certificate is not live either."""
    _, web2 = await _attested(mesh, "web-2")
    web2._workload = "web-1"  # a sibling asking in web-1's name with its own certificate
    agent1, web1 = await _attested(mesh, "web-1")
    old_identity = web1._identity
    async with aiohttp.ClientSession() as session:
        await web2.fetch_all(session)
        await agent1.attest_once(session)  # renewal: a new certificate and key
        renewed = web1._identity
        web1._identity = old_identity
        await web1.fetch_all(session)
        assert web1.last_error["db"].reason == "certificate_not_live"
        web1._identity = renewed
        await web1.fetch_all(session)
    assert web2.last_error["db"].reason == "certificate_not_live"
    assert web1.held["db"].version == 1 and "db" not in web1.last_error
    assert mesh.sample("refused", "certificate_not_live") == 2


async def test_no_client_certificate_or_a_foreign_one_is_refused_by_tls(mesh: Mesh) -> None:
    import trustme

    foreign = trustme.CA()
    client = ssl.create_default_context(cadata=mesh.plane.ca.bundle_pem.decode())
    foreign.issue_cert("web-1").configure_cert(client)
    plain = ssl.create_default_context(cadata=mesh.plane.ca.bundle_pem.decode())
    body = {"workload": "web-1", "secret": "db"}
    async with aiohttp.ClientSession() as session:
        for ctx in (plain, client):
            with pytest.raises(aiohttp.ClientError):
                async with session.post(
                    f"{mesh.secret_url}/v1/secrets/release", json=body, ssl=ctx
                ) as resp:
                    await resp.read()
    assert mesh.sample("released", "ok") == 0


async def test_transit_unwrap_is_sealed_to_the_workload(mesh: Mesh) -> None:
    model_key = bytes(range(32))
    doc = await mesh.bao.call(
        "POST", "transit/encrypt/model", {"plaintext": base64.b64encode(model_key).decode()}
    )
    ciphertext = doc["data"]["ciphertext"]
    _, fetcher = await _attested(mesh, "web-1")
    _, api = await _attested(mesh, "api-1")
    async with aiohttp.ClientSession() as session:
        assert await fetcher.unwrap(session, "model-key", ciphertext) == model_key
        with pytest.raises(SecretFetchError) as refused:
            await api.unwrap(session, "model-key", ciphertext)
        with pytest.raises(SecretFetchError) as malformed:
            await fetcher.unwrap(session, "model-key", "not-a-ciphertext")
        with pytest.raises(SecretFetchError) as not_granted:  # db is kv: read only
            await fetcher.unwrap(session, "db", ciphertext)
    assert refused.value.reason == "not_allowed"
    assert malformed.value.reason == "request_malformed"
    assert not_granted.value.reason == "operation_not_allowed"
    assert mesh.sample("released", "ok", operation="unwrap") == 1


async def test_approle_login_and_a_refused_token(mesh: Mesh) -> None:
    bao = mesh.bao
    await bao.call("POST", "sys/auth/approle", {"type": "approle"})
    await bao.call(
        "PUT",
        "sys/policies/acl/cp",
        {"policy": 'path "secret/data/payments/*" { capabilities = ["read"] }'},
    )
    await bao.call("POST", "auth/approle/role/cp", {"token_policies": ["cp"], "token_ttl": "1h"})
    role_id = (await bao.call("GET", "auth/approle/role/cp/role-id"))["data"]["role_id"]
    secret_id = (await bao.call("POST", "auth/approle/role/cp/secret-id"))["data"]["secret_id"]
    (mesh.tmp / "role").write_text(role_id)
    (mesh.tmp / "sid").write_text(secret_id)
    cred = AppRole(mesh.tmp / "role", mesh.tmp / "sid")
    bad = mesh.tmp / "bad-token"
    bad.write_text("s.not-a-token")
    async with aiohttp.ClientSession() as session:
        client = OpenBaoClient(bao.url, cred, session)
        entry = await client.kv_read("secret", "payments/db")
        assert entry.data["password"] == PASSWORD_V1 and entry.version == 1
        with pytest.raises(OpenBaoError) as outside:  # the role's policy covers payments/ only
            await client.kv_read("secret", "other/thing")
        with pytest.raises(OpenBaoError) as denied:
            await OpenBaoClient(bao.url, TokenFile(bad), session).kv_read("secret", "payments/db")
    assert outside.value.reason == "bao_denied"
    assert denied.value.reason == "bao_denied"
    for shown in (repr(cred), repr(client), repr(entry), str(denied.value)):
        assert secret_id not in shown and PASSWORD_V1 not in shown and "not-a-token" not in shown


async def test_a_workload_looping_on_requests_is_limited_before_anything_is_read(
    mesh: Mesh,
) -> None:
    from attestmesh.controlplane import AttestationLimiter

    mesh.service._limiter = AttestationLimiter(burst=3, refill=timedelta(hours=1))
    _, fetcher = await _attested(mesh, "web-1")
    async with aiohttp.ClientSession() as session:
        for _ in range(5):
            await fetcher.fetch_all(session)
    assert fetcher.last_error["db"].reason == "too_many_requests"
    assert fetcher.last_error["db"].status == 429
    assert fetcher.held["db"].version == 1  # kept: a 429 is not a revocation
    assert mesh.sample("released", "ok") == 1 and mesh.sample("unchanged", "ok") == 2
    assert mesh.sample("refused", "too_many_requests") == 2
    assert mesh.events("web-1", EventKind.SECRET_REFUSED) == []  # counted, never recorded


async def test_fetcher_run_loop_picks_up_rotation(mesh: Mesh) -> None:
    agent, fetcher, _ = mesh.agent("web-1")
    fetcher._poll_s = 0.2
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        await agent.attest_once(session)
    task = asyncio.create_task(fetcher.run(stop))
    try:
        async with asyncio.timeout(10):
            while fetcher.held.get("db") is None:
                await asyncio.sleep(0.05)
            await mesh.bao.kv_put("payments/db", {"password": PASSWORD_V2})
            while fetcher.held["db"].version != 2:
                await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert _files(fetcher, mesh, "web-1") == {"password": PASSWORD_V2}


async def test_the_local_socket_serves_what_is_held_mode_0600(mesh: Mesh) -> None:
    from sidecar.secrets import start_socket

    _, fetcher = await _attested(mesh, "web-1")
    sock = mesh.tmp / "secrets.sock"
    runner = await start_socket(fetcher, sock)
    try:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        connector = aiohttp.UnixConnector(path=str(sock))
        async with aiohttp.ClientSession(connector=connector) as local:
            async with local.get("http://agent/v1/secrets/db") as r:
                assert r.status == 404  # nothing fetched yet
            async with aiohttp.ClientSession() as session:
                await fetcher.fetch_all(session)
            async with local.get("http://agent/v1/secrets/db") as r:
                body = await r.json()
        assert body == {
            "secret": "default/db",
            "version": 1,
            "data": {"password": PASSWORD_V1, "user": "app"},
        }
    finally:
        await runner.cleanup()
