"""The README's main job: ``attestmesh demo`` holds every expectation with real Envoys."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestmesh.demo import run_demo

pytestmark = pytest.mark.integration


async def test_demo_holds_every_expectation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_demo(tmp_path) == 0
    out = capsys.readouterr().out
    assert "ALL EXPECTATIONS HELD" in out
    assert "FAIL" not in out
    assert out.count("PASS") == 7
    # the state the demo leaves behind: the CA and the SQLite store persisted in its directory
    assert (tmp_path / "state" / "ca" / "root.pem").exists()
    assert (tmp_path / "state" / "state.sqlite3").exists()
