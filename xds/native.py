"""The ADS hot path, compiled: which ``xds`` modules ``make native`` compiles with mypyc, and
the guard that lets a build run only while it matches the sources it was made from.

Per caller stream, a change costs Python: waking the stream, the delta session's diff, HTTP/2
framing, taking the ACK. Those modules are plain, strictly typed Python; ``tools/native.py``
compiles them with mypyc (mypy's compiler: the same annotations, C instead of bytecode) into
extension modules beside their sources, plus one shared library (``xds/_compiled__mypyc``),
and writes :data:`STAMP`: the SHA-256 of every source of the package (the compiled modules',
and those of the modules they import: mypyc builds in what it knows of them, ``Final``
constants for one).

An extension module is imported before a source file of the same name, so a source edited
after the build would silently not run. :func:`activate` (called by ``xds/__init__``) makes
every compiled module load from its source instead when the build is absent, incomplete or
stale (a source of the package differs from the stamp, or was added or removed: the modules
are compiled as one group that calls itself directly, so one stale source retires them all),
or when ``ATTESTMESH_NATIVE=0``. The sources are the reference and behave the same (the test
suite runs against the compiled build); compiled code also checks argument types at run time.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Final

COMPILED: Final = ("xds.h2conn", "xds.adswire", "xds.server", "xds.adsconn")
GROUP: Final = "xds._compiled"  # the shared library: xds/_compiled__mypyc.<abi>.so
STAMP: Final = "_compiled.json"  # {source file: sha256}, written by tools/native.py
OFF: Final = "ATTESTMESH_NATIVE"  # "0": the sources, always

mode = "sources (not activated)"  # what activate() decided, for logs and benchmarks


def source_digests(package_dir: Path) -> dict[str, str]:
    """File name -> SHA-256, for every source at the top of the package."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(package_dir.glob("*.py"))
    }


def source_path(package_dir: Path, module: str) -> Path:
    return package_dir / (module.rpartition(".")[2] + ".py")


def extension_paths(package_dir: Path, module: str) -> list[Path]:
    short = module.rpartition(".")[2]
    return [package_dir / (short + s) for s in importlib.machinery.EXTENSION_SUFFIXES]


def _built(package_dir: Path, modules: Sequence[str]) -> list[str]:
    return [m for m in modules if any(p.exists() for p in extension_paths(package_dir, m))]


def decide(package_dir: Path, env: Mapping[str, str], modules: Sequence[str] = COMPILED) -> str:
    """``"compiled"``, or why the sources run: ``"sources (...)"``."""
    if env.get(OFF) == "0":
        return f"sources ({OFF}=0)"
    built = _built(package_dir, modules)
    if not built:
        return "sources (no compiled build: make native)"
    if len(built) < len(modules):
        missing = sorted(set(modules) - set(built))
        return f"sources (incomplete build: {', '.join(missing)} not compiled; make native)"
    try:
        stamp = json.loads((package_dir / STAMP).read_text())
    except (OSError, ValueError):
        return f"sources (no readable {STAMP}: make native)"
    if not isinstance(stamp, dict):
        return f"sources ({STAMP} is not a mapping: make native)"
    now = source_digests(package_dir)
    stale = sorted(n for n in now.keys() | stamp.keys() if stamp.get(n) != now.get(n))
    if stale:
        return f"sources (stale build: {', '.join(stale)} changed since; make native)"
    return "compiled"


class _Sources(importlib.abc.MetaPathFinder):
    """Finds the compiled modules' sources ahead of their extension modules."""

    def __init__(self, package_dir: Path, modules: Sequence[str]) -> None:
        self._paths = {m: source_path(package_dir, m) for m in modules}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self._paths.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def activate(package_dir: Path, env: Mapping[str, str]) -> str:
    """Decide (:func:`decide`); unless compiled, make the sources win from now on (when any
    extension module is there to shadow them). Once per process: the package's first import."""
    global mode
    mode = decide(package_dir, env)
    if (
        mode != "compiled"
        and _built(package_dir, COMPILED)
        and not any(isinstance(f, _Sources) for f in sys.meta_path)
    ):
        sys.meta_path.insert(0, _Sources(package_dir, COMPILED))
    return mode
