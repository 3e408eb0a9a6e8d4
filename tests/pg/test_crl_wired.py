"""The one CRL set wired into real ``attestmesh controlplane`` replicas on one PostgreSQL
database (issue 9: "CRL refresh done once (leader), never twice"): a quarantine committed on
the follower reaches the CRL set both replicas serve, signed by the leader only (the follower's
signature count on /metrics stays 0); a burst of quarantines costs a bounded number of
signatures; once the leader is killed the survivor leads and signs."""

from __future__ import annotations

import asyncio
import re
import secrets
import statistics
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509

from attestmesh.controlplane import AttestationLimiter, ControlPlane
from attestmesh.controlplane.service import CRL_VALIDITY
from attestmesh.demo import GOOD
from attestmesh.metrics import Metrics
from attestmesh.replication import CrlSigner
from attestmesh.serve import ControlPlaneSettings, ops_token_path
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority
from certs.evidence import sim
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier
from certs.issuance import AttestRequest
from certs.policy import parse_policies
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from tests.component.test_agent import RecordingSink
from tests.pg.processes import Mesh, healthy, start, stop_all, write_mesh
from tests.pg.replicas import PLATFORM
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    TRUST_DOMAIN,
    Clock,
    RecordingPublisher,
    csr_pem,
    new_key,
    policy_doc,
    registration,
    spki,
)
from xds.state import Trigger
from xds.store_pg import Leadership, follow, open_store

pytestmark = pytest.mark.integration

WORKLOADS = 12
BURST = 8
# the CrlSigner's defaults (settle 0.05 s, at most one signature per 0.25 s, a poll each
# 0.5 s): from a commit to the leader's stored set is at most min_interval + poll; the follower
# follows on the store's notification (one more settle); a loaded 2-core machine gets slack
REACH_BOUND_S = 3.0
END = b"-----END X509 CRL-----"


def revoked_serials(crl_set: str) -> set[int]:
    """Every serial any CRL of the set lists (one CRL per live intermediate)."""
    out: set[int] = set()
    for part in crl_set.encode().split(END)[:-1]:
        crl = x509.load_pem_x509_crl(part.strip() + b"\n" + END + b"\n")
        out |= {r.serial_number for r in crl}
    return out


def metric(text: str, name: str) -> float:
    """The sum over all label sets of the sample ``name`` in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


class Ops:
    def __init__(self, s: ControlPlaneSettings, session: aiohttp.ClientSession) -> None:
        self.s = s
        self.session = session
        self.token = ops_token_path(s.state_dir).read_text().strip()
        self.ssl = client_ssl_context(s.state_dir.joinpath("ca", "root.pem").read_bytes())

    async def metrics(self) -> str:
        async with self.session.get(f"http://127.0.0.1:{self.s.ops_port}/metrics") as r:
            assert r.status == 200
            return await r.text()

    async def signed(self) -> float:
        return metric(await self.metrics(), "attestmesh_crl_signed_total")

    async def followed(self) -> float:
        return metric(await self.metrics(), "attestmesh_crl_followed_total")

    async def quarantine(self, name: str) -> None:
        async with self.session.post(
            f"http://127.0.0.1:{self.s.ops_port}/v1/admin/workloads/{name}/quarantine",
            headers={"Authorization": f"Bearer {self.token}"},
            json={"reason": "test"},
        ) as r:
            assert r.status == 200, await r.text()

    async def crl(self) -> set[int]:
        url = f"https://localhost:{self.s.api_port}/v1/trust"
        async with self.session.get(url, ssl=self.ssl) as r:
            assert r.status == 200
            return revoked_serials((await r.json())["crl"])


async def attest_all(mesh: Mesh, url: str, names: list[str]) -> dict[str, int]:
    bundle = mesh.bundle()
    serials: dict[str, int] = {}
    async with aiohttp.ClientSession() as session:
        for name in names:
            agent = Agent(
                url=[url],
                workload=name,
                source=SimEvidenceSource(mesh.platform, GOOD),
                sink=RecordingSink(),
                ssl_context=client_ssl_context(bundle),
                token=lambda name=name: mesh.tokens[name],  # type: ignore[misc]
                timeout_s=10.0,
            )
            serials[name] = (await agent.attest_once(session)).serial
    return serials


async def until_listed(ops: list[Ops], serials: set[int], within: float) -> list[float]:
    """Seconds until each replica's served CRL set lists all of ``serials``."""
    t0 = time.monotonic()
    took: list[float | None] = [None] * len(ops)
    while any(t is None for t in took):
        assert time.monotonic() - t0 < within, ("not in the CRL set in time", took)
        for i, o in enumerate(ops):
            if took[i] is None and serials <= await o.crl():
                took[i] = time.monotonic() - t0
        await asyncio.sleep(0.02)
    return [t for t in took if t is not None]


async def test_the_leader_signs_the_one_crl_set_both_replicas_serve(
    tmp_path: Path, pg_url: str
) -> None:
    names = [f"w-{i:02d}" for i in range(WORKLOADS)]
    mesh = write_mesh(tmp_path, names)
    replicas = [mesh.replica(k) for k in range(2)]
    logs = [tmp_path / f"cp-{k}.log" for k in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start(replicas[0], logs[0], pg_url))  # the first: CA, leader, first CRL
        await healthy(replicas[0], procs[0], logs[0])
        procs.append(start(replicas[1], logs[1], pg_url))
        await healthy(replicas[1], procs[1], logs[1])
        serials = await attest_all(mesh, f"https://localhost:{replicas[0].api_port}", names)
        async with aiohttp.ClientSession() as session:
            leader, follower = Ops(replicas[0], session), Ops(replicas[1], session)
            assert await leader.signed() >= 1
            assert await follower.signed() == 0  # joined a running mesh: it follows
            assert await follower.followed() >= 1

            # one quarantine on the follower, each a few times: in both replicas' CRL sets
            reach: list[float] = []
            for name in names[:3]:
                await follower.quarantine(name)  # answered once committed
                took = await until_listed([leader, follower], {serials[name]}, 10)
                reach.append(max(took))  # from the commit's answer to the slower replica
                print(f"quarantine {name}: in the CRL served by leader/follower after {took}")
            assert max(reach) <= REACH_BOUND_S, reach
            assert await follower.signed() == 0

            # a burst of quarantines costs a bounded number of signatures
            burst = names[3 : 3 + BURST]
            before = await leader.signed()
            t0 = time.monotonic()
            await asyncio.gather(*(follower.quarantine(n) for n in burst))
            await until_listed([leader, follower], {serials[n] for n in burst}, 10)
            elapsed = time.monotonic() - t0
            cost = await leader.signed() - before
            print(f"burst of {BURST} quarantines: {cost:.0f} signatures in {elapsed:.2f} s")
            assert 1 <= cost <= min(BURST / 2, 2 + elapsed / 0.25), (cost, elapsed)
            assert await follower.signed() == 0

            # the leader dies: the survivor takes over and signs what it revokes
            procs[0].kill()
            procs[0].wait(10)
            last = names[-1]
            await follower.quarantine(last)
            (moved,) = await until_listed([follower], {serials[last]}, 20)
            print(f"after the leader's death: {last} in the survivor's CRL after {moved:.2f} s")
            assert await follower.signed() >= 1
            print(f"reach median {statistics.median(reach):.3f} s, max {max(reach):.3f} s")
    finally:
        stop_all(procs)


async def test_a_control_plane_signs_its_own_only_until_the_shared_set_arrives(
    pg_url: str, tmp_path: Path
) -> None:
    """In one process: a control plane whose CRL source has no set yet (a database no leader
    signed in) signs its own; once the leader's signer delivers (handed to the loop, as
    serve.py does) it serves and announces that one, and a quarantine it commits is signed by
    the signer only, not by the control plane."""
    clock = Clock(NOW)
    loop = asyncio.get_running_loop()
    store = open_store(pg_url)
    state, _ = follow(store, TRUST_DOMAIN, lambda ch: None)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, NOW)
    leadership = Leadership(pg_url, interval_seconds=0.2).start()
    publisher = RecordingPublisher()
    metrics = Metrics()
    cps: list[ControlPlane] = []
    signer = CrlSigner(
        pg_url,
        origin="test",
        leadership=leadership,
        ca=lambda: ca,
        deliver=lambda pem: loop.call_soon_threadsafe(cps[0].crl_delivered, pem),
        clock=clock,
        validity=CRL_VALIDITY,
    )
    try:
        cp = ControlPlane(
            state=state,
            store=store,
            ca=ca,
            verifiers={Tee.SIM: SimVerifier([PLATFORM.public_key()])},
            policies=parse_policies([policy_doc()]),
            mesh_policies=(),
            metrics=metrics,
            publisher=publisher,
            clock=clock,
            serials=x509.random_serial_number,
            random_bytes=secrets.token_bytes,
            limiter=AttestationLimiter(burst=1000),
            crl_source=signer,
        )
        cps.append(cp)

        def local() -> float | None:
            return metrics.registry.get_sample_value("attestmesh_crl_signed_total", {"by": "local"})

        assert local() == 1  # none shared yet: its own
        cp.register([registration("web-1")])
        await cp.flushed()
        signer.start()
        async with asyncio.timeout(10):
            while cp.trust.crl_pem != signer.current():
                await asyncio.sleep(0.02)
        assert publisher.last_trust.crl_pem == signer.current()  # announced
        key = new_key()
        nonce, _ = cp.challenge()
        evidence = sim.build_report(
            PLATFORM, report_data=expected_report_data(nonce, spki(key)), measurement=MEASUREMENT
        )
        issued = await cp.attest(AttestRequest("web-1", "sim", evidence, csr_pem(key), nonce), None)
        assert cp.quarantine("web-1", Trigger.OPERATOR, "test")
        await cp.flushed()
        async with asyncio.timeout(10):
            while issued.serial not in revoked_serials(cp.trust_json()["crl"]):
                await asyncio.sleep(0.02)
        assert issued.serial in revoked_serials(publisher.last_trust.crl_pem.decode())
        assert cp.trust.crl_pem == signer.current()
        assert local() == 1  # the quarantine was signed by the signer only
        assert signer.signed >= 2
    finally:
        signer.close()
        leadership.close()
        store.close()
