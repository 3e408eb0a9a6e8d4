"""Run every benchmark: python -m benchmarks

bench_scale (the real control-plane process at scale, issue 7) takes its arguments from
BENCH_SCALE_ARGS (default: --n 1000,10000; e.g. BENCH_SCALE_ARGS=--quick for a smoke run)."""

from __future__ import annotations

import os
import runpy
import shlex
import sys

MODULES = [
    "benchmarks.bench_verify",
    "benchmarks.bench_attest",
    "benchmarks.bench_xds",
    "benchmarks.bench_demo",
    "benchmarks.bench_scale",
]
ARGS = {"benchmarks.bench_scale": shlex.split(os.environ.get("BENCH_SCALE_ARGS", "--n 1000,10000"))}

for name in MODULES:
    print(f"\n=== {name} ===", flush=True)
    sys.argv = [name, *ARGS.get(name, [])]
    runpy.run_module(name, run_name="__main__")
