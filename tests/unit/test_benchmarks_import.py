"""Every benchmark module imports: a product refactor that moves a name a benchmark uses must
fail here, not the next time someone runs `make bench`."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import benchmarks

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name != "__main__")


def test_the_benchmarks_are_found() -> None:
    assert {"bench_scale", "bench_verify", "bench_beyond", "bench_replicas"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.__name__ == f"benchmarks.{name}"
