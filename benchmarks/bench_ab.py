"""A change against a revision, through the real process: the control plane's CPU per quarantine
(``benchmarks.bench_quarantine`` at N workloads: a real ``attestmesh controlplane``, mTLS
delta-ADS streams, the ops API) with the code of ``--against REV`` and with the working tree, in
interleaved pairs of runs, each a fresh control plane; prints each pair, each side's median, the
median of the pairs' ratios and how many pairs the working tree won (``bench_native.summary``).

REV is checked out into a temporary git worktree, its ADS hot path compiled there (``tools/
native.py``), and its control plane run from it (``PYTHONPATH``: its packages before this
tree's); everything else, the benchmark's clients included, runs from this tree. Both sides run
compiled (the working tree's build must be current: ``make native``). This machine's speed
drifts by a quarter within minutes: a few per cent needs many pairs (10 pairs of 4 rounds at
N = 10,000 take ~20 minutes), and a gain smaller than the spread of the pairs' ratios is not
shown by it.

Run: ``python -m benchmarks.bench_ab --against HEAD~1 [--n 10000] [--pairs 6] [--rounds 4]``
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from benchmarks.bench_native import build_is_current, one_run, paired_runs, summary

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def checked_out(rev: str) -> Iterator[Path]:
    """``rev`` in a temporary worktree, its ADS hot path compiled; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        try:
            subprocess.run(
                [sys.executable, "tools/native.py"], cwd=tree, check=True, capture_output=True
            )
            yield tree
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                check=False, capture_output=True,
            )  # fmt: skip


def controlplane_cmd(tree: Path) -> str:
    """The control plane run from ``tree``'s packages (this venv's entry point)."""
    exe = Path(sys.executable).parent / "attestmesh"
    return f"env PYTHONPATH={shlex.quote(str(tree))} {shlex.quote(str(exe))}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_ab")
    p.add_argument("--against", required=True, help="the git revision to compare with")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--pairs", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4, help="quarantines per run")
    args = p.parse_args(argv)
    if not build_is_current("bench_ab"):
        return 2
    with checked_out(args.against) as tree:
        base = controlplane_cmd(tree)
        pairs = paired_runs(
            args.pairs,
            args.against,
            "working tree",
            lambda: one_run(args.n, args.rounds, controlplane_cmd=base),
            lambda: one_run(args.n, args.rounds),
        )
    print(f"N={args.n}: {summary(pairs, args.against, 'working tree')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
