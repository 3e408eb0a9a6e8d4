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
    ap.add_argument("--rounds", type=int, default=3, help="throughput: rounds (medians)")
    ap.add_argument("--profile", type=Path, help="throughput: py-spy raw profiles into DIR")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-fanout", action="store_true")
    args = ap.parse_args()
    if not args.skip_fanout:
        main_fanout(args.attestations, args.concurrency)
    if not args.skip_throughput:
        main_throughput(args.seconds, args.clients, args.agents, args.rounds, args.profile)


def main_fanout(attestations: int, concurrency: int) -> None:
    with pg_cluster() as pg, tempfile.TemporaryDirectory() as tmp:
        url = pg.create_database("bench")
        r = asyncio.run(run(url, Path(tmp) / "ca", attestations, concurrency))
    print(
        f"fan-out A commit -> B publish over {int(r['n'])} attestations "
        f"({concurrency} in flight), {int(r['missing'])} never reached B:\n"
        f"  median {r['median']:.1f} ms   p99 {r['p99']:.1f} ms (target <= {TARGET_P99_MS:.0f} ms: "
        f"{'met' if r['p99'] <= TARGET_P99_MS else 'NOT met'})   max {r['max']:.1f} ms\n"
        f"  lower bound, one database round trip: median {r['rtt']:.2f} ms "
        f"(p99 / round trip = {r['p99'] / r['rtt']:.0f}x)"
    )


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
    ssl = client_ssl_context(open(cfg["bundle"], "rb").read())
    ok = failed = 0
    print("ready", flush=True)  # imported: the parent starts every client at once
    sys.stdin.readline()
    start = time.monotonic() + cfg["warmup"]
    end = start + cfg["seconds"]
    async def loop(name, token, url, session):
        nonlocal ok, failed
        agent = Agent(url=url, workload=name, source=SimEvidenceSource(platform, GOOD),
                      sink=Sink(), ssl_context=ssl, token=lambda: token)
        while time.monotonic() < end:
            try:
                await agent.attest_once(session)
                if time.monotonic() >= start:
                    ok += 1
            except AgentError:
                failed += 1
    # one session (keep-alive pool) per client process, shared by its agents
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(loop(n, t, u, session) for n, t, u in cfg["agents"]))
    print(json.dumps({"ok": ok, "failed": failed}))

asyncio.run(main())
"""


def _ticks(pid: int) -> int:
    """CPU time (user + system, clock ticks) of one process so far; 0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _postgres_pids(postmaster: int) -> list[int]:
    """The postmaster and its backends (children)."""
    pids = [postmaster]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == postmaster:
                pids.append(int(d.name))
    return pids


def _sample_waits(url: str, seconds: float, into: dict[str, int]) -> None:
    """What the database's attestmesh sessions wait on, every 20 ms (``--profile``)."""
    with psycopg.connect(url, autocommit=True) as conn:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            rows = conn.execute(
                "SELECT application_name, state, coalesce(wait_event_type, 'CPU'), "
                "coalesce(wait_event, ''), left(query, 60) FROM pg_stat_activity "
                "WHERE application_name LIKE 'attestmesh%' AND pid <> pg_backend_pid()"
            ).fetchall()
            for app, state, kind, event, query in rows:
                if state == "active":
                    key = f"{app.split()[0]} {kind}:{event} {query!r}"
                    into[key] = into.get(key, 0) + 1
            time.sleep(0.02)


def throughput(
    seconds: float, clients: int, per_client: int, profile: Path | None = None
) -> dict[str, float]:
    """Attestations per second with one replica, then two (fresh databases on one cluster),
    and the CPU each role used during the measured window (cores: CPU seconds / seconds)."""
    import json
    import subprocess

    from tests.pg.processes import start, stop_all, wait_ready, write_mesh

    root = Path(__file__).resolve().parents[1]
    tick = os.sysconf("SC_CLK_TCK")
    warmup = 2.0
    results: dict[str, float] = {}
    with pg_cluster() as pg, tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        names = [f"w-{i:03d}" for i in range(clients * per_client)]
        mesh = write_mesh(tmp, names)
        for phase, count in (("1 replica", 1), ("2 replicas", 2)):
            url = pg.create_database(f"tp{count}")
            replicas = [mesh.replica(k if count == 1 else k + 1) for k in range(count)]
            procs: list[subprocess.Popen[bytes]] = []
            try:
                for k, s in enumerate(replicas):
                    log = tmp / f"{count}-{k}.log"
                    procs.append(start(s, log, url, burst=100_000))
                    wait_ready(s, procs[-1], log)
                bundle = replicas[0].state_dir / "ca" / "root.pem"
                urls = [f"https://localhost:{s.api_port}" for s in replicas]
                workers = []
                for c in range(clients):
                    agents = [
                        (n, mesh.tokens[n], urls[(c * per_client + j) % count])
                        for j, n in enumerate(names[c * per_client : (c + 1) * per_client])
                    ]
                    cfg = {
                        "platform": str(mesh.platform_pem),
                        "bundle": str(bundle),
                        "agents": agents,
                        "warmup": warmup,
                        "seconds": seconds,
                    }
                    workers.append(
                        subprocess.Popen(
                            [sys.executable, "-c", CLIENT, json.dumps(cfg)],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)},
                        )
                    )
                for w in workers:  # every client imported and connected: go, all at once
                    assert w.stdout is not None and w.stdin is not None
                    assert w.stdout.readline().strip() == b"ready"
                for w in workers:
                    assert w.stdin is not None
                    w.stdin.write(b"go\n")
                    w.stdin.flush()
                time.sleep(warmup)
                assert pg.process is not None
                roles = {
                    "replicas": [p.pid for p in procs],
                    "clients": [w.pid for w in workers],
                    "postgres": _postgres_pids(pg.process.pid),
                }
                spies = []
                if profile is not None:
                    profile.mkdir(parents=True, exist_ok=True)
                    for role in ("replicas", "clients"):
                        for k, pid in enumerate(roles[role]):
                            out = profile / f"{count}-{role}-{k}.txt"
                            spy = [str(Path(sys.executable).parent / "py-spy"), "record"]
                            spy += ["--pid", str(pid), "--duration", str(int(seconds) - 1)]
                            spy += ["--format", "raw", "--rate", "50", "--nonblocking"]
                            spies.append(
                                subprocess.Popen(
                                    [*spy, "-o", str(out)],
                                    stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL,
                                )
                            )
                waits: dict[str, int] = {}
                sampler = None
                if profile is not None:
                    sampler = threading.Thread(target=_sample_waits, args=(url, seconds, waits))
                    sampler.start()
                before = {r: sum(_ticks(p) for p in pids) for r, pids in roles.items()}
                load_before = os.getloadavg()[0]
                t0 = time.monotonic()
                time.sleep(seconds)
                elapsed = time.monotonic() - t0
                after = {r: sum(_ticks(p) for p in pids) for r, pids in roles.items()}
                for r in roles:
                    results[f"{phase} cpu {r}"] = (after[r] - before[r]) / tick / elapsed
                results[f"{phase} load"] = (load_before + os.getloadavg()[0]) / 2
                ok = failed = 0
                for w in workers:
                    assert w.stdout is not None
                    out_b = w.stdout.read()
                    w.wait(seconds + 60)
                    got = json.loads(out_b)
                    ok += got["ok"]
                    failed += got["failed"]
                for spy in spies:
                    spy.wait(seconds + 30)
                if sampler is not None and profile is not None:
                    sampler.join()
                    top = sorted(waits.items(), key=lambda kv: -kv[1])
                    (profile / f"{count}-postgres-waits.txt").write_text(
                        "".join(f"{n} {w}\n" for w, n in top)
                    )
                results[phase] = ok / seconds
                results[f"{phase} failed"] = failed
            finally:
                stop_all(procs)
    return results


def main_throughput(
    seconds: float, clients: int, per_client: int, rounds: int, profile: Path | None
) -> None:
    runs = [throughput(seconds, clients, per_client, profile) for _ in range(rounds)]
    print(
        f"throughput, real processes, {clients} client processes x {per_client} agents, "
        f"{seconds:.0f} s per phase, {rounds} round(s) (each: 1 replica, then 2, same "
        f"cluster); {os.cpu_count()} cores shared by the replicas, the clients, PostgreSQL "
        "and whatever else runs on the machine"
    )
    for k, r in enumerate(runs):
        line = f"  round {k + 1}: ratio {r['2 replicas'] / r['1 replica']:.2f}x"
        for phase in ("1 replica", "2 replicas"):
            cpu = "  ".join(
                f"{role} {r[f'{phase} cpu {role}']:.2f}"
                for role in ("replicas", "clients", "postgres")
            )
            line += (
                f"\n    {phase:10} {r[phase]:5.0f}/s ({int(r[f'{phase} failed'])} failed)  "
                f"cores: {cpu}  load {r[f'{phase} load']:.1f}"
            )
        print(line)
    # What two cores allow, from the CPU each role used per attestation: one replica is bound
    # by its event loop (one core: 1/R1 per second), two replicas by the machine (cores/T2)
    cores = os.cpu_count() or 1

    def per(r: dict[str, float], phase: str, role: str) -> float:
        return r[f"{phase} cpu {role}"] / r[phase] * 1000  # CPU ms per attestation

    roles = ("replicas", "clients", "postgres")
    for k, r in enumerate(runs):
        r1 = per(r, "1 replica", "replicas")
        t1 = sum(per(r, "1 replica", x) for x in roles)
        t2 = sum(per(r, "2 replicas", x) for x in roles)
        c2 = per(r, "2 replicas", "clients")
        r["bound"] = cores * r1 / t2
        r["bound_free"] = cores * r1 / t1
        r["bound_no_clients"] = cores * r1 / (t2 - c2)
        print(
            f"  round {k + 1} CPU ms per attestation: 1 replica {t1:.2f} (replica {r1:.2f}), "
            f"2 replicas {t2:.2f} (clients {c2:.2f}); bound on {cores} cores: ratio <= "
            f"{cores}*{r1:.2f}/{t2:.2f} = {r['bound']:.2f}x ({r['bound_free']:.2f}x if "
            f"replication cost nothing, {r['bound_no_clients']:.2f}x if the clients cost nothing)"
        )
    one = statistics.median(r["1 replica"] for r in runs)
    two = statistics.median(r["2 replicas"] for r in runs)
    ratio = statistics.median(r["2 replicas"] / r["1 replica"] for r in runs)
    print(
        f"  median: 1 replica {one:.0f}/s, 2 replicas {two:.0f}/s, ratio {ratio:.2f}x "
        f"(target >= 1.6x: {'met' if ratio >= 1.6 else 'NOT met'}); the CPU bound's median "
        f"{statistics.median(r['bound'] for r in runs):.2f}x (with free clients "
        f"{statistics.median(r['bound_no_clients'] for r in runs):.2f}x)"
    )


if __name__ == "__main__":
    main()
