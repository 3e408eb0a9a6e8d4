"""bench_scale reports what the control plane said of its ADS hot path at its last start."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_scale import hot_path


def test_the_last_start_up_line_is_reported(tmp_path: Path) -> None:
    log = tmp_path / "controlplane.log"
    log.write_text(
        "... control plane up: api https://x xds y ops z; ADS hot path: sources (stale build)\n"
        "... something else\n"
        "... control plane up: api https://x xds y ops z; ADS hot path: compiled\n"
    )
    assert hot_path(log) == "compiled"


def test_an_absent_or_silent_log_is_unknown(tmp_path: Path) -> None:
    assert hot_path(tmp_path / "missing.log") == "unknown (no control-plane log)"
    (tmp_path / "quiet.log").write_text("control plane up\n")
    assert hot_path(tmp_path / "quiet.log") == "unknown (not in the control-plane log)"
