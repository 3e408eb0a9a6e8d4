"""Real Envoys on delta (incremental) ADS, the sidecar bootstrap's default: configured, serving
SPIFFE mTLS, taking membership changes with ACKs, NACKing a bad resource while the server keeps
serving, warming an updated EDS cluster without waiting for a timeout, and reconnecting to a
restarted control plane with the versions they hold.

Two workloads, frontend and backend, each an aiohttp app behind its own Envoy with its own
local SDS; the control plane is in-process (:func:`start_ads`) or, to be killed and restarted,
a process of its own (``tests/integration/ads_process.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority
from sidecar.bootstrap import ControlPlaneAddress, XdsProtocol, build_bootstrap
from sidecar.sds import LocalSds, start_sds
from tests.integration.ads_process import dump_snapshots
from tests.integration.envoy_harness import EnvoyProcess, free_port, run_envoy
from tests.integration.test_envoy_mtls import (
    NOW,
    TD,
    Credential,
    _app,
    allow,
    get,
    issue,
    wait_for_200,
    wait_for_status,
)
from tests.polling import until_awaited as eventually
from xds import pb
from xds.build import Packer, Snapshot, TrustMaterial, build_snapshots
from xds.cache import SnapshotCache
from xds.meshpolicy import MeshPolicy
from xds.resources import TypeUrl
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

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.cluster.v3 import Cluster
    from envoy_data_plane.google.protobuf import Any as AnyMsg

pytestmark = pytest.mark.integration

UPDATE_STATS = {
    "cds": "cluster_manager.cds",
    "lds": "listener_manager.lds",
    "eds": "cluster.out|backend",
    "rds": "http.inbound.rds.inbound",
    "sds": "sds.mesh-trust",
}


@dataclass
class DeltaMesh:
    ca: CertificateAuthority
    state: MeshState
    policies: list[MeshPolicy]
    regs: dict[str, Registration]
    creds: dict[str, Credential]
    cache: SnapshotCache = field(default_factory=SnapshotCache)
    metrics: Metrics = field(default_factory=Metrics)
    packer: Packer = field(default_factory=Packer)
    envoys: dict[str, EnvoyProcess] = field(default_factory=dict)
    xds_port: int = 0

    def trust(self) -> TrustMaterial:
        revoked = [(r.serial, r.revoked_at) for r in self.state.revocations]
        return TrustMaterial(self.ca.bundle_pem, self.ca.crl_pem(revoked, NOW, timedelta(hours=1)))

    def snapshots(self) -> dict[str, Snapshot]:
        return build_snapshots(self.state, self.policies, self.trust(), packer=self.packer)

    def publish(self) -> float:
        snaps = self.snapshots()
        t = time.monotonic()
        self.cache.set_snapshots(snaps)
        return t

    def url(self, caller: str, service: str, path: str = "/hello") -> str:
        """Through ``caller``'s Envoy (its outbound listener for ``service``)."""
        return f"http://127.0.0.1:{self.regs[caller].outbound[service]}{path}"

    def sample(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def acks(self, short: str) -> float:
        return self.sample("attestmesh_xds_push_ack_seconds_count", {"type": short})

    def nacks(self, short: str) -> float:
        return self.sample("attestmesh_xds_nacks_total", {"type": short})


def _mesh(ca: CertificateAuthority) -> DeltaMesh:
    ports = {n: (free_port(), free_port(), free_port()) for n in ("frontend", "backend")}
    other = {"frontend": "backend", "backend": "frontend"}
    regs = {
        name: Registration(
            name,
            "default",
            name,
            name,
            Endpoint("127.0.0.1", ports[name][0]),
            ports[name][1],
            {other[name]: ports[name][2]},
        )
        for name in ("frontend", "backend")
    }
    state = MeshState(TD)
    creds = {}
    for serial, (name, reg) in enumerate(sorted(regs.items()), start=100):
        creds[name] = cred = issue(ca, reg.spiffe_id(TD), serial)
        state, _ = register(state, reg, NOW)
        state, _ = record_attestation(
            state,
            name,
            AttestationRecord("sim", {}, "test", "00", NOW),
            IssuedCert(serial, cred.not_after),
            NOW + timedelta(hours=1),
            NOW,
        )
    return DeltaMesh(
        ca, state, [allow("backend", "frontend"), allow("frontend", "backend")], regs, creds
    )


async def _sidecars(
    m: DeltaMesh, stack: AsyncExitStack, tmp: Path, protocol: XdsProtocol | None = None
) -> None:
    sockdir = Path(tempfile.mkdtemp(prefix="am-", dir="/tmp"))  # Unix paths must stay short
    stack.callback(shutil.rmtree, sockdir, True)
    for name, reg in m.regs.items():
        await _app(name, reg.app_port, stack)
        sds = LocalSds()
        sds.update(m.creds[name].chain_pem, m.creds[name].key_pem)
        sock = sockdir / f"{name[:2]}.sock"
        sds_server = await start_sds(sds, sock)
        stack.push_async_callback(sds_server.wait_closed)
        stack.callback(sds_server.close)
        admin = free_port()
        address = ControlPlaneAddress("127.0.0.1", m.xds_port)
        if protocol is None:
            boot = build_bootstrap(name, address, sock, admin)
            assert boot["dynamic_resources"]["ads_config"]["api_type"] == "DELTA_GRPC"  # default
        else:
            boot = build_bootstrap(name, address, sock, admin, xds_protocol=protocol)
        m.envoys[name] = await stack.enter_async_context(
            run_envoy(name, boot, tmp, admin, log_level="info")
        )
    async with aiohttp.ClientSession() as s:
        await wait_for_200(s, m.url("frontend", "backend"))
        await wait_for_200(s, m.url("backend", "frontend"))


@asynccontextmanager
async def _in_process(tmp: Path, protocol: XdsProtocol | None = None) -> AsyncIterator[DeltaMesh]:
    async with AsyncExitStack() as stack:
        m = _mesh(CertificateAuthority.load_or_create(tmp / "ca", TD, NOW))
        m.publish()
        m.xds_port = free_port()
        server, _ = await start_ads(m.cache, "127.0.0.1", m.xds_port, m.metrics)
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        await _sidecars(m, stack, tmp, protocol)
        yield m


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[DeltaMesh]:
    """Both Envoys configured over delta ADS by an in-process control plane."""
    async with _in_process(tmp_path) as m:
        yield m


async def stat(envoy: EnvoyProcess, name: str) -> int:
    return (await envoy.stats(name)).get(name, 0)


async def test_configured_over_delta_serves_mtls(mesh: DeltaMesh) -> None:
    async with aiohttp.ClientSession() as s:
        assert await get(s, mesh.url("frontend", "backend")) == (200, "backend GET /hello")
        assert await get(s, mesh.url("backend", "frontend", "/x")) == (200, "frontend GET /x")
    for name, envoy in mesh.envoys.items():
        assert await stat(envoy, "control_plane.connected_state") == 1
        dump = await envoy.config_dump()
        assert '"api_type": "DELTA_GRPC"' in str(dump).replace("'", '"')
        for short, prefix in UPDATE_STATS.items():
            if short == "eds":
                prefix = f"cluster.out|{'backend' if name == 'frontend' else 'frontend'}"
            assert await stat(envoy, f"{prefix}.update_success") >= 1, (name, short)
            assert await stat(envoy, f"{prefix}.update_rejected") == 0, (name, short)
        # the hop was mutual TLS, verified against the SPIFFE ID the control plane pinned
        assert await envoy.stat_sum("ssl.handshake") >= 1
    for short in UPDATE_STATS:
        assert mesh.acks(short) >= 2, short  # both Envoys ACKed every type
        assert mesh.nacks(short) == 0


async def test_membership_change_reaches_envoy_and_is_acked(mesh: DeltaMesh) -> None:
    fe = mesh.envoys["frontend"]
    eds_before = await stat(fe, "cluster.out|backend.update_success")
    acks_before = mesh.acks("eds")
    async with aiohttp.ClientSession() as s:
        assert (await get(s, mesh.url("frontend", "backend")))[0] == 200
        mesh.state, _ = quarantine(mesh.state, "backend", Trigger.OPERATOR, "test", NOW)
        pushed = mesh.publish()
        await wait_for_status(s, mesh.url("frontend", "backend"), 503)  # no endpoint left
        refused_ms = (time.monotonic() - pushed) * 1000

    async def acked() -> bool:
        return mesh.acks("eds") >= acks_before + 2  # both Envoys ACKed their EDS change

    await eventually(acked)
    assert await stat(fe, "cluster.out|backend.update_success") > eds_before
    assert await stat(fe, "cluster_manager.warming_clusters") == 0
    for short, prefix in UPDATE_STATS.items():
        assert await stat(fe, f"{prefix}.update_rejected") == 0, short
    print(f"\ndelta: quarantine push -> frontend refused in {refused_ms:.1f} ms")


async def test_state_of_the_world_stays_served_beside_delta(tmp_path: Path) -> None:
    """``--xds-protocol sotw``: the same server configures Envoys over SotW ADS too."""
    async with _in_process(tmp_path, XdsProtocol.SOTW) as m, aiohttp.ClientSession() as s:
        fe = m.envoys["frontend"]
        assert '"api_type": "GRPC"' in str(await fe.config_dump()).replace("'", '"')
        assert (await get(s, m.url("frontend", "backend")))[0] == 200
        m.state, _ = quarantine(m.state, "backend", Trigger.OPERATOR, "test", NOW)
        m.publish()
        await wait_for_status(s, m.url("frontend", "backend"), 503)
        for prefix in UPDATE_STATS.values():
            assert await stat(fe, f"{prefix}.update_rejected") == 0
        assert m.nacks("cds") == m.nacks("eds") == 0


async def test_updated_eds_cluster_warms_without_waiting_for_a_timeout(mesh: DeltaMesh) -> None:
    """A CDS change of an EDS cluster (endpoints unchanged): Envoy does not ask for the EDS
    resource again; the server sends it, so the cluster warms at once and CDS is ACKed (a
    silent server would leave it warming for initial_fetch_timeout, 15 s)."""
    fe = mesh.envoys["frontend"]
    s = mesh.cache.get("frontend")
    assert s is not None
    cds_before = await stat(fe, "cluster_manager.cds.update_success")
    cluster: Any = AnyMsg.parse(s.get(TypeUrl.CLUSTER)["out|backend"]).unpack()
    slower = Cluster.from_dict({**cluster.to_dict(), "connectTimeout": "2.500s"})
    resources = {t: dict(s.get(t)) for t in TypeUrl}
    resources[TypeUrl.CLUSTER]["out|backend"] = pb.pack(slower, TypeUrl.CLUSTER)
    t0 = time.monotonic()
    mesh.cache.set_snapshot("frontend", Snapshot.of(resources, s.references))

    async def warmed() -> bool:
        return (
            await stat(fe, "cluster_manager.cds.update_success") > cds_before
            and await stat(fe, "cluster_manager.warming_clusters") == 0
        )

    await eventually(warmed, within=2.0)
    print(f"\ndelta: updated EDS cluster warm in {(time.monotonic() - t0) * 1000:.1f} ms")
    dump = str(await fe.config_dump())
    assert "2.500s" in dump
    async with aiohttp.ClientSession() as session:
        assert (await get(session, mesh.url("frontend", "backend")))[0] == 200


async def test_invalid_resource_is_nacked_and_the_server_keeps_serving(mesh: DeltaMesh) -> None:
    fe = mesh.envoys["frontend"]
    s = mesh.cache.get("frontend")
    assert s is not None
    resources = {t: dict(s.get(t)) for t in TypeUrl}
    bad = Cluster(name="bad", connect_timeout=timedelta(seconds=-1))  # Envoy requires > 0
    resources[TypeUrl.CLUSTER]["bad"] = pb.pack(bad, TypeUrl.CLUSTER)
    mesh.cache.set_snapshot("frontend", Snapshot.of(resources, s.references))

    async def rejected() -> bool:
        return mesh.nacks("cds") == 1 and (
            await stat(fe, "cluster_manager.cds.update_rejected") == 1
        )

    await eventually(rejected)
    assert await stat(fe, "control_plane.connected_state") == 1
    async with aiohttp.ClientSession() as session:
        # Envoy kept its configuration
        assert (await get(session, mesh.url("frontend", "backend")))[0] == 200
        # and the stream keeps serving: a later change reaches both Envoys and is ACKed
        acks = mesh.acks("eds")
        mesh.state, _ = quarantine(mesh.state, "backend", Trigger.OPERATOR, "test", NOW)
        mesh.publish()
        await wait_for_status(session, mesh.url("frontend", "backend"), 503)

    async def acked() -> bool:
        return mesh.acks("eds") >= acks + 2

    await eventually(acked)
    await asyncio.sleep(0.5)
    # rejected once, never resent in a loop
    assert mesh.nacks("cds") == 1
    assert await stat(fe, "cluster_manager.cds.update_rejected") == 1
    clusters = await fe.cluster_names()
    assert "bad" not in clusters
    assert clusters & set(s.get(TypeUrl.CLUSTER)), clusters  # the names are really read


# ---------------------------------------------------------------------------------------------
# a control plane that is killed and restarted


class AdsChild:
    """``tests.integration.ads_process`` serving the snapshots in ``path`` on ``port``."""

    def __init__(self, path: Path, port: int, log: Path) -> None:
        self.path, self.port, self.log = path, port, log
        self.proc: asyncio.subprocess.Process | None = None
        self.snapshots: dict[str, Snapshot] = {}

    async def start(self, snapshots: Mapping[str, Snapshot] | None = None) -> None:
        """Serve ``snapshots`` (None: the same bytes as last time)."""
        if snapshots is not None:
            self.snapshots = dict(snapshots)
            dump_snapshots(snapshots, self.path)
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.integration.ads_process", str(self.path),
                str(self.port), stdout=asyncio.subprocess.PIPE, stderr=log,
                cwd=Path(__file__).resolve().parents[2],
            )  # fmt: skip
        assert self.proc.stdout is not None
        async with asyncio.timeout(30):
            line = await self.proc.stdout.readline()
        assert line.strip() == b"READY", self.log.read_text()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def restartable(tmp_path: Path) -> AsyncIterator[tuple[DeltaMesh, AdsChild]]:
    async with AsyncExitStack() as stack:
        m = _mesh(CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW))
        m.xds_port = free_port()
        child = AdsChild(tmp_path / "snapshots.json", m.xds_port, tmp_path / "ads.log")
        await child.start(m.snapshots())
        stack.push_async_callback(child.kill)
        await _sidecars(m, stack, tmp_path)
        yield m, child


async def reconnected(envoy: EnvoyProcess, within: float = 20.0) -> None:
    async def connected() -> bool:
        with contextlib.suppress(aiohttp.ClientError):
            return await stat(envoy, "control_plane.connected_state") == 1
        return False

    await eventually(connected, within)


def counters(stats: Mapping[str, int]) -> dict[str, int]:
    """Per-subscription counters of responses Envoy applied or rejected (``update_attempt``
    also counts stream retries, so it says nothing about what was sent)."""
    return {
        k: v
        for k, v in stats.items()
        if k.endswith((".update_success", ".update_rejected"))
        and "sds.workload-cert" not in k  # the local SDS, not the control plane
    }


async def test_reconnect_to_a_restarted_control_plane_with_initial_versions(
    restartable: tuple[DeltaMesh, AdsChild],
) -> None:
    m, child = restartable
    envoys = m.envoys.values()
    async with aiohttp.ClientSession() as session:
        # 1. killed and restarted with the same configuration: the new process knows nothing
        # but what each Envoy tells it; it resends nothing they hold
        await child.kill()
        for envoy in envoys:

            async def lost(envoy: EnvoyProcess = envoy) -> bool:
                return await stat(envoy, "control_plane.connected_state") == 0

            await eventually(lost)
        assert (await get(session, m.url("frontend", "backend")))[0] == 200  # Envoy keeps serving
        before = {e.name: counters(await e.stats()) for e in envoys}
        await child.start()  # the same bytes (a rebuilt CRL would be new bytes: signed anew)
        for envoy in envoys:
            await reconnected(envoy)
        await asyncio.sleep(1.0)  # room for anything the server might (wrongly) resend
        for envoy in envoys:
            after = counters(await envoy.stats())
            grown = {k: after[k] - before[envoy.name].get(k, 0) for k in after}
            grown = {k: v for k, v in grown.items() if v}
            # only the two wildcard types get an (empty) answer; EDS, RDS, SDS: nothing at all
            wildcards = {f"{UPDATE_STATS[t]}.update_success" for t in ("cds", "lds")}
            assert set(grown) <= wildcards, (envoy.name, grown)
        assert (await get(session, m.url("frontend", "backend")))[0] == 200

        # 2. restarted with frontend's backend cluster changed (its endpoints not): the
        # reconnecting Envoy holds those endpoints, yet the updated cluster warms at once
        await child.kill()
        fe = m.envoys["frontend"]
        cds_before = await stat(fe, "cluster_manager.cds.update_success")
        s = child.snapshots["frontend"]
        cluster: Any = AnyMsg.parse(s.get(TypeUrl.CLUSTER)["out|backend"]).unpack()
        slower = Cluster.from_dict({**cluster.to_dict(), "connectTimeout": "2.500s"})
        resources = {t: dict(s.get(t)) for t in TypeUrl}
        resources[TypeUrl.CLUSTER]["out|backend"] = pb.pack(slower, TypeUrl.CLUSTER)
        await child.start({**child.snapshots, "frontend": Snapshot.of(resources, s.references)})
        await reconnected(fe)
        t0 = time.monotonic()

        async def warmed() -> bool:
            return (
                await stat(fe, "cluster_manager.cds.update_success") > cds_before
                and await stat(fe, "cluster_manager.warming_clusters") == 0
            )

        await eventually(warmed, within=5.0)  # not initial_fetch_timeout (15 s)
        print(f"\ndelta reconnect: updated cluster warm {(time.monotonic() - t0) * 1000:.0f} ms")
        assert "2.500s" in str(await fe.config_dump())

        # 3. restarted with a changed configuration (backend quarantined while it was down):
        # each Envoy ends with the new configuration, and accepts it
        await child.kill()
        m.state, _ = quarantine(m.state, "backend", Trigger.OPERATOR, "test", NOW)
        await child.start(m.snapshots())
        for envoy in envoys:
            await reconnected(envoy)
        await wait_for_status(session, m.url("frontend", "backend"), 503)
        for prefix in UPDATE_STATS.values():
            assert await stat(fe, f"{prefix}.update_rejected") == 0
        assert await stat(fe, "cluster_manager.warming_clusters") == 0
