"""The ADS server over real HTTP/2 gRPC (both transports: ads_transport) with a fake Envoy that
asserts protocol invariants on every response: type URL, fresh nonce, version, resource types."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpclib.const
import pytest
from grpclib.client import Stream
from grpclib.exceptions import GRPCError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from tests.component.ads_transport import TRANSPORT, TRANSPORTS, ads_channel
from tests.unit.xds.meshfixture import NOW, TRUST, allow, two_workloads
from xds.build import Packer, Snapshot, TrustMaterial, build_snapshot
from xds.cache import SnapshotCache
from xds.resources import ADS_SERVICE, TypeUrl
from xds.server import AdsServer, warm
from xds.state import MeshState, Trigger, quarantine

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
    from envoy_data_plane.google.rpc import Status as RpcStatus

POLICIES = [allow("backend", "frontend"), allow("frontend", "backend")]
METHOD = f"/{ADS_SERVICE}/StreamAggregatedResources"


def snap(state: MeshState, node: str = "frontend", trust: TrustMaterial = TRUST) -> Snapshot:
    return build_snapshot(state, node, POLICIES, trust, packer=Packer())


class FakeEnvoy:
    """Speaks ADS like Envoy and checks every response it receives."""

    def __init__(self, stream: Stream[DiscoveryRequest, DiscoveryResponse], node: str) -> None:
        self.stream = stream
        self.node = node
        self.nonces: set[str] = set()
        self.last: dict[str, DiscoveryResponse] = {}
        self.first = True

    async def send(
        self,
        type_url: TypeUrl,
        names: list[str] | None = None,
        *,
        ack: DiscoveryResponse | None = None,
        version: str | None = None,
        nonce: str | None = None,
        error: str | None = None,
    ) -> None:
        req = DiscoveryRequest(
            type_url=type_url,
            resource_names=names or [],
            version_info=version if version is not None else (ack.version_info if ack else ""),
            response_nonce=nonce if nonce is not None else (ack.nonce if ack else ""),
            error_detail=RpcStatus(code=13, message=error) if error else None,
            node=Node(id=self.node) if self.first else None,
        )
        self.first = False
        await self.stream.send_message(req)

    async def recv(self, within: float = 2.0) -> DiscoveryResponse:
        async with asyncio.timeout(within):
            resp = await self.stream.recv_message()
        assert resp is not None
        assert resp.type_url in {t.value for t in TypeUrl}
        assert resp.nonce and resp.nonce not in self.nonces, "nonces are fresh"
        self.nonces.add(resp.nonce)
        assert resp.version_info, "every response is versioned"
        assert all(r.type_url == resp.type_url for r in resp.resources)
        self.last[resp.type_url] = resp
        return resp

    async def silent(self, within: float = 0.15) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(within):
                extra = await self.stream.recv_message()
                raise AssertionError(f"unexpected response {extra}")


@asynccontextmanager
async def envoy(
    cache: SnapshotCache, metrics: Metrics, node: str = "frontend"
) -> AsyncIterator[FakeEnvoy]:
    async with (
        ads_channel(AdsServer(cache, metrics)) as channel,
        channel.request(
            METHOD, grpclib.const.Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
        ) as stream,
    ):
        yield FakeEnvoy(stream, node)
        await stream.end()


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm()


@pytest.fixture(params=TRANSPORTS, autouse=True)
def _transport(request: pytest.FixtureRequest) -> None:
    TRANSPORT.name = request.param


def names(resp: DiscoveryResponse) -> list[str]:
    out = []
    for r in resp.resources:
        msg: Any = r.unpack()
        out.append(getattr(msg, "name", None) or msg.cluster_name)
    return sorted(out)


async def test_wildcard_cds_then_ack_is_quiet() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    s = snap(two_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, metrics) as e:
        await e.send(TypeUrl.CLUSTER)
        cds = await e.recv()
        assert cds.type_url == TypeUrl.CLUSTER
        assert cds.version_info == s.version(TypeUrl.CLUSTER)
        assert names(cds) == ["inbound|app", "out|backend"]
        assert metrics.xds_streams._value.get() == 1
        await e.send(TypeUrl.CLUSTER, ack=cds)
        await e.silent()
    assert (
        metrics.registry.get_sample_value("attestmesh_xds_push_ack_seconds_count", {"type": "cds"})
        == 1
    )
    await asyncio.sleep(0.05)
    assert metrics.xds_streams._value.get() == 0


async def test_waits_for_a_snapshot_then_answers() -> None:
    cache = SnapshotCache()
    async with envoy(cache, Metrics()) as e:
        await e.send(TypeUrl.LISTENER)
        await e.silent()
        cache.set_snapshot("frontend", snap(two_workloads()))
        assert names(await e.recv()) == ["inbound", "out|backend"]


async def test_named_types_follow_subscription_changes() -> None:
    """Envoy subscribes SDS names incrementally before any response: each change is answered."""
    cache = SnapshotCache()
    cache.set_snapshot("frontend", snap(two_workloads()))
    async with envoy(cache, Metrics()) as e:
        await e.send(TypeUrl.SECRET, ["unknown"])
        first = await e.recv()
        assert first.resources == []
        await e.send(TypeUrl.SECRET, ["unknown", "mesh-trust"])  # no ACK in between
        second = await e.recv()
        assert names(second) == ["mesh-trust"]
        await e.send(TypeUrl.SECRET, ["unknown", "mesh-trust"], ack=second)
        await e.silent()


async def test_nack_is_counted_and_not_retried() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    cache.set_snapshot("frontend", snap(two_workloads()))
    async with envoy(cache, metrics) as e:
        await e.send(TypeUrl.CLUSTER)
        cds = await e.recv()
        await e.send(TypeUrl.CLUSTER, version="", nonce=cds.nonce, error="bad cluster")
        await e.silent()
        # a later ACK repeating a stale error_detail with the accepted version is not a NACK
        await e.send(TypeUrl.CLUSTER, ack=cds, error="bad cluster")
        await e.silent()
    nacks = metrics.registry.get_sample_value("attestmesh_xds_nacks_total", {"type": "cds"})
    assert nacks == 1


async def test_eds_answered_again_after_cds_even_when_it_looks_like_an_ack() -> None:
    cache = SnapshotCache()
    state = two_workloads()
    cache.set_snapshot("frontend", snap(state))
    async with envoy(cache, Metrics()) as e:
        await e.send(TypeUrl.CLUSTER)
        cds = await e.recv()
        await e.send(TypeUrl.CLUSTER, ack=cds)
        await e.send(TypeUrl.ENDPOINT, ["out|backend"])
        eds = await e.recv()
        await e.send(TypeUrl.ENDPOINT, ["out|backend"], ack=eds)
        await e.silent()
        # CDS changes only (a new trust domain peer set): the SAN pin of out|backend moves
        state2, _ = quarantine(state, "backend", Trigger.OPERATOR, "t", NOW)
        s2 = snap(state2)
        cache.set_snapshot("frontend", s2)
        got = [await e.recv(), await e.recv()]
        assert [r.type_url for r in got][:2] == [TypeUrl.CLUSTER, TypeUrl.ENDPOINT]
        # Envoy re-requests EDS with the OLD nonce/version while the cluster warms
        await e.send(TypeUrl.ENDPOINT, ["out|backend"], ack=eds)
        again = await e.recv()
        assert again.type_url == TypeUrl.ENDPOINT
        assert again.version_info == got[1].version_info


async def test_ads_order_for_a_change_of_every_type() -> None:
    cache = SnapshotCache()
    state = two_workloads()
    cache.set_snapshot("frontend", snap(state))
    async with envoy(cache, Metrics()) as e:
        subs = {
            TypeUrl.CLUSTER: None,
            TypeUrl.ENDPOINT: ["out|backend"],
            TypeUrl.LISTENER: None,
            TypeUrl.ROUTE: ["inbound"],
            TypeUrl.SECRET: ["mesh-trust"],
        }
        for t, n in subs.items():
            await e.send(t, n)
            await e.send(t, n, ack=await e.recv())
        await e.silent()
        # every type changes at once: new trust, quarantined peer, new listener port
        state2, _ = quarantine(state, "backend", Trigger.OPERATOR, "t", NOW)
        cache.set_snapshot("frontend", snap(state2, trust=TrustMaterial(b"other", b"")))
        order = [(await e.recv()).type_url for _ in range(4)]
        assert order == [TypeUrl.SECRET, TypeUrl.CLUSTER, TypeUrl.ENDPOINT, TypeUrl.ROUTE]


async def test_node_id_is_required() -> None:
    with pytest.raises(GRPCError) as info:
        async with envoy(SnapshotCache(), Metrics(), node="") as e:
            await e.send(TypeUrl.CLUSTER)
            await e.recv()
    assert info.value.status is grpclib.const.Status.INVALID_ARGUMENT


async def test_many_streams_one_snapshot_push() -> None:
    cache = SnapshotCache()
    s = snap(two_workloads())
    cache.set_snapshot("frontend", s)
    metrics = Metrics()
    async with envoy(cache, metrics) as a, envoy(cache, metrics) as b:
        for e in (a, b):
            await e.send(TypeUrl.LISTENER)
            await e.send(TypeUrl.LISTENER, ack=await e.recv())
        assert cache.watching("frontend") == 2
        cache.set_snapshot("frontend", snap(two_workloads(), trust=TrustMaterial(b"x")))
        await a.silent()  # listeners did not change: nothing to send
        await b.silent()
