"""Several control-plane replicas on one PostgreSQL database (a throwaway cluster, initdb).

    .venv/bin/python benchmarks/bench_replicas.py [--attestations 400] [--concurrency 8]

Fan-out latency: replica A (this thread's event loop) attests ``--attestations`` times with
``--concurrency`` attestations in flight; replica B runs on its own thread and event loop with
its change feed (LISTEN/NOTIFY + catch-up read). For each attestation: the time from A's
announcement of it (A announces once its commit is durable) to B's announcement of the same
certificate (what B's xDS publisher pushes to the Envoys connected to B). Printed: median,
p99, max, against the 100 ms target; and, as the lower bound measured in the same run, one
round trip to the database (SELECT 1). In-process: both replicas share this process's GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from tests.pg.replicas import Replica
from tests.pg_harness import pg_cluster
from tests.unit.fixtures_core import NOW, Clock, RecordingPublisher, registration

TARGET_P99_MS = 100.0


class TimedPublisher(RecordingPublisher):
    """When each (workload, certificate serial) was first announced."""

    def __init__(self) -> None:
        super().__init__()
        self.first_seen: dict[tuple[str, int], float] = {}

    def publish(self, state: Any, mesh_policies: Any, trust: Any, changed: Any = None) -> None:
        now = time.perf_counter()
        for name in changed or ():
            w = state.workloads.get(name)
            for c in w.certificates if w is not None else ():  # live ones (coalesced)
                self.first_seen.setdefault((name, c.serial), now)
        for r in state.revocations[-64:]:  # superseded by a renewal in the same read
            self.first_seen.setdefault((r.workload, r.serial), now)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run(url: str, ca_dir: Path, attestations: int, concurrency: int) -> dict[str, float]:
    clock = Clock(NOW)
    names = [f"web-{i}" for i in range(concurrency * 4)]
    on_a, on_b = TimedPublisher(), TimedPublisher()
    a = Replica(url, ca_dir, clock, publisher=on_a)
    await a.register([registration(n, port=15001 + i) for i, n in enumerate(names)])
    ready, stop = threading.Event(), threading.Event()
    holder: list[Replica] = []

    def replica_b() -> None:
        async def main() -> None:
            b = Replica(url, ca_dir, clock, follow_changes=True, publisher=on_b)
            holder.append(b)
            ready.set()
            await asyncio.to_thread(stop.wait)
            b.close()

        asyncio.run(main())

    thread = threading.Thread(target=replica_b, name="replica-b")
    thread.start()
    ready.wait(30)
    try:
        done = 0
        serials: list[tuple[str, int]] = []

        async def worker(k: int) -> None:
            nonlocal done
            while done < attestations:
                done += 1
                name = names[(k + done) % len(names)]
                serials.append((name, (await a.attest(name)).serial))

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        for _ in range(1000):  # at most 10 s for the last ones to reach B
            if all(s in on_b.first_seen for s in serials):
                break
            await asyncio.sleep(0.01)
        missing = [s for s in serials if s not in on_b.first_seen]
        lat = [
            (on_b.first_seen[s] - on_a.first_seen[s]) * 1000
            for s in serials
            if s in on_b.first_seen and s in on_a.first_seen
        ]
    finally:
        stop.set()
        thread.join(30)
        a.close()
    with psycopg.connect(url, autocommit=True) as conn:
        rtt = []
        for _ in range(200):
            t = time.perf_counter()
            conn.execute("SELECT 1").fetchone()
            rtt.append((time.perf_counter() - t) * 1000)
    return {
        "n": float(len(lat)),
        "missing": float(len(missing)),
        "median": statistics.median(lat),
        "p99": pct(lat, 0.99),
        "max": max(lat),
        "rtt": statistics.median(rtt),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--attestations", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    with pg_cluster() as pg, tempfile.TemporaryDirectory() as tmp:
        url = pg.create_database("bench")
        r = asyncio.run(run(url, Path(tmp) / "ca", args.attestations, args.concurrency))
    print(
        f"fan-out A commit -> B publish over {int(r['n'])} attestations "
        f"({args.concurrency} in flight), {int(r['missing'])} never reached B:\n"
        f"  median {r['median']:.1f} ms   p99 {r['p99']:.1f} ms (target <= {TARGET_P99_MS:.0f} ms: "
        f"{'met' if r['p99'] <= TARGET_P99_MS else 'NOT met'})   max {r['max']:.1f} ms\n"
        f"  lower bound, one database round trip: median {r['rtt']:.2f} ms "
        f"(p99 / round trip = {r['p99'] / r['rtt']:.0f}x)"
    )


if __name__ == "__main__":
    main()
