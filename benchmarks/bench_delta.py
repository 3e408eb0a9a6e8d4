"""Delta vs state-of-the-world ADS: what one change costs per affected stream.

    .venv/bin/python benchmarks/bench_delta.py [--clients 1000] [--services 10] [--repeat 7]
    .venv/bin/python benchmarks/bench_delta.py --fanout 5000 [--repeat 7]

A mesh of ``--services`` services (two replicas each) and ``--clients`` client workloads, each
calling every service; every client has one ADS stream in steady state (subscribed like Envoy,
everything ACKed). Two changes:

- EDS membership: one replica of service 0 leaves its endpoints (one new load assignment,
  shared by every client, as the builder shares it); nothing else changes.
- quarantine: the same replica quarantined through the real state and builder (the service's
  cluster pins fewer SPIFFE IDs, and its endpoints change).

Two layers, both in one process:

1. the server's protocol core (``AdsSession`` / ``DeltaSession``): the responses one change
   makes a stream send, encoded, and the handling of the ACKs that follow (parse + on_request).
   This is the control plane's own CPU per affected stream, without HTTP/2.
2. real gRPC over HTTP/2 in memory (grpclib ``ChannelFor``, 100 streams per connection: h2's
   limit), ``--clients`` streams: the bytes each stream receives for the change, and the CPU
   of the whole process (server and the in-memory clients that parse the responses and ACK)
   per stream.

3. ``--fanout N`` alone: N delta sessions at one point (the same shared EDS mapping), one EDS
   change: the CPU to produce every stream's response and to take every ACK, and the memory
   per idle session.

Medians over ``--repeat`` changes (each change alternates between the two configurations).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpclib.const
from grpclib.client import Stream
from grpclib.testing import ChannelFor
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from tests.unit.xds.meshfixture import NOW, TD, TRUST, attested, reg
from xds import pb
from xds.build import Packer, Snapshot, build_load_assignment, build_snapshots
from xds.cache import SnapshotCache
from xds.resources import ADS_SERVICE, INBOUND_ROUTE, MESH_TRUST, TypeUrl, outbound_name
from xds.server import AdsServer, AdsSession, DeltaSession, ResourceVersions, warm
from xds.state import MeshState, Trigger, quarantine

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
        DiscoveryRequest,
        DiscoveryResponse,
    )

CDS, EDS, LDS, RDS, SDS = (
    TypeUrl.CLUSTER,
    TypeUrl.ENDPOINT,
    TypeUrl.LISTENER,
    TypeUrl.ROUTE,
    TypeUrl.SECRET,
)


# ---------------------------------------------------------------------------------------------
# the mesh and its two changes


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    before: dict[str, Snapshot]
    after: dict[str, Snapshot]


def mesh(clients: int, services: int) -> MeshState:
    state = MeshState(TD)
    serial = 1
    for s in range(services):
        for r in range(2):
            state = attested(
                state, reg(f"svc{s}-{r}", 20000 + 2 * s + r, service=f"svc{s}"), serial
            )
            serial += 1
    outbound = {f"svc{s}": 40000 + s for s in range(services)}
    for i in range(clients):
        state = attested(state, reg(f"client-{i}", 30000 + i, outbound), serial)
        serial += 1
    return state


def client_nodes(clients: int) -> list[str]:
    return [f"client-{i}" for i in range(clients)]


def scenarios(clients: int, services: int) -> list[Scenario]:
    state = mesh(clients, services)
    packer = Packer()
    before = build_snapshots(state, [], TRUST, packer=packer)
    nodes = client_nodes(clients)
    before = {n: before[n] for n in nodes}

    # EDS membership: one replica of svc0 leaves the endpoints; one new shared resource
    name = outbound_name("svc0")
    fewer = pb.pack(build_load_assignment(name, [("127.0.0.1", 20000)]), EDS)
    eds_only = {}
    for node, s in before.items():
        resources = {t: dict(s.get(t)) for t in TypeUrl}
        assert name in resources[EDS]
        resources[EDS][name] = fewer
        eds_only[node] = Snapshot.of(resources, s.references)

    quarantined, _ = quarantine(state, "svc0-1", Trigger.OPERATOR, "bench", NOW)
    after_q = build_snapshots(quarantined, [], TRUST, packer=packer)
    return [
        Scenario("EDS membership change", before, eds_only),
        Scenario("quarantine (CDS + EDS)", before, {n: after_q[n] for n in nodes}),
    ]


def subscriptions(s: Snapshot) -> list[tuple[TypeUrl, list[str]]]:
    """What Envoy subscribes to: CDS and LDS wildcards, the rest by name."""
    return [
        (CDS, []),
        (EDS, sorted(s.get(EDS))),
        (SDS, [MESH_TRUST]),
        (LDS, []),
        (RDS, [INBOUND_ROUTE]),
    ]


# ---------------------------------------------------------------------------------------------
# 1. the protocol core


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    new: Callable[[str], Any]
    subscribe: Callable[[Snapshot], list[bytes]]
    acks: Callable[[bytes], bytes]
    parse: Callable[[bytes], Any]


def sotw_variant(metrics: Metrics) -> Variant:
    def subscribe(s: Snapshot) -> list[bytes]:
        return [
            bytes(DiscoveryRequest(type_url=t, resource_names=n, node=Node(id="x")))
            for t, n in subscriptions(s)
        ]

    def ack(response: bytes) -> bytes:
        r = DiscoveryResponse.parse(response)
        names = sorted(_names(r)) if r.type_url not in (CDS, LDS) else []
        return bytes(
            DiscoveryRequest(
                type_url=r.type_url,
                version_info=r.version_info,
                response_nonce=r.nonce,
                resource_names=names,
            )
        )

    return Variant(
        "sotw",
        lambda node: AdsSession(node, metrics, time.monotonic),
        subscribe,
        ack,
        DiscoveryRequest.parse,
    )


def _names(r: DiscoveryResponse) -> set[str]:
    # SotW EDS/RDS/SDS requests repeat the subscribed names; the bench keeps them as subscribed
    return {_resource_name(a.value, a.type_url) for a in r.resources}


def _resource_name(value: bytes, type_url: str) -> str:
    # the name is field 1 of Cluster/Listener/RouteConfiguration/Secret and of
    # ClusterLoadAssignment (cluster_name): read the first length-delimited field
    assert value[0] == 0x0A, type_url
    size, i = 0, 1
    shift = 0
    while True:
        b = value[i]
        size |= (b & 0x7F) << shift
        i += 1
        if not b & 0x80:
            break
        shift += 7
    return value[i : i + size].decode()


def delta_variant(metrics: Metrics, versions: ResourceVersions) -> Variant:
    def subscribe(s: Snapshot) -> list[bytes]:
        return [
            bytes(DeltaDiscoveryRequest(type_url=t, resource_names_subscribe=n, node=Node(id="x")))
            for t, n in subscriptions(s)
        ]

    def ack(response: bytes) -> bytes:
        r = DeltaDiscoveryResponse.parse(response)
        return bytes(DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce))

    return Variant(
        "delta",
        lambda node: DeltaSession(node, metrics, time.monotonic, versions),
        subscribe,
        ack,
        DeltaDiscoveryRequest.parse,
    )


@dataclass(slots=True)
class CoreResult:
    respond_cpu: list[float]
    ack_cpu: list[float]
    sent: list[float]
    messages: list[float]
    new_stream_cpu: float
    memory: float


def exchange(
    v: Variant, sessions: list[Any], target: dict[str, Snapshot]
) -> tuple[float, float, int, int]:
    """Each session answers ``target`` and the client ACKs, until nothing more is due (SotW
    answers EDS again after a CDS response). Returns (respond CPU, ACK CPU, bytes, responses)
    summed over all sessions."""
    respond = ack = 0.0
    sent = count = 0
    pending = sessions
    while pending:
        t = time.process_time()
        out = [list(s.responses(target[s.node])) for s in pending]
        respond += time.process_time() - t
        sent += sum(len(m) for msgs in out for m in msgs)
        count += sum(len(msgs) for msgs in out)
        acks = [[v.acks(m) for m in msgs] for msgs in out]  # the clients' work: not timed
        t = time.process_time()
        for session, raws in zip(pending, acks, strict=True):
            for raw in raws:
                session.on_request(v.parse(raw))
        ack += time.process_time() - t
        pending = [s for s, msgs in zip(pending, out, strict=True) if msgs]
    return respond, ack, sent, count


def run_core(v: Variant, sc: Scenario, repeat: int) -> CoreResult:
    nodes = list(sc.before)
    n = len(nodes)
    wires = {node: v.subscribe(s) for node, s in sc.before.items()}
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t = time.process_time()
    sessions = [v.new(node) for node in nodes]
    for session in sessions:
        for raw in wires[session.node]:
            session.on_request(v.parse(raw))
    subscribe_cpu = time.process_time() - t
    respond, ack, _, _ = exchange(v, sessions, sc.before)
    new_stream_cpu = (subscribe_cpu + respond + ack) / n
    memory = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    result = CoreResult([], [], [], [], new_stream_cpu, memory)
    for i in range(repeat):
        gc.collect()
        respond, ack, sent, count = exchange(v, sessions, sc.after if i % 2 == 0 else sc.before)
        result.respond_cpu.append(respond / n)
        result.ack_cpu.append(ack / n)
        result.sent.append(sent / n)
        result.messages.append(count / n)
    return result


# ---------------------------------------------------------------------------------------------
# 2. gRPC over HTTP/2 in memory


class Client:
    """An in-memory Envoy stand-in: subscribes, ACKs every response, counts bytes."""

    def __init__(self, stream: Stream[Any, Any], delta: bool, node: str) -> None:
        self.stream, self.delta, self.node = stream, delta, node
        self.received = 0
        self.bytes = 0
        self.names: dict[str, list[str]] = {}

    async def subscribe(self, s: Snapshot) -> None:
        for i, (t, names) in enumerate(subscriptions(s)):
            node = Node(id=self.node) if i == 0 else None
            self.names[t] = names
            if self.delta:
                req: Any = DeltaDiscoveryRequest(
                    type_url=t, resource_names_subscribe=names, node=node
                )
            else:
                req = DiscoveryRequest(type_url=t, resource_names=names, node=node)
            await self.stream.send_message(req)

    async def run(self) -> None:
        parse: Any = DeltaDiscoveryResponse.parse if self.delta else DiscoveryResponse.parse
        while True:
            raw = await self.stream.recv_message()
            if raw is None:
                return
            self.received += 1
            self.bytes += len(raw.data)
            resp = parse(raw.data)  # what Envoy does with it (and needs for the ACK)
            if self.delta:
                ack: Any = DeltaDiscoveryRequest(type_url=resp.type_url, response_nonce=resp.nonce)
            else:
                ack = DiscoveryRequest(
                    type_url=resp.type_url,
                    version_info=resp.version_info,
                    response_nonce=resp.nonce,
                    resource_names=self.names[resp.type_url],
                )
            await self.stream.send_message(ack)


_STREAMS_PER_CONNECTION = 100


async def run_grpc(delta: bool, sc: Scenario, repeat: int) -> tuple[list[float], list[float]]:
    """Per change: median bytes received per stream, process CPU per stream."""
    cache = SnapshotCache()
    cache.set_snapshots(sc.before)
    server = AdsServer(cache, Metrics())
    method = "DeltaAggregatedResources" if delta else "StreamAggregatedResources"
    req_t: Any = DeltaDiscoveryRequest if delta else DiscoveryRequest
    nodes = list(sc.before)
    cpu: list[float] = []
    sent: list[float] = []
    async with AsyncExitStack() as stack:
        streams = []
        for i, _node in enumerate(nodes):
            if i % _STREAMS_PER_CONNECTION == 0:  # h2 allows 100 concurrent streams
                channel = await stack.enter_async_context(ChannelFor([server]))
            cm = channel.request(
                f"/{ADS_SERVICE}/{method}",
                grpclib.const.Cardinality.STREAM_STREAM,
                req_t,
                pb.Encoded,
            )
            stream = await cm.__aenter__()
            streams.append((cm, stream))
        clients = [Client(st, delta, n) for (_, st), n in zip(streams, nodes, strict=True)]
        tasks = [asyncio.create_task(c.run()) for c in clients]
        for c in clients:
            await c.subscribe(sc.before[c.node])
        await settle(clients)
        for i in range(repeat):
            target = sc.after if i % 2 == 0 else sc.before
            before = sum(c.bytes for c in clients)
            gc.collect()
            t = time.process_time()
            cache.set_snapshots(target)
            await settle(clients)
            cpu.append((time.process_time() - t) / len(nodes))
            sent.append((sum(c.bytes for c in clients) - before) / len(nodes))
        for (cm, stream), task in zip(streams, tasks, strict=True):
            await stream.end()
            task.cancel()
            await cm.__aexit__(None, None, None)
    return cpu, sent


async def settle(clients: Sequence[Client], quiet: float = 0.05) -> None:
    """Wait until no client received anything for ``quiet`` seconds."""
    last = -1
    while True:
        now = sum(c.received for c in clients)
        if now == last:
            return
        last = now
        await asyncio.sleep(quiet)


# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# 3. one change fanned out to many streams at the same point


def run_fanout(streams: int, repeat: int) -> None:
    """``streams`` delta sessions subscribed like Envoy (CDS/LDS wildcards, EDS/SDS/RDS by name),
    every one holding the same shared EDS mapping (as every caller of a service does), then
    ``repeat`` changes of one EDS resource (a quarantine's replica leaving and coming back):
    the CPU to produce every stream's response, and to take every stream's ACK of it (the
    sessions' part only: no HTTP/2, no TLS). Also the Python memory per idle session."""
    versions = ResourceVersions()
    metrics = Metrics()
    eds_names = [outbound_name(f"svc{s}") for s in range(10)]

    def resource(tag: str, t: TypeUrl) -> bytes:
        return pb.pack_bytes(b"\x0a\x10" + tag.encode().ljust(16, b"."), t)

    def snapshot(node: int, replica: str) -> Snapshot:
        eds = {n: resource(n + (replica if n == eds_names[0] else "ab"), EDS) for n in eds_names}
        return Snapshot.of(
            {
                CDS: {n: resource(f"{n}{node}", CDS) for n in eds_names},
                EDS: eds,
                LDS: {"in": resource(f"in{node}", LDS)},
                RDS: {INBOUND_ROUTE: resource(f"r{node}", RDS)},
                SDS: {MESH_TRUST: resource("trust", SDS)},
            }
        )

    both = [snapshot(0, "ab"), snapshot(0, "a")]
    assert both[0].get(EDS) is snapshot(1, "ab").get(EDS)  # shared, as the builder shares it
    subscribe = [
        DeltaDiscoveryRequest(type_url=CDS, node=Node(id="x")),
        DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=eds_names),
        DeltaDiscoveryRequest(type_url=SDS, resource_names_subscribe=[MESH_TRUST]),
        DeltaDiscoveryRequest(type_url=LDS),
        DeltaDiscoveryRequest(type_url=RDS, resource_names_subscribe=[INBOUND_ROUTE]),
    ]

    def ack_of(message: bytes) -> DeltaDiscoveryRequest:
        r = DeltaDiscoveryResponse.parse(message)
        return DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce)

    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sessions = [DeltaSession(f"n{i}", metrics, time.monotonic, versions) for i in range(streams)]
    for s in sessions:
        for req in subscribe:
            s.on_request(req)
        for m in list(s.responses(both[0])):
            s.on_request(ack_of(m))
    memory = (tracemalloc.get_traced_memory()[0] - base) / streams
    tracemalloc.stop()
    respond: list[float] = []
    acks: list[float] = []
    for i in range(repeat):
        target = both[(i + 1) % 2]
        gc.collect()
        t = time.process_time()
        out = [list(s.responses(target)) for s in sessions]
        respond.append(time.process_time() - t)
        assert all(len(m) == 1 for m in out)
        distinct = len({m[0] for m in out})
        reqs = [ack_of(m[0]) for m in out]  # the clients' part: not timed
        t = time.process_time()
        for s, req in zip(sessions, reqs, strict=True):
            s.on_request(req)
        acks.append(time.process_time() - t)
    print(f"{streams} delta sessions at one point, one EDS change, medians over {repeat}:")
    for label, xs in (("respond", respond), ("ACKs", acks)):
        total = med(xs)
        print(
            f"  {label:8} {total * 1e3:8.1f} ms in all, {total / streams * 1e6:6.2f} us per stream"
        )
    print(f"  distinct response bytes per change: {distinct}")
    print(f"  memory per idle session (tracemalloc): {memory:8.0f} B")


def med(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--services", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-grpc", action="store_true", help="only the protocol core")
    parser.add_argument(
        "--fanout", type=int, default=0, help="only the fan-out of one change to this many streams"
    )
    args = parser.parse_args()
    pb.install_validator_cache()
    warm()
    if args.fanout:
        run_fanout(args.fanout, args.repeat)
        return
    print(f"{args.clients} streams (one per client), each client calling {args.services} "
          f"services of 2 replicas; medians over {args.repeat} changes")  # fmt: skip
    t = time.process_time()
    all_scenarios = scenarios(args.clients, args.services)
    print(f"(building the snapshots: {time.process_time() - t:.1f} s CPU, not measured below)")
    metrics = Metrics()
    for sc in all_scenarios:
        print(f"\n== {sc.name}: per affected stream ==")
        print(f"{'measure':52} {'delta':>12} {'sotw':>12} {'sotw/delta':>10}")
        core = {
            v.name: run_core(v, sc, args.repeat)
            for v in (delta_variant(metrics, ResourceVersions()), sotw_variant(metrics))
        }
        rows: list[tuple[str, float, float, str]] = []
        d, s = core["delta"], core["sotw"]
        rows.append(("core: bytes sent", med(d.sent), med(s.sent), "B"))
        rows.append(("core: responses sent", med(d.messages), med(s.messages), ""))
        rows.append(
            ("core: CPU to diff + encode the change", med(d.respond_cpu), med(s.respond_cpu), "us")
        )
        rows.append(("core: CPU to handle the ACKs", med(d.ack_cpu), med(s.ack_cpu), "us"))
        rows.append(
            (
                "core: CPU total (respond + ACKs)",
                med([a + b for a, b in zip(d.respond_cpu, d.ack_cpu, strict=True)]),
                med([a + b for a, b in zip(s.respond_cpu, s.ack_cpu, strict=True)]),
                "us",
            )
        )
        rows.append(
            ("core: CPU per new stream (all 5 types)", d.new_stream_cpu, s.new_stream_cpu, "us")
        )
        rows.append(("core: memory per steady stream", d.memory, s.memory, "B"))
        if not args.no_grpc:
            d_cpu, d_sent = asyncio.run(run_grpc(True, sc, args.repeat))
            s_cpu, s_sent = asyncio.run(run_grpc(False, sc, args.repeat))
            rows.append(("grpc: bytes received (messages)", med(d_sent), med(s_sent), "B"))
            rows.append(
                ("grpc: process CPU (server + in-memory clients)", med(d_cpu), med(s_cpu), "us")
            )
        for label, dv, sv, unit in rows:
            scale = 1e6 if unit == "us" else 1
            ratio = sv / dv if dv else float("nan")
            print(
                f"{label:52} {dv * scale:10.1f}{unit:>2} {sv * scale:10.1f}{unit:>2} {ratio:9.1f}x"
            )


if __name__ == "__main__":
    main()
