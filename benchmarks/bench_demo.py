"""Demo timings over several runs (real Envoys): medians of start -> first mTLS request and
quarantine decision -> refused traffic. Run: python -m benchmarks.bench_demo [RUNS]"""

from __future__ import annotations

import asyncio
import contextlib
import io
import statistics
import sys
import tempfile
from pathlib import Path

from attestmesh.demo import run_demo_measured


async def main(runs: int) -> None:
    results: dict[str, list[float]] = {}
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            r = await run_demo_measured(Path(tmp))
        if r.exit_code != 0:
            raise SystemExit("a demo run failed its expectations")
        for k, v in r.timings_ms.items():
            results.setdefault(k, []).append(v)
    print(f"demo timings over {runs} runs (ms): median [min .. max]")
    for k, xs in results.items():
        print(f"  {k:32s} {statistics.median(xs):8.1f}  [{min(xs):.1f} .. {max(xs):.1f}]")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 5))
