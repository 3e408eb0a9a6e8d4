"""Explains part of bench_scale's server CPU per attestation: what handing an attestation to a
worker process costs the control plane's event loop (encode the job, read the answer), and what
the worker spends besides the job itself (decode it, encode the answer).

The pipe's codec (``certs.offload.JobEncoder`` / ``JobDecoder``, ``encode_answer`` /
``decode_answer``: tuples of builtins, each policy and signing intermediate sent to a worker
once) is measured against what it replaced, measured in the same run: the ``Job`` and the
``(Admitted, Leaf)`` answer pickled as dataclasses (their fields one by one in Python code,
the policies and the intermediate with every job), and the claims made read-only again. Then
the event loop's CPU per job through a real ``WorkerProcesses`` with one worker (8 jobs in
flight), and the jobs per second it answers. Medians of several rounds (the machine is
shared).

Run: ``python -m benchmarks.bench_offload``
"""

from __future__ import annotations

import asyncio
import pickle
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from attestmesh.controlplane.workers import WorkerProcesses
from certs import offload
from certs.ca import CertificateAuthority
from certs.issuance import read_only_claims
from tests.unit.fixtures_core import TRUST_DOMAIN
from tests.unit.test_offload import PLATFORM_PEM, POLICIES, SPIFFE, sim_request

RECIPE = offload.VerifierRecipe(offload.configured_verifiers, (None, (PLATFORM_PEM,)))


def _us(fn: Callable[[], object], number: int = 2_000) -> float:
    """Microseconds per call: the median of 7 repeats."""
    return statistics.median(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def codec_figures(ca: CertificateAuthority) -> None:
    material = ca.signing_material()
    assert material is not None
    job = offload.Job(sim_request(), POLICIES, material, SPIFFE, 1, datetime.now(UTC))
    offload.init_worker(RECIPE)
    admitted, leaf = offload.run_job(job)
    encoder = offload.JobEncoder()
    encoder.encode(job)  # (the worker holds the policies and the intermediate from now on)
    decoder = offload.JobDecoder()
    decoder.decode(offload.JobEncoder().encode(job))
    frame, answer = encoder.encode(job), offload.encode_answer(admitted, leaf)
    portable = replace(
        admitted,
        claims=replace(
            admitted.claims,
            measurements=dict(admitted.claims.measurements),
            tcb=dict(admitted.claims.tcb),
            details=dict(admitted.claims.details),
        ),
    )
    old_job = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
    old_answer = pickle.dumps(("ok", (portable, leaf)), protocol=pickle.HIGHEST_PROTOCOL)

    def old_loop_side() -> object:
        pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)
        _, (a, _leaf) = pickle.loads(old_answer)  # noqa: S301
        return replace(a, claims=read_only_claims(a.claims))

    def old_worker_side() -> object:
        pickle.loads(old_job)  # noqa: S301
        return pickle.dumps(("ok", (portable, leaf)), protocol=pickle.HIGHEST_PROTOCOL)

    def new_loop_side() -> object:
        encoder.encode(job)
        return offload.decode_answer(answer)

    def new_worker_side() -> object:
        decoder.decode(frame)
        return offload.encode_answer(admitted, leaf)

    print(f"job frame: {len(frame)} bytes (pickled Job: {len(old_job)})")
    for side, old, new in (
        ("event loop (encode the job, decode the answer)", old_loop_side, new_loop_side),
        ("worker (decode the job, encode the answer)", old_worker_side, new_worker_side),
    ):
        a, b = _us(old), _us(new)
        print(f"{side}: {b:.1f} us per job; pickled dataclasses {a:.1f} us ({a / b:.1f}x)")


async def pool_figures(ca: CertificateAuthority, rounds: int = 7, n: int = 800) -> None:
    material = ca.signing_material()
    assert material is not None
    pool = WorkerProcesses(1, RECIPE)
    pool.start()
    try:
        for _ in range(1_500):  # (an interpreter starts in well under 30 s)
            if pool.ready:
                break
            await asyncio.sleep(0.02)
        requests = [sim_request() for _ in range(64)]
        now = datetime.now(UTC)
        per_job, rates = [], []
        gate = asyncio.Semaphore(8)
        for _ in range(rounds):

            async def one(i: int) -> None:
                async with gate:
                    job = offload.Job(requests[i % 64], POLICIES, material, SPIFFE, i + 1, now)
                    await pool.run(job)

            cpu, wall = time.thread_time(), time.monotonic()
            await asyncio.gather(*(one(i) for i in range(n)))
            per_job.append((time.thread_time() - cpu) / n * 1e6)
            rates.append(n / (time.monotonic() - wall))
        print(
            f"through WorkerProcesses (1 worker, 8 in flight): the event loop's CPU "
            f"{statistics.median(per_job):.1f} us per job (the harness's tasks included), "
            f"{statistics.median(rates):,.0f} jobs/s"
        )
    finally:
        await pool.aclose()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        ca = CertificateAuthority.load_or_create(
            Path(tmp) / "ca", TRUST_DOMAIN, datetime.now(UTC) - timedelta(days=1)
        )
        codec_figures(ca)
        asyncio.run(pool_figures(ca))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
