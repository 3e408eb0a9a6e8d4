"""Several control-plane replicas on one PostgreSQL database (a throwaway cluster, initdb).

    .venv/bin/python benchmarks/bench_replicas.py [--attestations 400] [--concurrency 8]

Fan-out latency: replica A (this thread's event loop) attests ``--attestations`` times with
``--concurrency`` attestations in flight; replica B runs on its own thread and event loop with
its change feed (LISTEN/NOTIFY + catch-up read). For each attestation: the time from A's
announcement of it (A announces once its commit is durable) to B's announcement of the same
certificate (what B's xDS publisher pushes to the Envoys connected to B). Printed: median,
p99, max, against the 100 ms target; and, as the lower bound measured in the same run, one
round trip to the database (SELECT 1). In-process: both replicas share this process's GIL.

Throughput: real ``attestmesh controlplane`` processes on the same PostgreSQL cluster, driven by
``--clients`` client processes of ``--agents`` agents each (the agent's protocol: challenge,
sim evidence bound to a fresh key, attest), every agent attesting back to back for
``--seconds`` after a 2 s warm-up: first against one replica, then with the agents split over
two. Printed: attestations per second of each and their ratio (target >= 1.6x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
    ap.add_argument("--seconds", type=float, default=8.0, help="throughput: per phase")
    ap.add_argument("--clients", type=int, default=2, help="throughput: client processes")
    ap.add_argument("--agents", type=int, default=8, help="throughput: agents per client")
    ap.add_argument("--skip-throughput", action="store_true")
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
    if not args.skip_throughput:
        main_throughput(args.seconds, args.clients, args.agents)


# ---------------------------------------------------------------------------------------------
# Throughput: two replicas against one, real processes, same run

CLIENT = """
import asyncio, json, sys, time
import aiohttp
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from attestmesh.demo import GOOD
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context

class Sink:
    def update(self, chain, key):
        pass

async def main():
    cfg = json.loads(sys.argv[1])
    platform = load_pem_private_key(open(cfg["platform"], "rb").read(), None)
    bundle = open(cfg["bundle"], "rb").read()
    ok = failed = 0
    start = time.monotonic() + cfg["warmup"]
    end = start + cfg["seconds"]
    async def loop(name, token, url):
        nonlocal ok, failed
        agent = Agent(url=url, workload=name, source=SimEvidenceSource(platform, GOOD),
                      sink=Sink(), ssl_context=client_ssl_context(bundle), token=lambda: token)
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < end:
                try:
                    await agent.attest_once(session)
                    if time.monotonic() >= start:
                        ok += 1
                except AgentError:
                    failed += 1
    await asyncio.gather(*(loop(n, t, u) for n, t, u in cfg["agents"]))
    print(json.dumps({"ok": ok, "failed": failed}))

asyncio.run(main())
"""


def throughput(seconds: float, clients: int, per_client: int) -> dict[str, float]:
    import dataclasses
    import hashlib
    import json
    import subprocess
    import urllib.request

    import yaml
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from attestmesh.demo import NAMES, free_port, join_token, write_config

    root = Path(__file__).resolve().parents[1]
    results: dict[str, float] = {}
    with pg_cluster() as pg, tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        platform = ec.generate_private_key(ec.SECP256R1())
        (tmp / "platform.pem").write_bytes(
            platform.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        pub = tmp / "sim.pub.pem"
        pub.write_bytes(
            platform.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        ports = {
            n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES
        }
        base = write_config(tmp, ports, pub, {n: join_token(n) for n in NAMES})
        names = [f"w-{i:03d}" for i in range(clients * per_client)]
        tokens = {n: join_token(n) for n in names}
        (tmp / "workloads.yaml").write_text(
            yaml.safe_dump(
                {
                    "workloads": [
                        {
                            "name": n,
                            "namespace": "default",
                            "serviceAccount": "frontend",
                            "inbound": f"127.0.0.1:{20000 + i}",
                            "appPort": 21000 + i,
                            "outbound": {},
                            "tokenSha256": hashlib.sha256(tokens[n].encode()).hexdigest(),
                        }
                        for i, n in enumerate(names)
                    ]
                }
            )
        )
        for phase, count in (("1 replica", 1), ("2 replicas", 2)):
            url = pg.create_database(f"tp{count}")
            replicas = [
                dataclasses.replace(
                    base,
                    state_dir=tmp / f"{count}-state-{k}",
                    api_port=free_port(),
                    xds_port=free_port(),
                    ops_port=free_port(),
                )
                for k in range(count)
            ]
            procs = []
            try:
                for s in replicas:
                    args = [
                        sys.executable, "-m", "attestmesh.cli", "controlplane",
                        "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
                        "--workloads", str(s.registrations_file),
                        "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
                        "--ops-port", str(s.ops_port),
                        "--sim-platform-key", str(s.sim_platform_keys[0]),
                        "--attest-burst", "100000",
                    ]  # fmt: skip
                    procs.append(
                        subprocess.Popen(
                            args,
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env={**os.environ, "ATTESTMESH_STORE": url},
                        )
                    )
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        try:
                            with urllib.request.urlopen(
                                f"http://127.0.0.1:{s.ops_port}/readyz", timeout=1
                            ) as r:
                                if r.status == 200:
                                    break
                        except OSError:
                            time.sleep(0.1)
                bundle = replicas[0].state_dir / "ca" / "root.pem"
                urls = [f"https://localhost:{s.api_port}" for s in replicas]
                workers = []
                for c in range(clients):
                    agents = [
                        (n, tokens[n], urls[(c * per_client + j) % count])
                        for j, n in enumerate(names[c * per_client : (c + 1) * per_client])
                    ]
                    cfg = {
                        "platform": str(tmp / "platform.pem"),
                        "bundle": str(bundle),
                        "agents": agents,
                        "warmup": 2.0,
                        "seconds": seconds,
                    }
                    workers.append(
                        subprocess.Popen(
                            [sys.executable, "-c", CLIENT, json.dumps(cfg)],
                            stdout=subprocess.PIPE,
                            cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)},
                        )
                    )
                ok = failed = 0
                for w in workers:
                    out, _ = w.communicate(timeout=seconds + 60)
                    got = json.loads(out)
                    ok += got["ok"]
                    failed += got["failed"]
                results[phase] = ok / seconds
                results[f"{phase} failed"] = failed
            finally:
                for p in procs:
                    p.kill()
                    p.wait(10)
    return results


def main_throughput(seconds: float, clients: int, per_client: int) -> None:
    r = throughput(seconds, clients, per_client)
    one, two = r["1 replica"], r["2 replicas"]
    print(
        f"throughput, real processes, {clients} client processes x {per_client} agents, "
        f"{seconds:.0f} s each:\n"
        f"  1 replica  {one:.0f} attestations/s ({int(r['1 replica failed'])} failed)\n"
        f"  2 replicas {two:.0f} attestations/s ({int(r['2 replicas failed'])} failed)\n"
        f"  ratio {two / one:.2f}x (target >= 1.6x: {'met' if two / one >= 1.6 else 'NOT met'}; "
        f"{os.cpu_count()} cores, shared with the clients and PostgreSQL)"
    )


if __name__ == "__main__":
    main()
