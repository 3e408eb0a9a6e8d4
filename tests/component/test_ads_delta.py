"""Delta (incremental) ADS over real HTTP/2 gRPC (both transports: ads_transport), with a fake
Envoy that asserts the protocol's invariants on every response (known type URL, fresh nonce,
unique names, a version on every resource, no name both updated and removed) and keeps the
resources it holds the way Envoy does, so tests assert on what the client ends up with."""

from __future__ import annotations

import asyncio
import logging
import ssl
import warnings
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpclib.const
import pytest
from grpclib.client import Channel, Stream
from grpclib.exceptions import GRPCError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from tests.component.ads_transport import TRANSPORT, TRANSPORTS, ads_channel
from tests.component.test_ads_mtls import ads_server, client_context
from tests.unit.xds.meshfixture import NOW, TRUST, allow, attested, reg, two_workloads
from xds import pb
from xds.build import (
    Packer,
    Snapshot,
    TrustMaterial,
    build_load_assignment,
    build_snapshot,
)
from xds.cache import SnapshotCache
from xds.resources import ADS_SERVICE, TypeUrl
from xds.server import AdsServer, DeltaSession, ResourceVersions, warm
from xds.state import MeshState, Trigger, quarantine

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.cluster.v3 import Cluster
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
    )
    from envoy_data_plane.google.protobuf import Any as AnyMsg
    from envoy_data_plane.google.rpc import Status as RpcStatus

POLICIES = [allow("backend", "frontend"), allow("frontend", "backend")]
METHOD = f"/{ADS_SERVICE}/DeltaAggregatedResources"
CDS, EDS, LDS, RDS, SDS = (
    TypeUrl.CLUSTER,
    TypeUrl.ENDPOINT,
    TypeUrl.LISTENER,
    TypeUrl.ROUTE,
    TypeUrl.SECRET,
)


def snap(state: MeshState, node: str = "frontend", trust: TrustMaterial = TRUST) -> Snapshot:
    return build_snapshot(state, node, POLICIES, trust, packer=Packer())


def three_workloads() -> MeshState:
    """frontend calls backend and cache; backend and cache call nobody."""
    state = MeshState(two_workloads().trust_domain)
    state = attested(state, reg("frontend", 15001, {"backend": 16001, "cache": 16002}), 1)
    state = attested(state, reg("backend", 15002), 2)
    return attested(state, reg("cache", 15003), 3)


def replaced(s: Snapshot, type_url: TypeUrl, **resources: bytes | None) -> Snapshot:
    """``s`` with some resources of one type replaced (None: removed); names use ``_`` for
    ``|``."""
    out = {t: dict(s.get(t)) for t in TypeUrl}
    for key, value in resources.items():
        name = key.replace("_", "|")
        if value is None:
            out[type_url].pop(name)
        else:
            out[type_url][name] = value
    # hand-made snapshots stay consistent: references follow what is left
    references = {
        t: frozenset(n for n in names if n in out[t]) for t, names in s.references.items()
    }
    return Snapshot.of(out, references)


def current(cache: SnapshotCache, node: str = "frontend") -> Snapshot:
    s = cache.get(node)
    assert s is not None
    return s


def endpoints(name: str, *ports: int) -> bytes:
    eps = [("127.0.0.1", p) for p in ports]
    return pb.pack(build_load_assignment(name, eps), EDS)


def version_of(packed: bytes) -> str:
    return ResourceVersions()(packed)


class FakeDeltaEnvoy:
    """Speaks delta ADS like Envoy and checks every response it receives."""

    def __init__(
        self, stream: Stream[DeltaDiscoveryRequest, DeltaDiscoveryResponse], node: str
    ) -> None:
        self.stream = stream
        self.node = node
        self.nonces: set[str] = set()
        self.held: dict[TypeUrl, dict[str, str]] = {t: {} for t in TypeUrl}  # name -> version
        self.first = True

    async def send(
        self,
        type_url: TypeUrl,
        subscribe: Iterable[str] = (),
        unsubscribe: Iterable[str] = (),
        *,
        nonce: str = "",
        error: str | None = None,
        initial: Mapping[str, str] | None = None,
    ) -> None:
        req = DeltaDiscoveryRequest(
            type_url=type_url,
            resource_names_subscribe=list(subscribe),
            resource_names_unsubscribe=list(unsubscribe),
            initial_resource_versions=dict(initial or {}),
            response_nonce=nonce,
            error_detail=RpcStatus(code=13, message=error) if error else None,
            node=Node(id=self.node) if self.first else None,
        )
        self.first = False
        await self.stream.send_message(req)

    async def recv(self, within: float = 2.0, *, apply: bool = True) -> DeltaDiscoveryResponse:
        async with asyncio.timeout(within):
            resp = await self.stream.recv_message()
        assert resp is not None
        type_url = TypeUrl(resp.type_url)
        assert resp.nonce and resp.nonce not in self.nonces, "nonces are fresh"
        self.nonces.add(resp.nonce)
        names = [r.name for r in resp.resources]
        assert len(names) == len(set(names)), "a name appears once per response"
        assert len(resp.removed_resources) == len(set(resp.removed_resources))
        assert not set(names) & set(resp.removed_resources)
        for r in resp.resources:
            assert r.version, "every resource is versioned"
            assert r.resource is not None and r.resource.type_url == type_url
        if apply:
            held = self.held[type_url]
            for r in resp.resources:
                held[r.name] = r.version
            for name in resp.removed_resources:
                held.pop(name, None)
        return resp

    async def ack(self, resp: DeltaDiscoveryResponse) -> None:
        await self.send(TypeUrl(resp.type_url), nonce=resp.nonce)

    async def silent(self, within: float = 0.15) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(within):
                extra = await self.stream.recv_message()
                raise AssertionError(f"unexpected response {extra}")


def expected(s: Snapshot, type_url: TypeUrl, names: Iterable[str] | None = None) -> dict[str, str]:
    available = s.get(type_url)
    chosen = available if names is None else [n for n in names if n in available]
    return {n: version_of(available[n]) for n in chosen}


def sent(resp: DeltaDiscoveryResponse) -> list[str]:
    return sorted(r.name for r in resp.resources)


@asynccontextmanager
async def envoy(
    cache: SnapshotCache, metrics: Metrics, node: str = "frontend", server: AdsServer | None = None
) -> AsyncIterator[FakeDeltaEnvoy]:
    async with (
        ads_channel(server or AdsServer(cache, metrics)) as channel,
        channel.request(
            METHOD,
            grpclib.const.Cardinality.STREAM_STREAM,
            DeltaDiscoveryRequest,
            DeltaDiscoveryResponse,
        ) as stream,
    ):
        yield FakeDeltaEnvoy(stream, node)
        await stream.end()


@pytest.fixture(scope="module", autouse=True)
def _warm() -> None:
    warm()


@pytest.fixture(params=TRANSPORTS, autouse=True)
def _transport(request: pytest.FixtureRequest) -> None:
    TRANSPORT.name = request.param


async def subscribe_all(e: FakeDeltaEnvoy, s: Snapshot) -> None:
    """Subscribe like Envoy (CDS and LDS wildcards, the rest by name) and ACK everything."""
    subs: dict[TypeUrl, list[str]] = {
        CDS: [],
        EDS: sorted(s.get(EDS)),
        SDS: sorted(s.get(SDS)),
        LDS: [],
        RDS: sorted(s.get(RDS)),
    }
    for t, names in subs.items():
        await e.send(t, names)
        await e.ack(await e.recv())
    await e.silent()
    for t in TypeUrl:
        assert e.held[t] == expected(s, t)


async def test_initial_wildcard_then_ack_is_quiet() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    s = snap(two_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, metrics) as e:
        await e.send(CDS)
        cds = await e.recv()
        assert cds.type_url == CDS
        assert cds.system_version_info == s.version(CDS)
        assert sent(cds) == ["inbound|app", "out|backend"]
        assert e.held[CDS] == expected(s, CDS)
        assert cds.removed_resources == []
        assert metrics.xds_streams._value.get() == 1
        await e.ack(cds)
        await e.silent()
        # the same snapshot published again (e.g. an unrelated node changed): nothing to send
        cache.set_snapshot("frontend", snap(two_workloads()))
        await e.silent()
    count = metrics.registry.get_sample_value(
        "attestmesh_xds_push_ack_seconds_count", {"type": "cds"}
    )
    assert count == 1
    await asyncio.sleep(0.05)
    assert metrics.xds_streams._value.get() == 0


async def test_star_is_a_wildcard_and_an_empty_wildcard_is_answered() -> None:
    """Envoy finishes initialising only once every wildcard type got a response, even an
    empty one; ``*`` subscribes to everything of a type, named or not."""
    cache = SnapshotCache()
    s = snap(two_workloads())
    cache.set_snapshot("frontend", Snapshot.of({SDS: dict(s.get(SDS))}))
    async with envoy(cache, Metrics()) as e:
        await e.send(LDS)
        empty = await e.recv()
        assert empty.resources == [] and empty.removed_resources == []
        await e.ack(empty)
        await e.send(SDS, ["*"])
        assert sent(await e.recv()) == ["mesh-trust"]
        await e.silent()


async def test_waits_for_a_snapshot_then_answers() -> None:
    cache = SnapshotCache()
    async with envoy(cache, Metrics()) as e:
        await e.send(LDS)
        await e.silent()
        cache.set_snapshot("frontend", snap(two_workloads()))
        assert sent(await e.recv()) == ["inbound", "out|backend"]


async def test_named_subscribe_and_unsubscribe() -> None:
    cache = SnapshotCache()
    state = two_workloads()
    cache.set_snapshot("frontend", snap(state))
    async with envoy(cache, Metrics()) as e:
        # a name that does not exist is answered as removed: the client need not wait for it
        await e.send(SDS, ["unknown"])
        first = await e.recv()
        assert first.resources == [] and first.removed_resources == ["unknown"]
        # Envoy adds names incrementally, before ACKing: only the new one is sent
        await e.send(SDS, ["mesh-trust"])
        second = await e.recv()
        assert sent(second) == ["mesh-trust"] and second.removed_resources == []
        await e.ack(first)
        await e.ack(second)
        await e.silent()
        # unsubscribing needs no answer, and the name is no longer followed
        await e.send(SDS, unsubscribe=["mesh-trust"])
        await e.silent()
        cache.set_snapshot("frontend", snap(state, trust=TrustMaterial(b"other", b"")))
        await e.silent()
        # subscribing again sends the current version, whatever the server thought it had
        await e.send(SDS, ["mesh-trust"])
        again = await e.recv()
        assert sent(again) == ["mesh-trust"]
        assert e.held[SDS] == expected(current(cache), SDS)
        # an explicit name that later appears is sent when it does
        await e.send(SDS, ["late"])
        assert (await e.recv()).removed_resources == ["late"]
        now = current(cache)
        cache.set_snapshot("frontend", replaced(now, SDS, late=now.get(SDS)["mesh-trust"]))
        assert sent(await e.recv()) == ["late"]


async def test_a_membership_change_sends_only_the_changed_endpoints() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, metrics) as e:
        await subscribe_all(e, s)
        assert sorted(e.held[EDS]) == ["out|backend", "out|cache"]
        # one endpoint more for backend: one EDS resource, nothing of the other types
        s2 = replaced(s, EDS, out_backend=endpoints("out|backend", 15002, 15009))
        cache.set_snapshot("frontend", s2)
        eds = await e.recv()
        assert eds.type_url == EDS and sent(eds) == ["out|backend"]
        assert eds.removed_resources == []
        await e.ack(eds)
        await e.silent()
        for t in TypeUrl:
            assert e.held[t] == expected(s2, t)
    assert (
        metrics.registry.get_sample_value("attestmesh_xds_push_ack_seconds_count", {"type": "eds"})
        == 2
    )


async def test_a_quarantine_sends_exactly_what_changed() -> None:
    """With the real builder: after the callee is quarantined, the caller receives exactly the
    resources whose bytes changed (plus the EDS of each cluster CDS changed), and then holds
    exactly the new snapshot."""
    cache = SnapshotCache()
    state = three_workloads()
    s = snap(state)
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        state2, _ = quarantine(state, "backend", Trigger.OPERATOR, "t", NOW)
        s2 = snap(state2)
        cache.set_snapshot("frontend", s2)
        changed = {
            t: sorted(n for n, b in s2.get(t).items() if s.get(t).get(n) != b) for t in TypeUrl
        }
        changed[EDS] = sorted(set(changed[EDS]) | set(changed[CDS]) & set(s2.get(EDS)))
        want = [(t, changed[t]) for t in (SDS, CDS, EDS, LDS, RDS) if changed[t]]
        assert want, "the quarantine changes the caller's configuration"
        got = []
        for _ in want:
            resp = await e.recv()
            got.append((TypeUrl(resp.type_url), sent(resp)))
            assert resp.removed_resources == []
            await e.ack(resp)
        assert got == want
        assert "out|cache" not in changed[CDS] + changed[EDS], "the other service is untouched"
        await e.silent()
        for t in TypeUrl:
            assert e.held[t] == expected(s2, t)


async def test_wildcard_removals() -> None:
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await e.send(CDS)
        await e.ack(await e.recv())
        cache.set_snapshot("frontend", replaced(s, CDS, out_cache=None))
        cds = await e.recv()
        assert cds.resources == [] and cds.removed_resources == ["out|cache"]
        assert sorted(e.held[CDS]) == ["inbound|app", "out|backend"]
        await e.ack(cds)
        await e.silent()


async def test_eds_sent_again_after_cds_changes_its_cluster() -> None:
    """A real Envoy warms an updated EDS cluster only on an EDS response and, with delta, does
    not ask for it (the name is already subscribed): the server sends it, same version."""
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        cluster: Any = AnyMsg.parse(s.get(CDS)["out|backend"]).unpack()
        slower = Cluster.from_dict({**cluster.to_dict(), "connectTimeout": "2.500s"})
        cache.set_snapshot("frontend", replaced(s, CDS, out_backend=pb.pack(slower, CDS)))
        cds = await e.recv()
        assert (cds.type_url, sent(cds)) == (CDS, ["out|backend"])
        eds = await e.recv()
        assert (eds.type_url, sent(eds)) == (EDS, ["out|backend"])
        assert eds.resources[0].version == version_of(s.get(EDS)["out|backend"])
        await e.ack(cds)
        await e.ack(eds)
        await e.silent()


async def test_reconnect_eds_after_a_cds_update_answered_before_eds_was_asked() -> None:
    """On a new stream the CDS answer (an updated cluster) can go out before the EDS request
    arrives, and that request states the version the client holds: the updated cluster still
    needs an EDS response to warm, so it gets one."""
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        held = {t: dict(v) for t, v in e.held.items()}
    cluster: Any = AnyMsg.parse(s.get(CDS)["out|backend"]).unpack()
    slower = Cluster.from_dict({**cluster.to_dict(), "connectTimeout": "2.500s"})
    cache.set_snapshot("frontend", replaced(s, CDS, out_backend=pb.pack(slower, CDS)))
    async with envoy(cache, Metrics()) as e:
        e.held = held
        await e.send(CDS, initial=held[CDS])
        cds = await e.recv()
        assert sent(cds) == ["out|backend"]
        await e.send(EDS, sorted(held[EDS]), initial=held[EDS])
        eds = await e.recv()
        assert sent(eds) == ["out|backend"], "the updated cluster's endpoints, same version"
        await e.ack(cds)
        await e.ack(eds)
        await e.silent()


async def test_resubscribing_a_held_name_is_answered() -> None:
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        await e.send(EDS, ["out|cache"])
        again = await e.recv()
        assert sent(again) == ["out|cache"]
        assert again.resources[0].version == e.held[EDS]["out|cache"]


async def test_ads_order_for_a_change_of_every_type() -> None:
    cache = SnapshotCache()
    state = three_workloads()
    s = snap(state)
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        # every type changes at once: new trust, a quarantined peer, a new listener
        state2, _ = quarantine(state, "backend", Trigger.OPERATOR, "t", NOW)
        s2 = snap(state2, trust=TrustMaterial(b"other", b""))
        listener: Any = AnyMsg.parse(s2.get(LDS)["out|cache"]).unpack()
        extra = pb.pack(type(listener).from_dict({**listener.to_dict(), "name": "extra"}), LDS)
        cache.set_snapshot("frontend", replaced(s2, LDS, extra=extra))
        order = [TypeUrl((await e.recv()).type_url) for _ in range(5)]
        assert order == [SDS, CDS, EDS, LDS, RDS]


async def test_reconnect_with_initial_versions_sends_nothing_unchanged() -> None:
    """A new stream (here: to a new server, as after a restart) that states what the client
    holds gets only what changed meanwhile; names it holds that are gone are removed."""
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        held = {t: dict(v) for t, v in e.held.items()}
    # meanwhile: one endpoint set changes, one cluster and its endpoints disappear
    s2 = replaced(s, EDS, out_backend=endpoints("out|backend", 15002, 15009), out_cache=None)
    s2 = replaced(s2, CDS, out_cache=None)
    cache.set_snapshot("frontend", s2)
    restarted = AdsServer(cache, Metrics(), versions=ResourceVersions())
    async with envoy(cache, Metrics(), server=restarted) as e:
        e.held = held
        await e.send(CDS, initial=held[CDS])
        cds = await e.recv()
        assert cds.resources == [] and cds.removed_resources == ["out|cache"]
        await e.ack(cds)
        await e.send(EDS, sorted(held[EDS]), initial=held[EDS])
        eds = await e.recv()
        assert sent(eds) == ["out|backend"] and eds.removed_resources == ["out|cache"]
        await e.ack(eds)
        for t in (SDS, RDS):
            await e.send(t, sorted(held[t]), initial=held[t])
        await e.send(LDS, initial=held[LDS])
        lds = await e.recv()  # a new wildcard is always answered: here, with nothing
        assert (lds.type_url, lds.resources, lds.removed_resources) == (LDS, [], [])
        await e.ack(lds)
        await e.silent()
        for t in TypeUrl:
            assert e.held[t] == expected(s2, t)


async def test_nack_is_counted_logged_and_not_resent(caplog: pytest.LogCaptureFixture) -> None:
    cache, metrics = SnapshotCache(), Metrics()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, metrics) as e:
        await subscribe_all(e, s)
        bad = pb.pack(Cluster(name="bad"), CDS)  # stands for anything Envoy refuses
        s2 = replaced(s, CDS, bad=bad)
        cache.set_snapshot("frontend", s2)
        cds = await e.recv(apply=False)
        assert sent(cds) == ["bad"]
        with caplog.at_level(logging.WARNING, logger="xds.server"):
            await e.send(CDS, nonce=cds.nonce, error="cluster bad: no endpoints")
            await e.silent()
        assert "cluster bad: no endpoints" in caplog.text
        # the stream keeps serving: another change goes out, the rejected cluster does not
        s3 = replaced(s2, EDS, out_backend=endpoints("out|backend", 15002, 15009))
        cache.set_snapshot("frontend", s3)
        eds = await e.recv()
        assert (eds.type_url, sent(eds)) == (EDS, ["out|backend"])
        await e.ack(eds)
        await e.silent()
        # a NACK is answered once: the same nonce again changes nothing
        await e.send(CDS, nonce=cds.nonce, error="cluster bad: no endpoints")
        await e.silent()
        # once the rejected resource changes, it is sent again
        cache.set_snapshot("frontend", replaced(s3, CDS, bad=pb.pack(Cluster(name="bad2"), CDS)))
        assert sent(await e.recv()) == ["bad"]
    nacks = metrics.registry.get_sample_value("attestmesh_xds_nacks_total", {"type": "cds"})
    assert nacks == 1


async def test_nack_leaves_the_client_with_what_it_had() -> None:
    """After a NACK the server's record of the client is what the client kept: going back to
    that configuration sends nothing (no removal of a name the client never took), offering the
    rejected versions again sends nothing, and a new version of the resource is sent."""
    cache, metrics = SnapshotCache(), Metrics()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)

    def listener(buffer_limit: int) -> bytes:
        msg: Any = AnyMsg.parse(s.get(LDS)["out|backend"]).unpack()
        d = {**msg.to_dict(), "perConnectionBufferLimitBytes": buffer_limit}
        return pb.pack(type(msg).from_dict(d), LDS)

    async with envoy(cache, metrics) as e:
        await subscribe_all(e, s)
        extra: Any = AnyMsg.parse(s.get(LDS)["out|cache"]).unpack()
        bad = pb.pack(type(extra).from_dict({**extra.to_dict(), "name": "bad"}), LDS)
        rejected = replaced(s, LDS, out_backend=listener(1234), bad=bad)
        cache.set_snapshot("frontend", rejected)
        lds = await e.recv(apply=False)
        assert sent(lds) == ["bad", "out|backend"]
        await e.send(LDS, nonce=lds.nonce, error="listener bad: address already in use")
        await e.silent()
        cache.set_snapshot("frontend", s)  # back to what the client kept
        await e.silent()
        cache.set_snapshot("frontend", rejected)  # the rejected versions are not offered again
        await e.silent()
        assert e.held[LDS] == expected(s, LDS)
        cache.set_snapshot("frontend", replaced(s, LDS, out_backend=listener(4321)))
        fixed = await e.recv()
        assert (fixed.type_url, sent(fixed), fixed.removed_resources) == (LDS, ["out|backend"], [])
        await e.ack(fixed)
        await e.silent()
    assert metrics.registry.get_sample_value("attestmesh_xds_nacks_total", {"type": "lds"}) == 1


async def test_stale_and_unknown_nonces_change_nothing() -> None:
    cache, metrics = SnapshotCache(), Metrics()
    cache.set_snapshot("frontend", snap(two_workloads()))
    async with envoy(cache, metrics) as e:
        await e.send(CDS)
        cds = await e.recv()
        await e.ack(cds)
        await e.ack(cds)  # a duplicate ACK
        await e.send(CDS, nonce="999")  # a nonce never sent
        await e.send(EDS, nonce=cds.nonce)  # a nonce of another type
        await e.silent()
    count = metrics.registry.get_sample_value(
        "attestmesh_xds_push_ack_seconds_count", {"type": "cds"}
    )
    assert count == 1


async def test_node_id_is_required() -> None:
    with pytest.raises(GRPCError) as info:
        async with envoy(SnapshotCache(), Metrics(), node="") as e:
            await e.send(CDS)
            await e.recv()
    assert info.value.status is grpclib.const.Status.INVALID_ARGUMENT


async def test_streams_share_versions_without_rehashing() -> None:
    """A resource many streams receive is hashed once; a change costs each stream a version
    lookup per resource of the changed type, not a hash."""
    cache = SnapshotCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    versions = ResourceVersions()
    server = AdsServer(cache, Metrics(), versions=versions)
    async with (
        envoy(cache, Metrics(), server=server) as a,
        envoy(cache, Metrics(), server=server) as b,
    ):
        for e in (a, b):
            await subscribe_all(e, s)
        distinct = sum(len(s.get(t)) for t in TypeUrl)
        assert versions.hashed == distinct
        s2 = replaced(s, EDS, out_backend=endpoints("out|backend", 15002, 15009))
        cache.set_snapshot("frontend", s2)
        for e in (a, b):
            await e.ack(await e.recv())
        assert versions.hashed == distinct + 1


def test_resource_versions_are_content_hashes_and_bounded() -> None:
    versions = ResourceVersions(limit=2)
    a, b, c = b"a" * 10, b"b" * 10, b"c" * 10
    va = versions(a)
    assert versions(bytes(bytearray(a))) == va, "equal bytes, equal version"
    assert ResourceVersions()(a) == va, "stable across instances (and processes)"
    assert len({va, versions(b), versions(c)}) == 3
    hashed = versions.hashed
    versions(a)  # still in the previous generation: found, not hashed
    assert versions.hashed == hashed
    for x in (b"d", b"e", b"f", b"g"):
        versions(x)
    versions(c)  # aged out of both generations: hashed again
    assert versions.hashed == hashed + 5
    # the bytes a generation keeps alive are bounded too
    by_size = ResourceVersions(max_bytes=25)
    big = [bytes([i]) * 10 for i in range(9)]
    for x in big:
        by_size(x)
    hashed = by_size.hashed
    by_size(big[0])  # two generations (of about 25 bytes each) ago: gone
    assert by_size.hashed == hashed + 1
    by_size(big[8])  # the newest: still held
    assert by_size.hashed == hashed + 1


def test_session_ignores_unknown_types() -> None:
    session = DeltaSession("frontend", Metrics(), lambda: 0.0, ResourceVersions())
    session.on_request(DeltaDiscoveryRequest(type_url="type.googleapis.com/unknown"))
    assert list(session.responses(snap(two_workloads()))) == []


# ---------------------------------------------------------------------------------------------
# over mutual TLS: the node must be the one the client certificate names (as for SotW)


async def first_delta_response(port: int, ctx: ssl.SSLContext, node: str) -> DeltaDiscoveryResponse:
    channel = Channel("127.0.0.1", port, ssl=ctx)
    try:
        async with (
            asyncio.timeout(5),
            channel.request(
                METHOD,
                grpclib.const.Cardinality.STREAM_STREAM,
                DeltaDiscoveryRequest,
                DeltaDiscoveryResponse,
            ) as stream,
        ):
            await stream.send_message(DeltaDiscoveryRequest(type_url=CDS, node=Node(id=node)))
            resp = await stream.recv_message()
            assert resp is not None
            await stream.cancel()
            return resp
    finally:
        channel.close()


async def test_mtls_envoy_gets_its_own_node_config(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca):
        resp = await first_delta_response(
            port, client_context(ca, tmp_path, "frontend"), "frontend"
        )
        assert sorted(r.name for r in resp.resources) == ["inbound|app", "out|backend"]


async def test_mtls_certificate_for_another_workload_is_refused(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca):
        with pytest.raises(GRPCError) as exc:
            await first_delta_response(port, client_context(ca, tmp_path, "frontend"), "backend")
        assert exc.value.status is grpclib.const.Status.PERMISSION_DENIED


class CountingCache(SnapshotCache):
    """A cache that counts how often a stream looked for its node's snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, node: str) -> Snapshot | None:
        self.gets += 1
        return super().get(node)


async def test_an_ack_wakes_nothing_a_subscription_change_does() -> None:
    """Per push the stream looks for responses once: the ACK that follows cannot make anything
    due, so it does not wake the sender (at N=10,000 a quarantine's ~5,000 ACKs each cost a
    wake, a re-authorization and a diff of every type). A NACK wakes nothing either (its
    versions are rolled back, not resent); a subscription change and a new type do."""
    cache = CountingCache()
    s = snap(three_workloads())
    cache.set_snapshot("frontend", s)
    async with envoy(cache, Metrics()) as e:
        await subscribe_all(e, s)
        cache.set_snapshot("frontend", replaced(s, EDS, out_backend=endpoints("out|backend", 1)))
        eds = await e.recv()
        before = cache.gets
        await e.ack(eds)
        await e.silent()
        assert cache.gets == before  # the ACK: no wake
        cache.set_snapshot("frontend", replaced(s, EDS, out_backend=endpoints("out|backend", 2)))
        nacked = await e.recv(apply=False)
        before = cache.gets
        await e.send(EDS, nonce=nacked.nonce, error="rejected")
        await e.silent()
        assert cache.gets == before  # the NACK: no wake, nothing resent
        await e.send(EDS, ["out|cache"])  # subscribed again: answered
        resp = await e.recv()
        assert sent(resp) == ["out|cache"] and cache.gets == before + 1


def test_sessions_say_whether_a_request_can_make_a_response_due() -> None:
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse

    from xds.server import AdsSession

    s = snap(three_workloads())
    d = DeltaSession("frontend", Metrics(), lambda: 0.0, version_of)
    assert d.on_request(DeltaDiscoveryRequest(type_url=CDS)) is True  # a new type
    (cds,) = d.responses(s)
    nonce = DeltaDiscoveryResponse.parse(cds).nonce
    assert d.on_request(DeltaDiscoveryRequest(type_url=CDS, response_nonce=nonce)) is False
    assert d.on_request(DeltaDiscoveryRequest(type_url=CDS)) is True  # no nonce: a request
    assert d.on_request(DeltaDiscoveryRequest(type_url="type.googleapis.com/x")) is False
    assert (
        d.on_request(
            DeltaDiscoveryRequest(
                type_url=CDS, response_nonce=nonce, resource_names_subscribe=["a"]
            )
        )
        is True
    )
    a = AdsSession("frontend", Metrics(), lambda: 0.0)
    assert a.on_request(DiscoveryRequest(type_url=CDS)) is True
    (sotw,) = a.responses(s)
    nonce = DiscoveryResponse.parse(sotw).nonce
    ack = DiscoveryRequest(type_url=CDS, response_nonce=nonce, version_info=s.version(CDS))
    assert a.on_request(ack) is False
    assert a.on_request(DiscoveryRequest(type_url=EDS, resource_names=["out|backend"])) is True
    assert len(list(a.responses(s))) == 1  # the EDS answer (CDS is unchanged)
    eds_ack = DiscoveryRequest(type_url=EDS, response_nonce="9", resource_names=["out|backend"])
    assert a.on_request(eds_ack) is False  # same names, an unknown nonce: nothing due
    renamed = DiscoveryRequest(type_url=EDS, response_nonce="9", resource_names=["out|cache"])
    assert a.on_request(renamed) is True  # the names changed
