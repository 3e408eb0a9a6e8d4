"""Explains bench_scale's quarantine CPU: the control plane's Python per caller stream, without
TLS, sockets or other processes. bench_scale's mesh (N workloads, N/2 callers of ``target``) is
published by the real publisher into a real cache, and every node holds a delta ADS stream on a
real ``xds.adsconn.AdsConnection`` (HTTP/2, gRPC framing, the delta session), its client
``benchmarks.scale_ads.Stream`` (the Envoy-like client bench_scale runs in other processes)
joined to it by in-memory transports. Then w1 is quarantined (with a new CRL) and released and
attested again in turn, as ``bench_quarantine --in-process`` does, and the server's CPU is
timed in three parts (``time.thread_time``, the clients' CPU left out): the publish (patching
the callers' snapshots and waking their streams), the pushes (each woken stream's responses,
framed and written), and taking in what the clients sent (their ACKs). Medians per caller over
``--rounds``, the survivors frozen before each (as the control plane's ``GcPolicy`` freezes
them every second); ``--profile FILE``: cProfile of the server's parts of the last round
(``--profile-round K``: of round K).

Run: ``python -m benchmarks.bench_push --n 10000 --rounds 5``
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from benchmarks.bench_quarantine import attested_mesh
from benchmarks.bench_scale import CALLER_SAS
from benchmarks.scale_ads import Stream
from benchmarks.scale_ads import Worker as ClientWorker
from xds.adsconn import LeanAds, _Pushes
from xds.build import TrustMaterial
from xds.cache import SnapshotCache
from xds.meshpolicy import MeshPolicy, Rule, Source
from xds.publisher import XdsPublisher
from xds.server import AdsServer
from xds.state import (
    Trigger,
    quarantine,
    release,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Spent:
    """The server's CPU by part, and an optional profiler switched on around each part."""

    def __init__(self) -> None:
        self.parts = {"publish": 0.0, "push": 0.0, "receive": 0.0}
        self.profiler: cProfile.Profile | None = None

    def timed(self, part: str, fn: Callable[[], None]) -> None:
        prof = self.profiler
        t0 = time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            fn()
        finally:
            if prof is not None:
                prof.disable()
            self.parts[part] += time.thread_time() - t0

    def reset(self) -> None:
        self.parts = dict.fromkeys(self.parts, 0.0)


SPENT = Spent()


class _TimedPushes(_Pushes):
    __slots__ = ()

    def _run(self) -> None:
        SPENT.timed("push", super()._run)


class Pipe(asyncio.Transport):
    """One direction of an in-memory connection: what is written is queued for the peer's
    ``data_received``, delivered by :meth:`Wire.drain`."""

    def __init__(self, wire: Wire, peer: asyncio.Protocol, server_side: bool) -> None:
        super().__init__()
        self._wire, self._peer, self._server_side = wire, peer, server_side

    def write(self, data: Any) -> None:
        self._wire.queue.append((self._peer, bytes(data), not self._server_side))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class Wire:
    def __init__(self) -> None:
        self.queue: deque[tuple[asyncio.Protocol, bytes, bool]] = deque()

    async def drain(self) -> None:
        """Deliver until nothing is queued and no push is due (the loop's callbacks run)."""
        idle = 0
        while idle < 3:
            if not self.queue:
                idle += 1
                await asyncio.sleep(0)
                continue
            idle = 0
            while self.queue:
                peer, data, to_server = self.queue.popleft()
                if to_server:
                    SPENT.timed("receive", lambda p=peer, d=data: p.data_received(d))
                else:
                    peer.data_received(data)


async def run(n: int, rounds: int, profile: str | None, profile_round: int = -1) -> None:
    state, nodes, callers, attest = attested_mesh(n, "bench-push", NOW)
    sources = tuple(Source("default", f"client-{k}") for k in range(CALLER_SAS))
    policies = [MeshPolicy("to-target", "default", "target", (Rule(sources, None, ()),))]
    trust = TrustMaterial(b"bundle", b"crl-0")
    cache = SnapshotCache()
    deferred: list[Callable[[], None]] = []
    loop = asyncio.get_running_loop()

    def soon(fn: Callable[[], None]) -> None:
        loop.call_soon(SPENT.timed, "publish", fn)

    pub = XdsPublisher(cache, defer=deferred.append, soon=soon)
    pub.publish(state, policies, trust)
    lean = LeanAds(AdsServer(cache))
    lean.pushes = _TimedPushes()
    wire = Wire()
    client_worker = ClientWorker()
    streams: list[Stream] = []
    caller_set = set(callers)
    for node in nodes:
        server = lean.protocol()
        client = Stream(client_worker, node, node in caller_set)
        server.connection_made(Pipe(wire, client, server_side=True))
        client.connection_made(Pipe(wire, server, server_side=False))
        streams.append(client)  # (the servers: lean.connections holds them)
        if len(wire.queue) > 2000:
            await wire.drain()
    await wire.drain()
    unsynced = sum(not s.synced() for s in streams)
    if unsynced:
        raise SystemExit(f"{unsynced} of {n} streams not configured")
    per_caller: dict[str, list[float]] = {k: [] for k in (*SPENT.parts, "total")}
    for k in range(rounds):
        # what the control plane's GcPolicy does every second: the survivors are frozen, so no
        # full collection of the mesh's millions of objects lands in a round
        gc.collect()
        gc.freeze()
        quarantined, _ = quarantine(state, "w1", Trigger.OPERATOR, "bench", NOW)
        crl = replace(trust, crl_pem=f"crl-{2 * k + 1}".encode())
        before = sum(s.responses for s in streams)
        SPENT.reset()
        if profile and k == (profile_round if profile_round >= 0 else rounds - 1):
            SPENT.profiler = cProfile.Profile()
        SPENT.timed("publish", functools.partial(pub.publish, quarantined, policies, crl, {"w1"}))
        await wire.drain()
        SPENT.profiler, prof = None, SPENT.profiler
        got = sum(s.responses for s in streams) - before
        for part, spent in SPENT.parts.items():
            per_caller[part].append(spent / len(callers))
        per_caller["total"].append(sum(SPENT.parts.values()) / len(callers))
        print(
            f"round {k}: {got} responses; per caller (us): "
            + ", ".join(f"{p} {1e6 * v / len(callers):.1f}" for p, v in SPENT.parts.items()),
            flush=True,
        )
        if prof is not None and profile:
            prof.dump_stats(profile)
        deferred.clear()  # the coalesced CRL fan-out is not this figure
        released, _ = release(quarantined, "w1", NOW)
        state = attest(released, "w1")
        trust = replace(trust, crl_pem=f"crl-{2 * k + 2}".encode())
        pub.publish(state, policies, trust, {"w1"})
        await wire.drain()
    print(
        f"N={n}, {len(callers)} callers: server CPU per caller, median of {rounds} (us): "
        + ", ".join(f"{p} {1e6 * statistics.median(v):.1f}" for p, v in per_caller.items()),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_push", description=__doc__)
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile", help="cProfile of one round's server parts into this file")
    p.add_argument("--profile-round", type=int, default=-1, help="that round (default: the last)")
    args = p.parse_args(argv)
    asyncio.run(run(args.n, args.rounds, args.profile, args.profile_round))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
