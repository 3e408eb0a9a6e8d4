"""A ``whenClaims`` mesh rule holds per certificate, through real Envoys (issue 8, item 6).

Two pods of ONE service account (web-good, web-bad: same SPIFFE ID) call ``db``, whose
MeshPolicy admits ``web`` only ``whenClaims`` measurement=GOOD. Each pod's certificate carries
the class of its own attested claims in its Subject (``certs.ca.claims_class``); the db Envoy's
inbound HCM puts the verified Subject into x-forwarded-client-cert (SANITIZE_SET) and its RBAC
requires the SPIFFE ID AND the class. So web-good gets 200, web-bad 403 on real traffic, a
forged XFCC header changes nothing, and a re-attestation of web-bad with GOOD (a new
certificate through its SDS, the record updated over ADS) lets it through with no restart.
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
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority, claims_class
from certs.ca.templates import build_leaf
from sidecar.bootstrap import ControlPlaneAddress, build_bootstrap
from sidecar.sds import LocalSds, start_sds
from tests.integration.envoy_harness import EnvoyProcess, free_port, run_envoy, serve_app
from xds.build import Packer, TrustMaterial, build_snapshots
from xds.cache import SnapshotCache
from xds.meshpolicy import ClaimsCondition, MeshPolicy, Rule, Source
from xds.server import start_ads
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    record_attestation,
    register,
)

pytestmark = pytest.mark.integration

TD = "mesh.test"
NOW = datetime.now(UTC)
GOOD = "aa" * 48
BAD = "bb" * 48
WEB_ID = f"spiffe://{TD}/ns/default/sa/web"
XFCC = "x-forwarded-client-cert"


@dataclass
class Pod:
    reg: Registration
    measurement: str
    sds: LocalSds
    chain_pem: bytes = b""
    key_pem: bytes = b""
    envoy: EnvoyProcess | None = None


@dataclass
class Mesh:
    ca: CertificateAuthority
    cache: SnapshotCache
    state: MeshState
    policies: list[MeshPolicy]
    dir: Path
    pods: dict[str, Pod] = field(default_factory=dict)
    packer: Packer = field(default_factory=Packer)
    serial: int = 100

    def publish(self) -> float:
        trust = TrustMaterial(self.ca.bundle_pem)
        self.cache.set_snapshots(
            build_snapshots(self.state, self.policies, trust, packer=self.packer)
        )
        return time.monotonic()

    def attest(self, name: str, measurement: str) -> None:
        """What the control plane does on an admitted attestation: a leaf whose Subject names
        the class of the admitted claims, and the claims on record
        (``certs.offload.verify_and_sign`` and ``record_attestation``); the pod's agent then
        hands the leaf to its Envoy over SDS."""
        pod = self.pods[name]
        self.serial += 1
        key = ec.generate_private_key(ec.SECP256R1())
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .sign(key, hashes.SHA256())
        )
        measurements = {"measurement": measurement}
        leaf = build_leaf(
            csr,
            spiffe_id=pod.reg.spiffe_id(TD),
            claims_extension=b"\x30\x00",
            issuer=self.ca.intermediate,
            serial=self.serial,
            now=NOW,
            ttl=timedelta(hours=1),
            claims_class=claims_class("sim", measurements),
        )
        pod.measurement = measurement
        pod.chain_pem = self.ca.chain_pem(leaf)
        pod.key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        self.state, _ = record_attestation(
            self.state,
            name,
            AttestationRecord("sim", measurements, "test", f"{self.serial:02x}", NOW),
            IssuedCert(self.serial, leaf.not_valid_after_utc),
            NOW + timedelta(hours=1),
            NOW,
        )
        pod.sds.update(pod.chain_pem, pod.key_pem)

    def client_ssl(self, name: str) -> ssl.SSLContext:
        """A TLS client context holding pod ``name``'s current mesh certificate."""
        pod = self.pods[name]
        ctx = ssl.create_default_context(cadata=self.ca.bundle_pem.decode())
        ctx.check_hostname = False
        chain, key = self.dir / f"{name}.chain.pem", self.dir / f"{name}.key.pem"
        chain.write_bytes(pod.chain_pem)
        key.write_bytes(pod.key_pem)
        ctx.load_cert_chain(chain, key)
        return ctx

    def db_url(self, caller: str, path: str = "/rows") -> str:
        return f"http://127.0.0.1:{self.pods[caller].reg.outbound['db']}{path}"

    def db_direct(self, path: str = "/rows") -> str:
        return f"https://127.0.0.1:{self.pods['db'].reg.inbound.port}{path}"


def claims_policy() -> MeshPolicy:
    return MeshPolicy(
        "db-needs-good",
        "default",
        "db",
        (
            Rule(
                (Source(namespace="default", service_account="web"),),
                ClaimsCondition(measurements=(("measurement", frozenset({GOOD})),)),
            ),
        ),
    )


async def _echo_app(port: int, stack: AsyncExitStack) -> None:
    """db's app: answers with the XFCC header its Envoy forwarded."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=request.headers.get(XFCC, "-"))

    await serve_app(handler, port, stack)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    sockdir = Path(tempfile.mkdtemp(prefix="amc-", dir="/tmp"))  # Unix paths must stay short
    async with AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, sockdir, True)
        ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW)
        m = Mesh(ca, SnapshotCache(), MeshState(TD), [claims_policy()], tmp_path)
        admin = {n: free_port() for n in ("db", "web-good", "web-bad")}
        specs = {
            # name: (service account, service, outbound, measurement)
            "db": ("db", "db", {}, GOOD),
            "web-good": ("web", "", {"db": free_port()}, GOOD),
            "web-bad": ("web", "", {"db": free_port()}, BAD),
        }
        for name, (sa, service, outbound, measurement) in specs.items():
            reg = Registration(
                name,
                "default",
                sa,
                service,
                Endpoint("127.0.0.1", free_port()),
                free_port(),
                outbound,
            )
            m.state, _ = register(m.state, reg, NOW)
            m.pods[name] = Pod(reg, measurement, LocalSds())
            m.attest(name, measurement)
        m.publish()
        server, _ = await start_ads(m.cache, "127.0.0.1", xds_port := free_port(), Metrics())
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        await _echo_app(m.pods["db"].reg.app_port, stack)
        for name, pod in m.pods.items():
            sock = sockdir / f"{name}.sock"
            sds_server = await start_sds(pod.sds, sock)
            stack.push_async_callback(sds_server.wait_closed)
            stack.callback(sds_server.close)
            boot = build_bootstrap(
                name, ControlPlaneAddress("127.0.0.1", xds_port), sock, admin[name]
            )
            pod.envoy = await stack.enter_async_context(
                run_envoy(name, boot, tmp_path, admin[name])
            )
        async with aiohttp.ClientSession() as s:
            await wait_for_status(s, m.db_url("web-good"), 200, within=10)
        yield m


async def get(
    session: aiohttp.ClientSession,
    url: str,
    ctx: ssl.SSLContext | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, str]:
    async with session.get(
        url, ssl=ctx if ctx is not None else True, headers=headers,
        timeout=aiohttp.ClientTimeout(total=3),
    ) as resp:  # fmt: skip
        return resp.status, await resp.text()


async def wait_for_status(
    session: aiohttp.ClientSession, url: str, status: int, within: float = 5.0
) -> float:
    """Seconds until ``url`` answers ``status``."""
    start = time.monotonic()
    async with asyncio.timeout(within):
        while True:
            try:
                if (await get(session, url))[0] == status:
                    return time.monotonic() - start
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.01)


def xfcc_of(chain_pem: bytes) -> str:
    """The Subject as Envoy prints it into XFCC for this leaf (RFC 2253 order, quoted)."""
    leaf = x509.load_pem_x509_certificates(chain_pem)[0]
    return f'Subject="{leaf.subject.rfc4514_string()}"'


async def test_sibling_with_another_measurement_is_refused(mesh: Mesh) -> None:
    db = mesh.pods["db"].envoy
    assert db is not None
    good_class = claims_class("sim", {"measurement": GOOD})
    async with aiohttp.ClientSession() as s:
        status, xfcc = await get(s, mesh.db_url("web-good"))
        assert status == 200
        # what db's Envoy forwarded: the verified caller's Subject (its class) and URI SAN
        assert f'Subject="OU={good_class},O=attestmesh"' in xfcc.split(";")
        assert f"URI={WEB_ID}" in xfcc.split(";")
        print(f"\nXFCC as db's app received it: {xfcc}")
        denied = await db.stat_sum("rbac.denied")
        status, body = await get(s, mesh.db_url("web-bad"))
        assert (status, body) == (403, "RBAC: access denied")
        assert await db.stat_sum("rbac.denied") == denied + 1
        # both callers hold the same SPIFFE ID: only the certificate's claims class differs
        assert mesh.pods["web-good"].reg.spiffe_id(TD) == mesh.pods["web-bad"].reg.spiffe_id(TD)


async def test_forged_xfcc_header_is_replaced(mesh: Mesh) -> None:
    good_class = claims_class("sim", {"measurement": GOOD})
    forged = f'By=x;Hash=00;Subject="OU={good_class},O=attestmesh";URI={WEB_ID}'
    async with aiohttp.ClientSession() as s:
        # the bad pod's own certificate, straight to db's inbound, claiming the good class
        bad = mesh.client_ssl("web-bad")
        assert await get(s, mesh.db_direct(), bad, {XFCC: forged}) == (
            403,
            "RBAC: access denied",
        )
        # through its Envoy (the app sets the header; the outbound HCM sanitizes it too)
        assert (await get(s, mesh.db_url("web-bad"), headers={XFCC: forged}))[0] == 403
        # the good pod's certificate with a forged header: the app sees only what Envoy set
        good = mesh.client_ssl("web-good")
        status, xfcc = await get(s, mesh.db_direct(), good, {XFCC: "Subject=forged"})
        assert status == 200
        assert "forged" not in xfcc and xfcc.count("Subject=") == 1
        assert xfcc_of(mesh.pods["web-good"].chain_pem) in xfcc.split(";")


async def wait_for_serial(envoy: EnvoyProcess, serial: int, within: float = 5.0) -> None:
    """Until ``envoy`` holds the certificate with ``serial`` (pushed by its local SDS)."""
    async with asyncio.timeout(within):
        while f'"serial_number": "{serial:x}"' not in (await envoy.get("/certs"))[1]:
            await asyncio.sleep(0.01)


async def test_reattestation_with_the_allowed_measurement_lets_the_sibling_in(
    mesh: Mesh,
) -> None:
    bad_pod, db = mesh.pods["web-bad"], mesh.pods["db"]
    assert bad_pod.envoy is not None and db.envoy is not None
    pids = {n: p.envoy.process.pid for n, p in mesh.pods.items() if p.envoy is not None}
    old_bad = mesh.client_ssl("web-bad")
    routes_before = (await db.envoy.config_dump())["configs"]
    async with aiohttp.ClientSession() as s:
        # refused with its own (BAD) certificate, on a connection of its own to db's Envoy
        assert (await get(s, mesh.db_direct(), old_bad))[0] == 403
        mesh.attest("web-bad", GOOD)  # new certificate over SDS, new claims on record
        pushed = mesh.publish()
        await wait_for_serial(bad_pod.envoy, mesh.serial)
        # through its own Envoy, never restarted: the new certificate's class is admitted
        await wait_for_status(s, mesh.db_url("web-bad"), 200)
        ms = (time.monotonic() - pushed) * 1000
        assert (await get(s, mesh.db_direct(), mesh.client_ssl("web-bad")))[0] == 200
        # per certificate: the pod's previous (BAD) certificate is still refused
        assert (await get(s, mesh.db_direct(), old_bad))[0] == 403
        assert (await get(s, mesh.db_url("web-good")))[0] == 200
    # db's authorization did not change (the GOOD class was already admitted): same RBAC
    assert _rds(routes_before)
    assert _rds(routes_before) == _rds((await db.envoy.config_dump())["configs"])
    for name, pod in mesh.pods.items():
        assert pod.envoy is not None and pod.envoy.process.returncode is None
        assert pod.envoy.process.pid == pids[name]
    print(f"\nre-attested GOOD -> 200 through its unrestarted Envoy {ms:.1f} ms after the push")


def _rds(configs: list[dict[str, object]]) -> list[object]:
    return [c for c in configs if "RoutesConfigDump" in str(c.get("@type"))]
