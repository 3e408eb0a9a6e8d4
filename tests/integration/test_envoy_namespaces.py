"""Issue 8, item 1 through real Envoys: a look-alike ``web`` in namespace ``evil`` gets none of
a ``shop`` caller's ``web`` traffic.

Three workloads, each an aiohttp app answering its own name behind its own Envoy, configured
over ADS from snapshots of one mesh state (``xds.build.build_snapshots``): ``shop/web-0``
(service web in shop), ``evil/web-0`` (service web in evil: the same pod name, service account
name and service name, registered and attested) and the caller ``shop/front-0`` with outbound
``web`` and ``web.evil``. Both destinations' mesh policies admit the caller, so only the
caller's own configuration can keep it off the evil backend.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from attestmesh.metrics import Metrics
from certs.ca import CertificateAuthority
from sidecar.bootstrap import ControlPlaneAddress, build_bootstrap
from sidecar.sds import LocalSds, start_sds
from tests.integration.envoy_harness import EnvoyProcess, free_port, run_envoy, serve_app
from tests.integration.test_envoy_mtls import NOW, TD, get, issue, wait_for_200
from xds.build import TrustMaterial, build_snapshots
from xds.cache import SnapshotCache
from xds.meshpolicy import MeshPolicy, Rule, Source
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

CALLER, SHOP_WEB, EVIL_WEB = "shop/front-0", "shop/web-0", "evil/web-0"
REQUESTS = 20


@dataclass
class Mesh:
    regs: dict[str, Registration]
    envoys: dict[str, EnvoyProcess]
    served: dict[str, list[str]]  # workload -> the paths its app answered, in order

    def url(self, service: str, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.regs[CALLER].outbound[service]}{path}"


def admit(namespace: str, caller_namespace: str, caller_sa: str) -> MeshPolicy:
    """A mesh policy of ``namespace``: its service account web admits the caller."""
    source = Source(namespace=caller_namespace, service_account=caller_sa)
    return MeshPolicy(f"admit-{caller_sa}", namespace, "web", (Rule((source,)),))


async def workload_app(name: str, port: int, served: list[str], stack: AsyncExitStack) -> None:
    """The workload's app: answers its own name and records every path it served."""

    async def handler(request: web.Request) -> web.Response:
        served.append(request.path)
        return web.Response(text=f"{name} {request.path}")

    await serve_app(handler, port, stack)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    sockdir = Path(tempfile.mkdtemp(prefix="am-ns-", dir="/tmp"))  # Unix paths must stay short
    async with AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, sockdir, True)
        ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW)
        ports = {n: [free_port() for _ in range(5)] for n in (CALLER, SHOP_WEB, EVIL_WEB)}

        def reg(name: str, service: str, sa: str, outbound: dict[str, int]) -> Registration:
            p = ports[name]
            ns = name.split("/")[0]
            return Registration(name, ns, sa, service, Endpoint("127.0.0.1", p[0]), p[1], outbound)

        c = ports[CALLER]
        regs = {
            SHOP_WEB: reg(SHOP_WEB, "web", "web", {}),
            # the attack: in its own namespace, a service named web, attested like the rest
            EVIL_WEB: reg(EVIL_WEB, "web", "web", {}),
            CALLER: reg(CALLER, "", "front", {"web": c[2], "web.evil": c[3]}),
        }
        state = MeshState(TD)
        creds = {}
        for serial, (name, r) in enumerate(sorted(regs.items()), start=300):
            creds[name] = cred = issue(ca, r.spiffe_id(TD), serial)
            state, _ = register(state, r, NOW)
            state, _ = record_attestation(
                state,
                name,
                AttestationRecord("sim", {}, "test", "00", NOW),
                IssuedCert(serial, cred.not_after),
                NOW + timedelta(hours=1),
                NOW,
            )
        policies = [admit("shop", "shop", "front"), admit("evil", "shop", "front")]
        trust = TrustMaterial(ca.bundle_pem, ca.crl_pem([], NOW, timedelta(hours=1)))
        cache = SnapshotCache()
        cache.set_snapshots(build_snapshots(state, policies, trust))
        server, _ = await start_ads(cache, "127.0.0.1", xds_port := free_port(), Metrics())
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)

        served: dict[str, list[str]] = {name: [] for name in regs}

        async def start(i: int, name: str) -> EnvoyProcess:
            r = regs[name]
            await workload_app(name, r.app_port, served[name], stack)
            sds = LocalSds()
            sds.update(creds[name].chain_pem, creds[name].key_pem)
            sock = sockdir / f"{i}.sock"
            sds_server = await start_sds(sds, sock)
            stack.push_async_callback(sds_server.wait_closed)
            stack.callback(sds_server.close)
            admin = ports[name][4]
            boot = build_bootstrap(name, ControlPlaneAddress("127.0.0.1", xds_port), sock, admin)
            return await stack.enter_async_context(run_envoy(f"envoy-{i}", boot, tmp_path, admin))

        envoys = {name: await start(i, name) for i, name in enumerate(regs)}
        m = Mesh(regs, envoys, served)
        async with aiohttp.ClientSession() as s:
            await wait_for_200(s, m.url("web", "/warm"))
            await wait_for_200(s, m.url("web.evil", "/warm"))
        yield m


async def test_caller_web_never_lands_on_the_look_alike_in_evil(mesh: Mesh) -> None:
    answers: list[str] = []
    async with aiohttp.ClientSession() as s:
        for i in range(REQUESTS):
            # a fresh connection each time: every request is a new load-balancing decision
            async with s.get(
                mesh.url("web", f"/r{i}"),
                headers={"Connection": "close"},
                timeout=aiohttp.ClientTimeout(total=3),
            ) as resp:
                assert resp.status == 200
                answers.append(await resp.text())
        assert answers == [f"{SHOP_WEB} /r{i}" for i in range(REQUESTS)]
        # the evil backend is up and admits this caller: named explicitly, it answers
        assert await get(s, mesh.url("web.evil", "/x")) == (200, f"{EVIL_WEB} /x")
    # the evil app never saw one of the twenty; shop's saw them all
    assert mesh.served[EVIL_WEB] == ["/warm", "/x"]
    assert mesh.served[SHOP_WEB] == ["/warm", *(f"/r{i}" for i in range(REQUESTS))]
    # what the caller's Envoy holds: "web" has shop's endpoint only and pins shop's identity
    clusters = await caller_clusters(mesh)
    assert clusters["out|web"] == {mesh.regs[SHOP_WEB].inbound.port}
    assert clusters["out|web.evil"] == {mesh.regs[EVIL_WEB].inbound.port}
    assert await caller_pins(mesh) == {
        "out|web": [f"spiffe://{TD}/ns/shop/sa/web"],
        "out|web.evil": [f"spiffe://{TD}/ns/evil/sa/web"],
    }


async def caller_clusters(mesh: Mesh) -> dict[str, set[int]]:
    """Cluster -> the ports of the hosts the caller's Envoy holds for it (admin ``/clusters``)."""
    _, text = await mesh.envoys[CALLER].get("/clusters?format=json")
    out: dict[str, set[int]] = {}
    for status in json.loads(text).get("cluster_statuses", []):
        if not status["name"].startswith("out|"):
            continue  # the local app, the SDS and xDS clusters
        out[status["name"]] = {
            h["address"]["socket_address"]["port_value"] for h in status.get("host_statuses", [])
        }
    return out


async def caller_pins(mesh: Mesh) -> dict[str, list[str]]:
    """Outbound cluster -> the SPIFFE IDs the caller's Envoy accepts from its upstreams."""
    dump = await mesh.envoys[CALLER].config_dump()
    out: dict[str, list[str]] = {}
    for section in dump["configs"]:
        for entry in section.get("dynamic_active_clusters", []):
            cluster = entry["cluster"]
            if not cluster["name"].startswith("out|"):
                continue
            ctx = cluster["transport_socket"]["typed_config"]["common_tls_context"]
            default = ctx["combined_validation_context"]["default_validation_context"]
            out[cluster["name"]] = sorted(
                m["matcher"]["exact"] for m in default["match_typed_subject_alt_names"]
            )
    return out
