"""Run every benchmark: python -m benchmarks

bench_scale certifies: it drives a real ``attestmesh controlplane`` process through its public
interfaces (workloads file, HTTPS API, mTLS ADS, ops API) and prints each figure next to its
target. It takes its arguments from BENCH_SCALE_ARGS (default: --n 1000,10000; e.g.
BENCH_SCALE_ARGS=--quick for a smoke run). The others are in-process micro-benchmarks that
explain where time goes. benchmarks.bench_connections (memory and CPU per connection of each
kind, real process, 10,000 streams) runs on its own: python -m benchmarks.bench_connections."""

from __future__ import annotations

import os
import runpy
import shlex
import sys

MODULES = [
    "benchmarks.bench_scale",
    "benchmarks.bench_verify",
    "benchmarks.bench_attest",
    "benchmarks.bench_offload",
    "benchmarks.bench_http",
    "benchmarks.bench_revocations",
    "benchmarks.bench_hsm",
    "benchmarks.bench_xds",
    "benchmarks.bench_delta",
    "benchmarks.bench_store",
    "benchmarks.bench_replicas",
    "benchmarks.bench_demo",
    "benchmarks.bench_nitro_bridge",
    "benchmarks.bench_beyond",
]
ARGS = {"benchmarks.bench_scale": shlex.split(os.environ.get("BENCH_SCALE_ARGS", "--n 1000,10000"))}

for name in MODULES:
    print(f"\n=== {name} ===", flush=True)
    sys.argv = [name, *ARGS.get(name, [])]
    runpy.run_module(name, run_name="__main__")
