# Two commands for a newcomer: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: demo test install install-test native lint typecheck imports pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

## Compile the ADS hot path with mypyc (xds.native; nothing to do when current). The
## sources run wherever it was not built or is stale; ATTESTMESH_NATIVE=0 runs them anyway.
native: install-test
	$(BIN)/python tools/native.py

## Install attestmesh and run the local demo (real Envoys, simulated TEE, embedded SQLite).
demo: install
	$(BIN)/attestmesh demo

## Install the test extras and run every gate: ruff, mypy --strict, the import-layer contracts
## (lint-imports, [tool.importlinter] in pyproject.toml), pytest (warnings are errors), against
## the compiled ADS hot path (make native) that the control plane runs.
test: install-test native lint typecheck imports pytest

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck:
	$(BIN)/mypy

imports:
	$(BIN)/lint-imports --no-cache

pytest:
	$(BIN)/pytest -q

## Every benchmark; bench_scale drives a real control plane at N=1,000 and 10,000
## (BENCH_SCALE_ARGS=--quick: a smoke run at N=200).
BENCH_SCALE_ARGS ?= --n 1000,10000
bench: install-test native
	BENCH_SCALE_ARGS="$(BENCH_SCALE_ARGS)" $(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis build/native
	rm -f xds/*.so xds/_compiled.json
