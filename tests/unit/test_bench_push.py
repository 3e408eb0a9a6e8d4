"""benchmarks.bench_push: real AdsConnections and Envoy-like clients joined in memory; every
caller of the quarantined workload's service is sent the change (its endpoints and the CRL)."""

from __future__ import annotations

import pytest

from benchmarks.bench_push import main


def test_each_round_reaches_every_caller(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--n", "40", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(rounds) == 2
    # 20 callers x (EDS + Secret), and the quarantined workload's own new listener
    assert all(line.startswith(f"round {k}: 41 responses") for k, line in enumerate(rounds))
    assert "N=40, 20 callers: server CPU per caller" in out
