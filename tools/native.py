"""``make native``: compile the ADS hot path (``xds.native.COMPILED``) with mypyc, in place.

Extension modules land beside their sources (``xds/server.cpython-311-...so``), with the group's
shared library ``xds/_compiled__mypyc...so``; then ``xds/_compiled.json`` records the SHA-256 of
every source of the package, which ``xds.native.activate`` checks at every start: an edited
source retires the whole build until this runs again. Nothing is done when the build is
current. mypyc comes with mypy (the test extras). C sources and objects go to build/native.

    python tools/native.py          build unless current
    python tools/native.py --clean  remove the build (the sources run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "native"


def _clean(package_dir: Path) -> None:
    from xds import native

    for module in native.COMPILED:
        for path in native.extension_paths(package_dir, module):
            path.unlink(missing_ok=True)
    for path in package_dir.glob(native.GROUP.rpartition(".")[2] + "__mypyc*"):
        path.unlink()
    (package_dir / native.STAMP).unlink(missing_ok=True)
    shutil.rmtree(BUILD, ignore_errors=True)


def _build(package_dir: Path) -> None:
    from mypyc.build import mypycify
    from setuptools.dist import Distribution  # type: ignore[import-untyped]

    from xds import native

    paths = [str(native.source_path(package_dir, m).relative_to(ROOT)) for m in native.COMPILED]
    # the digests taken before: a source edited while this builds reads as stale
    digests = native.source_digests(package_dir)
    extensions = mypycify(
        paths, opt_level="3", group_name=native.GROUP, target_dir=str(BUILD / "c")
    )
    # a bare Distribution: setuptools would otherwise read pyproject.toml's [project] (not
    # needed here, and older setuptools refuse its license expression)
    dist = Distribution({"name": "attestmesh-native", "ext_modules": extensions})
    dist.script_name = "tools/native.py"
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = True
    cmd.build_temp = str(BUILD / "obj")
    cmd.parallel = os.cpu_count() or 1
    dist.run_command("build_ext")
    (package_dir / native.STAMP).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="compile the ADS hot path with mypyc, in place")
    p.add_argument("--clean", action="store_true", help="remove the compiled build")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    os.environ["ATTESTMESH_NATIVE"] = "0"  # import xds from its sources while building it
    from xds import native

    package_dir = ROOT / "xds"
    if args.clean:
        _clean(package_dir)
        print("native: removed; the sources run")
        return 0
    before = native.decide(package_dir, {})
    if before == "compiled":
        print("native: the compiled build is current")
        return 0
    print(f"native: building: {before}")
    t0 = time.monotonic()
    _build(package_dir)
    after = native.decide(package_dir, {})
    if after != "compiled":
        print(f"native: the build did not take: {after}", file=sys.stderr)
        return 1
    print(f"native: compiled {len(native.COMPILED)} modules in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
