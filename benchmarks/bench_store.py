"""State store cost: synchronous SqliteStore against GroupCommitStore, and start-up load.

    .venv/bin/python benchmarks/bench_store.py [--seconds 1.5] [--repeat 3] [--workloads 10000]

Attestation-like batches (one workload upsert with a fresh certificate + one ATTESTED event, on a
store already holding ``--workloads`` attested workloads) are written by 1 / 8 / 64 concurrent
asyncio tasks, each waiting for its batch to be durable before it writes the next, as an
attestation handler does. Measured in the same run for both stores (medians over ``--repeat``):

- durable batches per second, commits (= WAL fsyncs) per second, batches per commit;
- ``write()`` call time on the loop (the synchronous store commits and fsyncs inside it): wall
  time (max, p99; includes any wait for the GIL or for a core on a busy machine) and the loop
  thread's own CPU time inside the call (max);
- loop lag: how late a 1 ms timer fires while the writers run (what every other request sees);
- latency from ``write()`` to durable.

Then the CPU time of ``load()`` with ``--workloads`` rows (start-up), median of ``--repeat``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from certs.evidence.claims import Claims, Tee
from xds.state import (
    AttestationRecord,
    Endpoint,
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    Registration,
    Status,
    WorkloadState,
)
from xds.store import Batch, GroupCommitStore, SqliteStore

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TRUST = "mesh.example"
CONCURRENCY = (1, 8, 64)


def attested(name: str, serial: int) -> WorkloadState:
    """A realistic row: registration with outbound/labels/token hash, attestation with claims."""
    claims = Claims(
        tee=Tee.SEV_SNP,
        measurements={"measurement": "ab" * 48, "host_data": "00" * 32},
        report_data=bytes(64),
        debug=False,
        evidence_sha256="cd" * 32,
        signer="ef" * 48,
        svn=4,
        platform_id="12" * 64,
        tcb={"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
        details={"policy": "0x3001f", "vmpl": 0},
    )
    reg = Registration(
        name=name,
        namespace="default",
        service_account="web",
        service="web",
        inbound=Endpoint("10.0.0.1", 15001),
        app_port=8080,
        outbound={"db": 15002, "cache": 15003},
        labels={"app": "web"},
        token_sha256="0f" * 32,
    )
    record = AttestationRecord("sev_snp", dict(claims.measurements), "default/pol", "cd" * 32, NOW)
    return WorkloadState(
        reg,
        Status.ATTESTED,
        replace(record, claims=claims),
        NOW + timedelta(hours=1),
        (IssuedCert(2**150 + serial, NOW + timedelta(hours=2)),),
    )


def attestation_batch(name: str, serial: int) -> Batch:
    return Batch(
        upserts={name: attested(name, serial)},
        events=(Event(EventKind.ATTESTED, name, NOW, "default/pol"),),
    )


def populate(path: Path, n: int) -> None:
    store = SqliteStore(path)
    try:
        for start in range(0, n, 1000):
            names = [f"w-{i:05d}" for i in range(start, min(n, start + 1000))]
            store.write(Batch(upserts={x: attested(x, i) for i, x in enumerate(names)}))
    finally:
        store.close()


@dataclass(frozen=True, slots=True)
class Run:
    batches_per_s: float
    commits_per_s: float
    batches_per_commit: float
    write_call_max_us: float  # wall: includes waiting for the GIL or for a core
    write_call_p99_us: float
    write_cpu_max_us: float  # the loop thread's own CPU inside write()
    loop_lag_max_ms: float
    loop_lag_p99_ms: float
    durable_p50_ms: float
    durable_p99_ms: float
    cpu_per_batch_us: float  # process CPU (every thread) per durable batch


def p99(xs: list[float]) -> float:
    return (
        statistics.quantiles(xs, n=100, method="inclusive")[98]
        if len(xs) >= 2
        else (xs[0] if xs else 0.0)
    )


async def drive(
    store: SqliteStore | GroupCommitStore, tasks: int, seconds: float, batches: list[list[Batch]]
) -> Run:
    calls: list[float] = []
    cpu_calls: list[float] = []
    durable: list[float] = []
    lags: list[float] = []
    done = 0
    stop = False
    commits0 = store.stats().commits

    async def writer(k: int) -> None:
        nonlocal done
        i = 0
        mine = batches[k]
        while not stop:
            c0 = time.thread_time()
            t0 = time.perf_counter()
            fut = store.write(mine[i % len(mine)])
            t1 = time.perf_counter()
            cpu_calls.append(time.thread_time() - c0)
            if fut is not None:
                await fut
            else:
                await asyncio.sleep(0)  # let the other tasks (and the lag probe) run
            calls.append(t1 - t0)
            durable.append(time.perf_counter() - t0)
            done += 1
            i += 1

    async def probe() -> None:
        while not stop:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t0 - 0.001)

    started = time.perf_counter()
    cpu0 = time.process_time()
    running = [asyncio.create_task(writer(k)) for k in range(tasks)]
    running.append(asyncio.create_task(probe()))
    await asyncio.sleep(seconds)
    stop = True
    await asyncio.gather(*running)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu0
    commits = store.stats().commits - commits0
    return Run(
        batches_per_s=done / elapsed,
        commits_per_s=commits / elapsed,
        batches_per_commit=done / max(commits, 1),
        write_call_max_us=max(calls) * 1e6,
        write_call_p99_us=p99(calls) * 1e6,
        write_cpu_max_us=max(cpu_calls) * 1e6,
        loop_lag_max_ms=max(lags) * 1e3,
        loop_lag_p99_ms=p99(lags) * 1e3,
        durable_p50_ms=statistics.median(durable) * 1e3,
        durable_p99_ms=p99(durable) * 1e3,
        cpu_per_batch_us=cpu / max(done, 1) * 1e6,
    )


def median_run(runs: list[Run]) -> Run:
    return Run(
        *(
            statistics.median(getattr(r, f) for r in runs)
            for f in Run.__dataclass_fields__  # declaration order
        )
    )


def measure(
    open_store: Callable[[], SqliteStore | GroupCommitStore],
    tasks: int,
    seconds: float,
    repeat: int,
) -> Run:
    batches = [
        [attestation_batch(f"w-{k:05d}", 10_000 * k + j) for j in range(8)] for k in range(tasks)
    ]
    runs = []
    for _ in range(repeat):
        store = open_store()
        try:
            runs.append(asyncio.run(drive(store, tasks, seconds, batches)))
        finally:
            store.close()
    return median_run(runs)


def load_cpu(path: Path, repeat: int) -> tuple[float, int]:
    samples = []
    size = 0
    for _ in range(repeat):
        store = SqliteStore(path)
        try:
            t0 = time.process_time()
            state: MeshState = store.load(TRUST)
            samples.append(time.process_time() - t0)
            size = len(state.workloads)
        finally:
            store.close()
    return statistics.median(samples), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workloads", type=int, default=10_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        path = Path(tmp) / "state.sqlite3"
        populate(path, args.workloads)
        print(
            f"store with {args.workloads} attested workloads; {args.seconds:g} s per run, "
            f"median of {args.repeat}; batch = 1 upsert + 1 event"
        )
        header = (
            f"{'store':<7}{'tasks':>6}{'batches/s':>11}{'commits/s':>11}{'per fsync':>10}"
            f"{'write() max':>13}{'p99':>9}{'CPU max':>9}{'loop lag max':>14}{'p99':>9}"
            f"{'durable p50':>13}{'p99':>9}{'CPU/batch':>11}"
        )
        print(header)
        results: dict[tuple[str, int], Run] = {}
        for tasks in CONCURRENCY:
            for kind, opener in (
                ("sync", lambda: SqliteStore(path)),
                ("group", lambda: GroupCommitStore(SqliteStore(path))),
            ):
                r = measure(opener, tasks, args.seconds, args.repeat)
                results[(kind, tasks)] = r
                print(
                    f"{kind:<7}{tasks:>6}{r.batches_per_s:>11.0f}{r.commits_per_s:>11.0f}"
                    f"{r.batches_per_commit:>10.1f}{r.write_call_max_us:>11.0f}us"
                    f"{r.write_call_p99_us:>7.0f}us{r.write_cpu_max_us:>7.0f}us"
                    f"{r.loop_lag_max_ms:>12.2f}ms"
                    f"{r.loop_lag_p99_ms:>7.2f}ms{r.durable_p50_ms:>11.2f}ms"
                    f"{r.durable_p99_ms:>7.2f}ms{r.cpu_per_batch_us:>9.0f}us",
                    flush=True,
                )
        print("\ngroup / sync, same run:")
        for tasks in CONCURRENCY:
            g, s = results[("group", tasks)], results[("sync", tasks)]
            print(
                f"  {tasks:>2} tasks: durable batches/s x{g.batches_per_s / s.batches_per_s:.2f}; "
                f"write() on the loop p99 {g.write_call_p99_us:.0f} us vs "
                f"{s.write_call_p99_us:.0f} us (x{g.write_call_p99_us / s.write_call_p99_us:.3f}), "
                f"max {g.write_call_max_us:.0f} us vs {s.write_call_max_us:.0f} us; "
                f"batches per fsync {g.batches_per_commit:.1f} vs {s.batches_per_commit:.1f}"
            )
        cpu, n = load_cpu(path, args.repeat)
        print(
            f"\nload() of {n} workloads: {cpu:.3f} s CPU ({cpu / max(n, 1) * 1e6:.1f} us per row); "
            "target well under 1 s"
        )


if __name__ == "__main__":
    main()
