"""benchmarks.bench_http: both servers (aiohttp behind the API's listener, and the no-HTTP
floor) answer real HTTPS requests with the same JSON, and each reports its own CPU."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks.bench_http import measure, write_certs


@pytest.mark.parametrize("role", ["floor", "aiohttp"])
def test_each_server_answers_real_requests_and_reports_its_cpu(tmp_path: Path, role: str) -> None:
    write_certs(tmp_path)
    args = argparse.Namespace(concurrency=2, seconds=0.3, rounds=2)
    # the client checks every answer's status and body: a wrong one raises here
    per_request = measure(role, tmp_path, args, request=1_100, size=5_500)
    assert len(per_request) == 2
    assert all(0 < us < 100_000 for us in per_request)  # some CPU, and not absurd (us)
