"""What ``make native`` buys through the real process: the control plane's CPU per quarantine
(``benchmarks.bench_quarantine``: a real ``attestmesh controlplane``, mTLS delta-ADS streams,
the ops API) with the ADS hot path from its sources (``ATTESTMESH_NATIVE=0``) and compiled, in
interleaved pairs of runs, each a fresh control plane. This shared machine's speed drifts by a
quarter within minutes, so it takes pairs side by side, several of them, and prints the median
of each side and the median of the pairs' ratios (a few pairs can look like noise: 10 pairs of
4 rounds each at N = 10,000 take ~20 minutes).

Run: ``python -m benchmarks.bench_native [--n 10000] [--pairs 10] [--rounds 4]`` (after ``make
native``; it refuses to compare against a build that is absent or stale).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from xds import native

_MEDIAN = re.compile(r"quarantine CPU s: median ([0-9.]+) ")


def quarantine_median(output: str) -> float:
    """The median CPU per quarantine that bench_quarantine's last line reports."""
    found = _MEDIAN.findall(output)
    if not found:
        raise ValueError("bench_quarantine printed no median: " + output[-500:])
    return float(found[-1])


def one_run(
    n: int, rounds: int, compiled: bool = True, controlplane_cmd: str | None = None
) -> float:
    """One bench_quarantine run (a fresh control plane): its median CPU per quarantine.
    ``controlplane_cmd``: the executable under test (bench_quarantine's option)."""
    env = dict(os.environ)
    if compiled:
        env.pop(native.OFF, None)
    else:
        env[native.OFF] = "0"
    cmd = [sys.executable, "-m", "benchmarks.bench_quarantine", "--n", str(n)]
    if controlplane_cmd is not None:
        cmd += ["--controlplane-cmd", controlplane_cmd]
    out = subprocess.run(
        [*cmd, "--rounds", str(rounds)], env=env, capture_output=True, text=True, check=True
    )
    return quarantine_median(out.stdout + out.stderr)


def summary(pairs: Sequence[tuple[float, float]], a: str = "sources", b: str = "compiled") -> str:
    """Pairs of runs (``a``, ``b``): each side's median, the median of the pairs' ratios and
    how many pairs ``b`` won, the best run of each."""
    first = [x for x, _ in pairs]
    second = [y for _, y in pairs]
    ratios = [y / x for x, y in pairs]
    return (
        f"CPU per quarantine, median of {len(pairs)} pairs: {a} "
        f"{statistics.median(first):.3f} s, {b} {statistics.median(second):.3f} s; "
        f"{b} / {a}, median of the pairs {statistics.median(ratios):.2f}x "
        f"(lower in {sum(r < 1 for r in ratios)} of {len(ratios)}); best runs "
        f"{min(first):.3f} -> {min(second):.3f} s"
    )


def build_is_current(prog: str) -> bool:
    """The working tree's compiled ADS path matches its sources (else says so on stderr)."""
    state = native.decide(Path(native.__file__).parent, {})
    if state != "compiled":
        print(f"{prog}: the working tree's compiled build is not current ({state}): make native",
              file=sys.stderr)  # fmt: skip
    return state == "compiled"


def paired_runs(
    count: int, a: str, b: str, run_a: Callable[[], float], run_b: Callable[[], float]
) -> list[tuple[float, float]]:
    """``count`` pairs of runs, ``a`` then ``b`` each time, each pair printed as it ends."""
    pairs: list[tuple[float, float]] = []
    for k in range(count):
        pair = (run_a(), run_b())
        pairs.append(pair)
        print(f"pair {k + 1}: {a} {pair[0]:.3f} s, {b} {pair[1]:.3f} s", flush=True)
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_native")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4, help="quarantines per run")
    args = p.parse_args(argv)
    if not build_is_current("bench_native"):
        return 2
    pairs = paired_runs(
        args.pairs,
        "sources",
        "compiled",
        lambda: one_run(args.n, args.rounds, False),
        lambda: one_run(args.n, args.rounds, True),
    )
    print(f"N={args.n}: {summary(pairs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
