"""xds.native: a compiled build runs only while it matches its sources; otherwise, or with
ATTESTMESH_NATIVE=0, the sources run. And the suite runs against the compiled build (``make
test`` builds it first: what the control plane runs is what is tested)."""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import subprocess
import sys
from pathlib import Path

import pytest

from xds import native

MODULES = ("pkg.alpha", "pkg.beta")
ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def _package(tmp_path: Path, built: tuple[str, ...] = MODULES, stamp: bool = True) -> Path:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for module in MODULES:
        native.source_path(pkg, module).write_text(f"NAME = {module!r}\n")
    for module in built:
        native.extension_paths(pkg, module)[0].write_bytes(b"\x7fELF")
    if stamp:
        (pkg / native.STAMP).write_text(json.dumps(native.source_digests(pkg)))
    return pkg


def test_a_current_build_is_compiled(tmp_path: Path) -> None:
    assert native.decide(_package(tmp_path), {}, MODULES) == "compiled"


def test_an_edited_source_retires_the_whole_build(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    native.source_path(pkg, "pkg.beta").write_text("NAME = 'edited'\n")
    assert native.decide(pkg, {}, MODULES) == (
        "sources (stale build: beta.py changed since; make native)"
    )


def test_a_source_the_compiled_modules_import_counts_too(tmp_path: Path) -> None:
    # mypyc builds in what it knows of the modules a compiled one imports (Final constants)
    pkg = _package(tmp_path)
    (pkg / "gamma.py").write_text("LIMIT: int = 1\n")
    assert native.decide(pkg, {}, MODULES) == (
        "sources (stale build: gamma.py changed since; make native)"
    )
    (pkg / native.STAMP).write_text(json.dumps(native.source_digests(pkg)))
    assert native.decide(pkg, {}, MODULES) == "compiled"
    (pkg / "gamma.py").unlink()  # a source removed: stale as well
    assert native.decide(pkg, {}, MODULES).startswith("sources (stale build: gamma.py")


@pytest.mark.parametrize(
    ("built", "stamp", "expected"),
    [
        ((), False, "sources (no compiled build: make native)"),
        (("pkg.alpha",), True, "sources (incomplete build: pkg.beta not compiled; make native)"),
        (MODULES, False, "sources (no readable _compiled.json: make native)"),
    ],
)
def test_an_absent_or_partial_build_runs_the_sources(
    tmp_path: Path, built: tuple[str, ...], stamp: bool, expected: str
) -> None:
    assert native.decide(_package(tmp_path, built, stamp), {}, MODULES) == expected


def test_a_damaged_stamp_runs_the_sources(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    (pkg / native.STAMP).write_text("[1, 2]")
    assert native.decide(pkg, {}, MODULES) == (
        "sources (_compiled.json is not a mapping: make native)"
    )
    (pkg / native.STAMP).write_text("{not json")
    assert native.decide(pkg, {}, MODULES).startswith("sources (no readable")


def test_the_switch_runs_the_sources_of_a_current_build(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    assert native.decide(pkg, {"ATTESTMESH_NATIVE": "0"}, MODULES) == (
        "sources (ATTESTMESH_NATIVE=0)"
    )
    assert native.decide(pkg, {"ATTESTMESH_NATIVE": "1"}, MODULES) == "compiled"


def test_the_stamp_holds_the_digest_of_each_source(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    text = native.source_path(pkg, "pkg.alpha").read_bytes()
    assert native.source_digests(pkg)["alpha.py"] == hashlib.sha256(text).hexdigest()


def _imported(env: dict[str, str]) -> list[str]:
    """A fresh interpreter's mode and where it imported each compiled module from."""
    code = (
        "import sys, xds.native as n\n"
        "import " + ", ".join(native.COMPILED) + "\n"
        "print(n.mode)\n"
        "for m in n.COMPILED: print(sys.modules[m].__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_the_suite_runs_the_compiled_build() -> None:
    # `make test` runs `make native` first: on a working copy, run it if this fails
    assert native.mode == "compiled", native.mode
    for module in native.COMPILED:
        __import__(module)
        file = sys.modules[module].__file__
        assert file is not None and file.endswith(SUFFIXES), (module, file)


def test_the_switch_makes_a_process_import_the_sources() -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "ATTESTMESH_NATIVE": "0"}
    mode, *files = _imported(env)
    assert mode == "sources (ATTESTMESH_NATIVE=0)"
    assert files == [str(native.source_path(ROOT / "xds", m)) for m in native.COMPILED]
    del env["ATTESTMESH_NATIVE"]
    mode, *files = _imported(env)
    assert mode == "compiled"
    assert all(f.endswith(SUFFIXES) for f in files), files
