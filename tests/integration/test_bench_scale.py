"""``python -m benchmarks.bench_scale --quick`` against a real ``attestmesh controlplane`` process
(and a real OpenBao server) produces every figure: a number for each, printed next to its
target with a verdict. Whether the targets hold is the benchmark's report, not this test's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_scale import FIGURES

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_scale", "--quick",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    assert list(runs) == ["200"]
    figures = runs["200"]["figures"]
    missing = {k: v for k, *_ in FIGURES if not isinstance(v := figures.get(k), int | float)}
    assert not missing, (missing, runs["200"]["notes"], proc.stdout[-4000:])
    assert all(math.isfinite(figures[k]) and figures[k] >= 0 for k, *_ in FIGURES), figures
    # rates and CPU are real measurements, not placeholders
    assert figures["rate_1"] > 0 and figures["bao_rate_8"] > 0 and figures["startup_cpu_s"] > 0
    # every figure is printed, and every target with its verdict
    table = proc.stdout[proc.stdout.index("figure ") :]
    for _, label, _, target in FIGURES:
        row = next(line for line in table.splitlines() if line.startswith(label))
        if target is not None:
            assert row.rstrip().endswith(("PASS", "FAIL")), row
