"""``attestmesh demo``: the whole core loop on loopback with real Envoys and the simulated TEE.

Control plane (embedded SQLite) + two workloads, frontend and backend, each with its agent, its
local SDS, a real Envoy and a tiny HTTP app. It shows frontend <-> backend over mutually attested
mTLS, then makes backend present a tampered measurement at its next re-attestation and shows the
quarantine cutting traffic both ways. Exit status 0 only if every expectation held.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import secrets
import socket
import ssl
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.serve import (
    ControlPlaneSettings,
    Running,
    control_plane_spiffe_id,
    default_attest_processes,
    run_control_plane,
)
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.bootstrap import ControlPlaneAddress, XdsTls, build_bootstrap
from sidecar.envoy_proc import EnvoyProcess
from sidecar.sds import LocalSds, start_sds
from xds.state import Status

GOOD = bytes.fromhex("a1" * 48)
TAMPERED = bytes.fromhex("66" * 48)
NAMES = ("frontend", "backend")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_EPHEMERAL_LOW = _ephemeral_low()
_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port for a server started later, never one handed out before by this
    process, and from below the kernel's ephemeral range: a port from bind(0) is an ephemeral
    one, which any client connection opened before the server binds may take, and a second
    bind(0) may return the same port again."""
    rng = random.SystemRandom()
    low = min(10000, max(1024, _EPHEMERAL_LOW - 4096))
    for _ in range(1000):
        port = rng.randrange(low, _EPHEMERAL_LOW)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}..{_EPHEMERAL_LOW - 1}")


@dataclass
class Timeline:
    start: float = field(default_factory=time.perf_counter)
    marks: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, what: str) -> float:
        t = (time.perf_counter() - self.start) * 1000
        self.marks.append((what, t))
        print(f"  [{t:8.1f} ms] {what}", flush=True)
        return t


@dataclass
class Expectations:
    results: list[tuple[str, bool]] = field(default_factory=list)

    def check(self, what: str, ok: bool) -> bool:
        self.results.append((what, ok))
        print(f"  {'PASS' if ok else 'FAIL'}  {what}", flush=True)
        return ok

    @property
    def all_held(self) -> bool:
        return bool(self.results) and all(ok for _, ok in self.results)


def join_token(name: str) -> str:
    """A fresh join token per workload; the control plane keeps only its SHA-256."""
    return f"{name}-{secrets.token_hex(16)}"


def write_config(
    root: Path, ports: dict[str, dict[str, int]], sim_key: Path, tokens: Mapping[str, str]
) -> ControlPlaneSettings:
    policy = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": "demo", "namespace": "default"},
        "spec": {
            "selector": {"serviceAccounts": list(NAMES)},
            "allowedTees": ["sim"],
            "certificateTTL": "10m",
            "reattestationInterval": "5m",
            "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
        },
    }
    mesh = [
        {
            "apiVersion": "attestmesh.dev/v1alpha1",
            "kind": "MeshPolicy",
            "metadata": {"name": f"{dst}-callers", "namespace": "default"},
            "spec": {
                "destination": {"serviceAccount": dst},
                "rules": [{"from": [{"serviceAccount": src}]}],
            },
        }
        for src, dst in (("frontend", "backend"), ("backend", "frontend"))
    ]
    regs = {
        "workloads": [
            {
                "name": n,
                "namespace": "default",
                "serviceAccount": n,
                "inbound": f"127.0.0.1:{ports[n]['inbound']}",
                "appPort": ports[n]["app"],
                "outbound": {other: ports[n]["outbound"] for other in NAMES if other != n},
                "tokenSha256": hashlib.sha256(tokens[n].encode()).hexdigest(),
            }
            for n in NAMES
        ]
    }
    (root / "policy.yaml").write_text(yaml.safe_dump(policy))
    (root / "mesh.yaml").write_text(yaml.safe_dump_all(mesh))
    (root / "workloads.yaml").write_text(yaml.safe_dump(regs))
    return ControlPlaneSettings(
        state_dir=root / "state",
        policy_file=root / "policy.yaml",
        mesh_policy_file=root / "mesh.yaml",
        registrations_file=root / "workloads.yaml",
        sim_platform_keys=(sim_key,),
        attest_processes=default_attest_processes(),  # as `attestmesh controlplane` does
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
    )


@contextlib.asynccontextmanager
async def tiny_app(name: str, port: int) -> AsyncIterator[None]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hello from {name}\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hello)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield
    finally:
        await runner.cleanup()


@dataclass
class Sidecar:
    agent: Agent
    source: SimEvidenceSource
    envoy: EnvoyProcess


@contextlib.asynccontextmanager
async def sidecar(
    name: str,
    settings: ControlPlaneSettings,
    ports: Mapping[str, int],
    root: Path,
    platform: ec.EllipticCurvePrivateKey,
    token: str,
    tls: ssl.SSLContext,
) -> AsyncIterator[Sidecar]:
    """One workload on loopback: its tiny app, local SDS on a Unix socket, agent (simulated
    TEE) and Envoy (not started yet). Everything is stopped and removed on exit."""
    sock = root / f"sds-{name}.sock"
    async with tiny_app(name, ports["app"]):
        sds = LocalSds()
        server = await start_sds(sds, sock)
        source = SimEvidenceSource(platform, GOOD)
        agent = Agent(
            url=f"https://127.0.0.1:{settings.api_port}",
            workload=name,
            source=source,
            sink=sds,
            ssl_context=tls,
            token=lambda: token,
        )
        boot = build_bootstrap(
            name,
            ControlPlaneAddress("127.0.0.1", settings.xds_port),
            sock,
            ports["admin"],
            xds_tls=XdsTls(
                settings.state_dir / "ca" / "root.pem",
                control_plane_spiffe_id(settings.trust_domain),
            ),
        )
        envoy = EnvoyProcess(name, boot, root / "envoy", ports["admin"])
        try:
            yield Sidecar(agent, source, envoy)
        finally:
            await envoy.stop()
            server.close()
            await server.wait_closed()
            sock.unlink(missing_ok=True)


async def call(session: aiohttp.ClientSession, port: int) -> tuple[int, str]:
    """One request through a workload's outbound listener; (0, error) when refused."""
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/", timeout=aiohttp.ClientTimeout(total=2)
        ) as resp:
            return resp.status, (await resp.text()).strip()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return 0, type(exc).__name__


async def until(pred: Callable[[], object], timeout_s: float, step_s: float = 0.002) -> bool:
    """Poll ``pred`` (the demo observes the system from outside, as a user would)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not pred():  # noqa: ASYNC110
                await asyncio.sleep(step_s)
        return True
    except TimeoutError:
        return False


async def until_async(check: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        return True
    except TimeoutError:
        return False


@dataclass(frozen=True, slots=True)
class DemoResult:
    exit_code: int
    timings_ms: dict[str, float]


async def run_demo(workdir: Path | None = None, *, hold: bool = False) -> int:
    return (await run_demo_measured(workdir, hold=hold)).exit_code


async def run_demo_measured(workdir: Path | None = None, *, hold: bool = False) -> DemoResult:
    """Run the demo; with ``hold`` keep the mesh running after the checks until cancelled."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 (once, at start)
        return await _demo(workdir, hold)
    with tempfile.TemporaryDirectory(prefix="attestmesh-demo-") as tmp:
        return await _demo(Path(tmp), hold)


async def _demo(root: Path, hold: bool) -> DemoResult:
    tl = Timeline()
    expect = Expectations()
    print(f"attestmesh demo (state in {root})", flush=True)
    platform = ec.generate_private_key(ec.SECP256R1())
    sim_pub = root / "sim-platform.pub.pem"
    sim_pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    tokens = {n: join_token(n) for n in NAMES}
    settings = write_config(root, ports, sim_pub, tokens)
    timings: dict[str, float] = {}
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    agent_stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        cp_task = asyncio.create_task(run_control_plane(settings, stop, ready))
        try:
            running = await asyncio.wait_for(asyncio.shield(ready), 30)
            tl.mark("control plane up (CA, SQLite state, attestation API, ADS)")
            tls = client_ssl_context(running.bundle_pem)
            sidecars = {
                n: await stack.enter_async_context(
                    sidecar(n, settings, ports[n], root, platform, tokens[n], tls)
                )
                for n in NAMES
            }
            agents = {n: sc.agent for n, sc in sidecars.items()}
            sources = {n: sc.source for n, sc in sidecars.items()}
            envoys = [sc.envoy for sc in sidecars.values()]
            async with aiohttp.ClientSession() as session:
                for n in NAMES:
                    t0 = time.perf_counter()
                    cert = await agents[n].attest_once(session)
                    tl.mark(
                        f"{n} attested and issued {cert.spiffe_id} (serial {cert.serial:x}, "
                        f"{(time.perf_counter() - t0) * 1000:.1f} ms round trip)"
                    )
            issuance = running.metrics.issuance_seconds
            samples = {s.name: s.value for m in issuance.collect() for s in m.samples}
            mean_ms = (
                samples["attestmesh_issuance_seconds_sum"]
                / samples["attestmesh_issuance_seconds_count"]
                * 1000
            )
            tl.mark(f"mean control-plane issuance latency {mean_ms:.2f} ms")
            agent_tasks = [asyncio.create_task(a.run(agent_stop)) for a in agents.values()]
            for a in agents.values():
                a.attest_now.clear()
            await asyncio.gather(*(e.start() for e in envoys))
            await asyncio.gather(*(e.wait_ready() for e in envoys))
            tl.mark("both Envoys configured over ADS + SDS and ready")
            async with aiohttp.ClientSession() as session:
                fe_to_be = ports["frontend"]["outbound"]
                be_to_fe = ports["backend"]["outbound"]
                last: tuple[int, str] = (0, "")

                async def fe_ok() -> bool:
                    nonlocal last
                    last = await call(session, fe_to_be)
                    return last[0] == 200

                ok = await until_async(fe_ok, 15)
                t_first = tl.mark(f"first frontend -> backend request over attested mTLS: {last}")
                expect.check(
                    "frontend -> backend succeeds over mutually attested mTLS",
                    ok and last[1] == "hello from backend",
                )
                status, body = await call(session, be_to_fe)
                expect.check(
                    "backend -> frontend succeeds over mutually attested mTLS",
                    status == 200 and body == "hello from frontend",
                )
                print(
                    "\nbackend's image is tampered: its next re-attestation presents measurement "
                    f"{TAMPERED.hex()[:16]}..., which policy does not allow\n",
                    flush=True,
                )
                sources["backend"].measurement = TAMPERED
                cp = running.cp
                t_tamper = tl.mark("backend re-attests now with tampered evidence")
                agents["backend"].attest_now.set()
                decided = await until(
                    lambda: cp.state.get("backend").status is Status.QUARANTINED, 10, 0.0005
                )
                t_decision = tl.mark("control plane decision: backend QUARANTINED")
                q = cp.state.get("backend").quarantine
                expect.check(
                    f"backend quarantined: {q.reason[:70] if q else None}...",
                    decided and q is not None and "measurement_not_allowed" in q.reason,
                )

                async def fe_refused() -> bool:
                    return (await call(session, fe_to_be))[0] != 200

                async def be_refused() -> bool:
                    return (await call(session, be_to_fe))[0] != 200

                r1 = await until_async(fe_refused, 10)
                t_r1 = tl.mark(f"frontend -> backend refused: {await call(session, fe_to_be)}")
                r2 = await until_async(be_refused, 10)
                t_r2 = tl.mark(f"backend -> frontend refused: {await call(session, be_to_fe)}")
                expect.check("frontend's requests to backend fail", r1)
                expect.check("backend's requests to frontend fail", r2)
                crl = x509.load_pem_x509_crl(cp.trust.crl_pem)
                serial = agents["backend"].current.serial if agents["backend"].current else -1
                expect.check(
                    "backend's certificate serial is in the CRL every peer validates against",
                    crl.get_revoked_certificate_by_serial_number(serial) is not None,
                )
                await asyncio.sleep(0.5)
                still = await call(session, fe_to_be)
                expect.check(f"frontend -> backend stays refused ({still})", still[0] != 200)
                print("\nTimeline (ms)", flush=True)
                timings = {
                    "start_to_first_mtls_request": t_first,
                    "reattestation_to_decision": t_decision - t_tamper,
                    "decision_to_frontend_refused": t_r1 - t_decision,
                    "decision_to_backend_refused": t_r2 - t_decision,
                }
                print(f"  start -> first mTLS request          {t_first:9.1f}")
                print(f"  tampered re-attestation -> decision  {t_decision - t_tamper:9.1f}")
                print(f"  decision -> frontend->backend refused {t_r1 - t_decision:8.1f}")
                print(f"  decision -> backend->frontend refused {t_r2 - t_decision:8.1f}")
            if hold:
                print(
                    f"\nholding the mesh (state in {root}; ops http://127.0.0.1:"
                    f"{settings.ops_port}/v1/admin/workloads, frontend's outbound to backend "
                    f"http://127.0.0.1:{ports['frontend']['outbound']}/). Ctrl-C stops it.",
                    flush=True,
                )
                await asyncio.Event().wait()
            agent_stop.set()
            await asyncio.gather(*agent_tasks, return_exceptions=True)
        finally:
            agent_stop.set()
            await stack.aclose()  # sidecars: Envoys, SDS servers, apps
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(cp_task, 10)
    print(
        f"\n{'ALL EXPECTATIONS HELD' if expect.all_held else 'SOME EXPECTATIONS FAILED'}",
        flush=True,
    )
    return DemoResult(0 if expect.all_held else 1, timings)
