"""``attestmesh nitro-parent`` refuses, before starting anything, an enclave larger than the
pod's grant, where the kernel's hugepages limit (cgroup v2) caps the granted memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from attestmesh.cli import main


def parent(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "nitro-parent", "--eif", str(tmp_path / "app.eif"), "--granted-cpus", "2",
        "--granted-memory-mib", "4096", "--workload", "demo/p",
        "--control-plane", "https://127.0.0.1:8443", "--xds", "127.0.0.1:18000",
        "--inbound-address", "127.0.0.1", "--inbound-port", "15006",
        "--hugetlb-limit-file", str(tmp_path / "hugetlb.1GB.max"),
        "--nitro-cli", f"{sys.executable} -m tests.nitro_fake.nitro_cli --state {tmp_path}",
        *extra,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("limit", "extra", "detail"),
    [
        (None, ["--cpu-count", "3"], "3 CPUs (granted 2)"),
        (None, ["--memory-mib", "8192"], "8192 MiB (granted 4096 MiB"),
        (str(1 << 30), ["--memory-mib", "2048"], "2048 MiB (granted 1024 MiB"),
    ],
)
def test_oversized_enclave_is_refused_before_nitro_cli_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    limit: str | None,
    extra: list[str],
    detail: str,
) -> None:
    if limit is not None:
        (tmp_path / "hugetlb.1GB.max").write_text(limit + "\n")
    assert main(parent(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert "enclave_oversized" in err and detail in err
    assert not (tmp_path / "calls.jsonl").exists()  # nitro-cli was never called


def test_bad_flags_fail_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(parent(tmp_path, "--peer", "nohostport")) == 2
    assert "bad_routes: route peer-0: 'nohostport' is not host:port" in capsys.readouterr().err
    assert main(parent(tmp_path, "--control-plane", "http://127.0.0.1:8443")) == 2
    assert "is not https" in capsys.readouterr().err
    assert main(parent(tmp_path)) == 2
    assert "app.eif: no enclave image file" in capsys.readouterr().err
    (tmp_path / "hugetlb.1GB.max").write_text("garbage")
    assert main(parent(tmp_path)) == 2
    assert "hugetlb.1GB.max is 'garbage'" in capsys.readouterr().err
    assert not (tmp_path / "calls.jsonl").exists()
