"""xDS serialization and snapshot cost: the betterproto2 decision, measured in one run.

    .venv/bin/python benchmarks/bench_xds.py [--clients 1000]

Compares, in the same process, betterproto2 0.9.1 as shipped ("naive": a new pydantic
SchemaValidator per bytes()/parse()) against xds.pb's per-class validator cache, and the
hand-framed DiscoveryResponse against building one with betterproto2 objects. Prints ratios.
The ADS part drives AdsSession (the server's protocol core) for N simulated Envoys: it measures
the control plane's CPU and memory per stream without HTTP/2 framing.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from tests.unit.xds.meshfixture import TRUST, allow, many_callers, two_workloads
from xds import pb
from xds.build import Packer, TrustMaterial, build_snapshot, build_snapshots
from xds.resources import TypeUrl
from xds.server import AdsSession, warm

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse
    from envoy_data_plane.google.protobuf import Any as AnyMsg

POLICIES = [allow("backend", "frontend"), allow("frontend", "backend")]


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs."""
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def serialization(repeat: int) -> dict[str, float]:
    state = two_workloads()
    snap = build_snapshot(state, "frontend", POLICIES, TRUST)
    listener_any = AnyMsg.parse(snap.get(TypeUrl.LISTENER)["inbound"])
    listener: Any = listener_any.unpack()
    raw_listener = bytes(listener)
    resources = [AnyMsg.parse(b) for t in TypeUrl for b in snap.get(t).values()]
    packed = [bytes(a) for a in resources]
    return {
        "listener bytes()": timed(lambda: bytes(listener), repeat),
        "listener parse()": timed(lambda: type(listener).parse(raw_listener), repeat),
        "snapshot build (frontend, fresh packer)": timed(
            lambda: build_snapshot(state, "frontend", POLICIES, TRUST, packer=Packer()), repeat
        ),
        "DiscoveryResponse via betterproto2": timed(
            lambda: bytes(
                DiscoveryResponse(
                    version_info="v", resources=resources, type_url=TypeUrl.LISTENER, nonce="1"
                )
            ),
            repeat,
        ),
        "DiscoveryResponse hand-framed": timed(
            lambda: pb.encode_discovery_response("v", TypeUrl.LISTENER, "1", packed), repeat
        ),
        "DiscoveryRequest parse()": timed(lambda: DiscoveryRequest.parse(ack_bytes), repeat),
    }


ack_bytes = b""


def mesh_build(nodes: int) -> dict[str, float]:
    state = many_callers(nodes)
    policies = [allow("backend", f"client-{i}") for i in range(nodes)]
    packer = Packer()
    t = time.perf_counter()
    build_snapshots(state, policies, TRUST, packer=packer)
    cold = time.perf_counter() - t
    new_trust = TrustMaterial(TRUST.bundle_pem, b"crl-2")
    t = time.perf_counter()
    build_snapshots(state, policies, new_trust, packer=packer)
    rotation = time.perf_counter() - t
    return {f"all {nodes + 2} snapshots, first build": cold,
            f"all {nodes + 2} snapshots, after a CRL change": rotation}  # fmt: skip


def ads_clients(n: int) -> dict[str, float]:
    state = many_callers(n)
    policies = [allow("backend", f"client-{i}") for i in range(n)]
    packer = Packer()
    snaps = build_snapshots(state, policies, TRUST, packer=packer)
    metrics = Metrics()
    subs: list[tuple[TypeUrl, list[str]]] = [
        (TypeUrl.CLUSTER, []),
        (TypeUrl.LISTENER, []),
        (TypeUrl.SECRET, ["mesh-trust"]),
        (TypeUrl.ENDPOINT, ["out|backend"]),
        (TypeUrl.ROUTE, ["inbound"]),
    ]
    wire = [
        bytes(DiscoveryRequest(type_url=t, resource_names=names, node=Node(id="x")))
        for t, names in subs
    ]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sessions = []
    sent = 0
    t = time.process_time()
    for i in range(n):
        node = f"client-{i}"
        session = AdsSession(node, metrics, time.monotonic)
        for raw in wire:
            session.on_request(DiscoveryRequest.parse(raw))
        sent += sum(len(m) for m in session.responses(snaps[node]))
        sessions.append(session)
    per_stream_cpu = (time.process_time() - t) / n
    per_stream_mem = (tracemalloc.get_traced_memory()[0] - base) / n
    tracemalloc.stop()
    new_trust = TrustMaterial(TRUST.bundle_pem, b"crl-rotated")
    t = time.process_time()
    rotated = build_snapshots(state, policies, new_trust, packer=packer)
    pushed = sum(1 for s in sessions for _ in s.responses(rotated[s.node]))
    rotation_cpu = time.process_time() - t
    assert pushed == n, pushed
    return {
        "CPU per new stream (5 types answered)": per_stream_cpu,
        "memory per stream (bytes)": per_stream_mem,
        f"SDS/CRL rotation to all {n}: rebuild + encode (CPU)": rotation_cpu,
        "bytes sent per new stream": sent / n,
    }


def main() -> None:
    global ack_bytes
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    ack_bytes = bytes(
        DiscoveryRequest(version_info="abc", response_nonce="7", type_url=TypeUrl.CLUSTER,
                         resource_names=["out|backend"], node=Node(id="frontend"))
    )  # fmt: skip
    pb.uninstall_validator_cache()
    warm()
    results: dict[str, dict[str, float]] = {}
    for mode in ("naive", "cached"):
        if mode == "cached":
            assert pb.install_validator_cache()
        r = serialization(args.repeat)
        r.update(mesh_build(200))
        r.update(ads_clients(args.clients))
        results[mode] = r
    print(f"betterproto2 validator: naive (as shipped) vs cached per class; {args.clients} clients")
    print(f"{'measure':58} {'naive':>12} {'cached':>12} {'ratio':>7}")
    for key, naive in results["naive"].items():
        cached = results["cached"][key]
        raw = key.endswith("(bytes)") or key.startswith("bytes ")
        unit, scale = ("", 1) if raw else (" ms", 1000)
        print(f"{key:58} {naive * scale:10.3f}{unit:3} {cached * scale:10.3f}{unit:3} "
              f"{naive / cached if cached else float('nan'):6.1f}x")  # fmt: skip
    hand = results["cached"]["DiscoveryResponse hand-framed"]
    full = results["naive"]["DiscoveryResponse via betterproto2"]
    print(f"hand-framed response vs betterproto2 as shipped: {full / hand:.0f}x faster")


if __name__ == "__main__":
    main()
