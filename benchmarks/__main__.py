"""Run every benchmark: python -m benchmarks"""

from __future__ import annotations

import runpy
import sys

MODULES = [
    "benchmarks.bench_verify",
    "benchmarks.bench_attest",
    "benchmarks.bench_xds",
    "benchmarks.bench_demo",
]

for name in MODULES:
    print(f"\n=== {name} ===", flush=True)
    sys.argv = [name]
    runpy.run_module(name, run_name="__main__")
