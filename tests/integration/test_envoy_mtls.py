"""Real Envoys configured by the in-process control plane: SPIFFE mTLS, RBAC, quarantine.

Two workloads, frontend and backend, each an aiohttp app behind its own Envoy; each Envoy gets
listeners/clusters/routes/endpoints/trust over ADS and its certificate from its own local SDS
server on a Unix socket. Certificates come from the project's CA (certs.ca).
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority
from certs.ca.templates import build_leaf
from sidecar.bootstrap import ControlPlaneAddress, build_bootstrap
from sidecar.sds import LocalSds, start_sds
from tests.integration.envoy_harness import EnvoyProcess, free_port, run_envoy, serve_app
from xds.build import Packer, TrustMaterial, build_snapshots
from xds.cache import SnapshotCache
from xds.meshpolicy import MeshPolicy, Rule, Source
from xds.server import start_ads
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    Trigger,
    quarantine,
    record_attestation,
    register,
)

pytestmark = pytest.mark.integration

TD = "mesh.test"
NOW = datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class Credential:
    chain_pem: bytes
    key_pem: bytes
    serial: int
    not_after: datetime


def issue(ca: CertificateAuthority, spiffe: str, serial: int) -> Credential:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )
    leaf = build_leaf(
        csr,
        spiffe_id=spiffe,
        claims_extension=b"\x30\x00",
        issuer=ca.intermediate,
        serial=serial,
        now=NOW,
        ttl=timedelta(hours=1),
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return Credential(ca.chain_pem(leaf), key_pem, serial, leaf.not_valid_after_utc)


def allow(dest_sa: str, caller_sa: str) -> MeshPolicy:
    return MeshPolicy(
        f"allow-{caller_sa}",
        "default",
        dest_sa,
        (Rule((Source(namespace="default", service_account=caller_sa),)),),
    )


@dataclass
class Workload:
    reg: Registration
    cred: Credential
    envoy: EnvoyProcess | None = None


@dataclass
class Mesh:
    ca: CertificateAuthority
    cache: SnapshotCache
    state: MeshState
    policies: list[MeshPolicy]
    workloads: dict[str, Workload] = field(default_factory=dict)
    packer: Packer = field(default_factory=Packer)
    dir: Path = Path()
    warmup_ms: float = 0.0

    def trust(self) -> TrustMaterial:
        revoked = [(r.serial, r.revoked_at) for r in self.state.revocations]
        return TrustMaterial(self.ca.bundle_pem, self.ca.crl_pem(revoked, NOW, timedelta(hours=1)))

    def publish(self) -> float:
        """Build and publish every node's snapshot; returns the monotonic time of the push."""
        snaps = build_snapshots(self.state, self.policies, self.trust(), packer=self.packer)
        t = time.monotonic()
        self.cache.set_snapshots(snaps)
        return t

    def client_ssl(self, name: str) -> ssl.SSLContext:
        """A TLS client context holding workload ``name``'s mesh certificate."""
        cred = self.workloads[name].cred
        ctx = ssl.create_default_context(cadata=self.ca.bundle_pem.decode())
        ctx.check_hostname = False  # the peer is named by its URI SAN, checked by Envoy's side
        paths = [self.dir / f"{name}.chain.pem", self.dir / f"{name}.key.pem"]
        paths[0].write_bytes(cred.chain_pem)
        paths[1].write_bytes(cred.key_pem)
        ctx.load_cert_chain(paths[0], paths[1])
        return ctx


async def _app(name: str, port: int, stack: AsyncExitStack) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=f"{name} {request.method} {request.path}")

    await serve_app(handler, port, stack)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    sockdir = Path(tempfile.mkdtemp(prefix="am-", dir="/tmp"))  # Unix paths must stay short
    async with AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, sockdir, True)
        ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW)
        ports = {n: (free_port(), free_port(), free_port(), free_port()) for n in ("fe", "be")}
        regs = {
            "frontend": Registration(
                "frontend",
                "default",
                "frontend",
                "frontend",
                Endpoint("127.0.0.1", ports["fe"][0]),
                ports["fe"][1],
                {"backend": ports["fe"][2]},
            ),
            "backend": Registration(
                "backend",
                "default",
                "backend",
                "backend",
                Endpoint("127.0.0.1", ports["be"][0]),
                ports["be"][1],
                {"frontend": ports["be"][2]},
            ),
        }
        state = MeshState(TD)
        m = Mesh(
            ca,
            SnapshotCache(),
            state,
            [allow("backend", "frontend"), allow("frontend", "backend")],
            dir=tmp_path,
        )
        for serial, (name, reg) in enumerate(sorted(regs.items()), start=100):
            cred = issue(ca, reg.spiffe_id(TD), serial)
            m.state, _ = register(m.state, reg, NOW)
            m.state, _ = record_attestation(
                m.state,
                name,
                AttestationRecord("sim", {}, "test", "00", NOW),
                IssuedCert(serial, cred.not_after),
                NOW + timedelta(hours=1),
                NOW,
            )
            m.workloads[name] = Workload(reg, cred)
        m.publish()
        server, _ = await start_ads(m.cache, "127.0.0.1", xds_port := free_port(), Metrics())
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        for short, name in (("fe", "frontend"), ("be", "backend")):
            w = m.workloads[name]
            await _app(name, w.reg.app_port, stack)
            sds = LocalSds()
            sds.update(w.cred.chain_pem, w.cred.key_pem)
            sock = sockdir / f"{short}.sock"
            sds_server = await start_sds(sds, sock)
            stack.push_async_callback(sds_server.wait_closed)
            stack.callback(sds_server.close)
            boot = build_bootstrap(
                name, ControlPlaneAddress("127.0.0.1", xds_port), sock, ports[short][3]
            )
            w.envoy = await stack.enter_async_context(
                run_envoy(name, boot, tmp_path, ports[short][3])
            )
        started = time.monotonic()
        async with aiohttp.ClientSession() as s:
            for caller, service in (("frontend", "backend"), ("backend", "frontend")):
                await wait_for_200(s, outbound_url(m, caller, service))
        m.warmup_ms = (time.monotonic() - started) * 1000
        yield m


async def wait_for_200(session: aiohttp.ClientSession, url: str, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while True:
            try:
                if (await get(session, url))[0] == 200:
                    return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.01)


async def wait_for_status(session: aiohttp.ClientSession, url: str, status: int) -> None:
    async with asyncio.timeout(5):
        while (await get(session, url))[0] != status:
            await asyncio.sleep(0.01)


async def get(session: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=3)) as resp:
        return resp.status, await resp.text()


def outbound_url(m: Mesh, caller: str, service: str, path: str = "/hello") -> str:
    return f"http://127.0.0.1:{m.workloads[caller].reg.outbound[service]}{path}"


async def poll_until_refused(
    session: aiohttp.ClientSession, url: str, since: float, within: float = 5.0
) -> tuple[float, int]:
    """Milliseconds from ``since`` to the first non-200 answer (or connection failure)."""
    async with asyncio.timeout(within):
        while True:
            try:
                status, _ = await get(session, url)
            except aiohttp.ClientError:
                status = 0
            if status != 200:
                return (time.monotonic() - since) * 1000, status
            await asyncio.sleep(0.002)


async def test_mtls_request_frontend_to_backend(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as s:
        assert await get(s, outbound_url(mesh, "frontend", "backend")) == (
            200,
            "backend GET /hello",
        )
        assert await get(s, outbound_url(mesh, "backend", "frontend", "/x")) == (
            200,
            "frontend GET /x",
        )
    be = mesh.workloads["backend"].envoy
    assert be is not None
    # the hop was mutual TLS: the backend's inbound listener completed a verified handshake
    assert await be.stat_sum("ssl.handshake") >= 1
    dump = await be.config_dump()
    assert "spiffe://mesh.test/ns/default/sa/frontend" in str(dump)


async def test_peer_from_another_ca_is_rejected(mesh: Mesh, tmp_path: Path) -> None:
    other = trustme.CA()
    leaf = other.issue_cert("frontend.mesh.test")  # trustme makes DNS SANs only
    ctx = ssl.create_default_context(cadata=mesh.ca.bundle_pem.decode())
    ctx.check_hostname = False
    leaf.configure_cert(ctx)
    be = mesh.workloads["backend"]
    assert be.envoy is not None
    stat = f"listener.127.0.0.1_{be.reg.inbound.port}.ssl.fail_verify_error"
    before = (await be.envoy.stats(stat)).get(stat, 0)
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            await s.get(f"https://127.0.0.1:{be.reg.inbound.port}/", ssl=ctx)
    # the chain does not verify (aiohttp may try twice); no SAN check was even reached
    assert (await be.envoy.stats(stat))[stat] > before
    assert (await be.envoy.stats("fail_verify_san")) == dict.fromkeys(
        await be.envoy.stats("fail_verify_san"), 0
    )
    # a mesh certificate over the same path is accepted: the rejection was about the CA
    async with (
        aiohttp.ClientSession() as s,
        s.get(
            f"https://127.0.0.1:{be.reg.inbound.port}/ok", ssl=mesh.client_ssl("frontend")
        ) as resp,
    ):
        assert resp.status == 200


async def test_identity_outside_policy_gets_rbac_403_on_open_connection(mesh: Mesh) -> None:
    url = outbound_url(mesh, "frontend", "backend")
    async with aiohttp.ClientSession() as s:  # keeps its connection alive across the change
        assert (await get(s, url))[0] == 200
        be = mesh.workloads["backend"].envoy
        assert be is not None
        handshakes = await be.stat_sum("ssl.handshake")
        mesh.policies = [p for p in mesh.policies if p.destination_service_account != "backend"]
        pushed = mesh.publish()
        ms, status = await poll_until_refused(s, url, pushed)
        # TLS still succeeds (the SAN is in the trust domain); RBAC in RDS says no, on the
        # connection that was already open: no new handshake happened.
        assert status == 403
        assert await be.stat_sum("ssl.handshake") == handshakes
        assert await be.stat_sum("rbac.denied") >= 1
        print(f"\nRDS RBAC change -> 403 on open connection: {ms:.1f} ms")


async def test_quarantine_cuts_both_directions(mesh: Mesh) -> None:
    fe_url = outbound_url(mesh, "frontend", "backend")
    be_url = outbound_url(mesh, "backend", "frontend")
    fe = mesh.workloads["frontend"]
    async with aiohttp.ClientSession() as s, aiohttp.ClientSession() as direct:
        assert (await get(s, fe_url))[0] == 200
        assert (await get(s, be_url))[0] == 200
        # backend's own certificate, on a connection opened straight to frontend's inbound
        direct_url = f"https://127.0.0.1:{fe.reg.inbound.port}/direct"
        backend_ssl = mesh.client_ssl("backend")
        async with direct.get(direct_url, ssl=backend_ssl) as resp:
            assert resp.status == 200

        mesh.state, _ = quarantine(mesh.state, "backend", Trigger.OPERATOR, "test", NOW)
        pushed = mesh.publish()
        results = await asyncio.gather(
            poll_until_refused(s, fe_url, pushed),
            poll_until_refused(s, be_url, pushed),
            poll_until_refused_direct(direct, direct_url, backend_ssl, pushed),
        )
        (fe_ms, fe_status), (be_ms, be_status), (open_ms, open_status) = results
        # Whichever Envoy applies its update first refuses: 503 from the caller's empty EDS,
        # or 403 from the callee's RBAC (it no longer lists the quarantined identity, or the
        # quarantined callee admits nobody).
        assert {fe_status, be_status} <= {403, 503}
        assert open_status == 403  # RBAC on frontend no longer lists backend, open connection
        # once both Envoys have applied everything: no endpoint left in either direction
        await wait_for_status(s, fe_url, 503)
        await wait_for_status(s, be_url, 503)

        # a new handshake with the revoked certificate fails on the CRL
        assert fe.envoy is not None
        stat = f"listener.127.0.0.1_{fe.reg.inbound.port}.ssl.fail_verify_error"
        before = (await fe.envoy.stats(stat))[stat]
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientError):
                await fresh.get(direct_url, ssl=mesh.client_ssl("backend"))
        assert (await fe.envoy.stats(stat))[stat] > before
        print(
            f"\nquarantine push -> refused: frontend->backend {fe_ms:.1f} ms, "
            f"backend->frontend {be_ms:.1f} ms, open direct connection {open_ms:.1f} ms"
        )


async def poll_until_refused_direct(
    session: aiohttp.ClientSession, url: str, ctx: ssl.SSLContext, since: float
) -> tuple[float, int]:
    async with asyncio.timeout(5):
        while True:
            async with session.get(url, ssl=ctx) as resp:
                await resp.read()
                if resp.status != 200:
                    return (time.monotonic() - since) * 1000, resp.status
            await asyncio.sleep(0.002)
