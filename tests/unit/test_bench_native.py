"""bench_native reads bench_quarantine's median and summarises pairs of runs."""

from __future__ import annotations

import pytest

from benchmarks.bench_native import quarantine_median, summary


def test_the_median_is_read_from_the_last_line() -> None:
    out = (
        "  [20:04:14] quarantine w1: CPU 0.308 s (62 us per caller; ...)\n"
        "N=10000 quarantine CPU s: median 0.307 (61 us per caller) of [0.308, 0.282] (workdir x)\n"
    )
    assert quarantine_median(out) == 0.307
    with pytest.raises(ValueError, match="no median"):
        quarantine_median("the control plane did not start\n")


def test_the_summary_pairs_the_runs() -> None:
    text = summary([(0.40, 0.30), (0.36, 0.38), (0.35, 0.28)])
    assert "sources 0.360 s, compiled 0.300 s" in text
    assert "median of the pairs 0.80x (lower in 2 of 3)" in text
    assert "best runs 0.350 -> 0.280 s" in text


def test_the_summary_names_the_sides_it_is_given() -> None:
    """bench_ab's use: a revision against the working tree."""
    text = summary([(0.30, 0.27), (0.29, 0.30)], "HEAD~1", "working tree")
    assert "HEAD~1 0.295 s, working tree 0.285 s" in text
    assert "working tree / HEAD~1, median of the pairs 0.97x (lower in 1 of 2)" in text


def test_bench_ab_runs_the_revision_from_its_own_tree() -> None:
    from pathlib import Path

    from benchmarks.bench_ab import controlplane_cmd

    cmd = controlplane_cmd(Path("/tmp/a tree"))
    assert cmd.startswith("env PYTHONPATH='/tmp/a tree' ") and cmd.endswith("/attestmesh")


def test_paired_runs_alternate_the_sides(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_native import paired_runs

    calls: list[str] = []
    values = iter([0.3, 0.2, 0.31, 0.25])

    def run(side: str) -> float:
        calls.append(side)
        return next(values)

    pairs = paired_runs(2, "A", "B", lambda: run("a"), lambda: run("b"))
    assert calls == ["a", "b", "a", "b"] and pairs == [(0.3, 0.2), (0.31, 0.25)]
    assert "pair 2: A 0.310 s, B 0.250 s" in capsys.readouterr().out
