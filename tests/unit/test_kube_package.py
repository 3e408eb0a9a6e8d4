"""The Kubernetes adapter's shape: its public face resolves to the modules that define it, the
injector and the shared names load none of its I/O modules, and the shared names are defined
in one place."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import xds.kube
import xds.kube.names

ROOT = Path(__file__).resolve().parents[2]
IO_MODULES = (
    "xds.kube.client",
    "xds.kube.watch",
    "xds.kube.source",
    "xds.kube.actions",
    "xds.kube.events",
    "xds.kube.lease",
    "xds.kube.tokenreview",
    "xds.kube.trustbundle",
    "xds.kube.webhook",
    "xds.kube.work",
    "kubernetes",
)


def loaded_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "statement", ["import xds.kube.names", "import sidecar.inject", "import attestmesh.lint"]
)
def test_the_names_and_the_injector_load_no_io_module_of_the_adapter(statement: str) -> None:
    loaded = loaded_after(statement)
    assert statement.split()[1] in loaded  # the probe itself ran
    assert sorted(m for m in IO_MODULES if m in loaded) == []


def test_a_name_of_the_public_face_loads_its_module_on_first_use() -> None:
    loaded = loaded_after("from xds.kube import KubeSource")
    assert {"xds.kube.source", "xds.kube.watch", "xds.kube.client"} <= loaded


def test_every_public_name_is_the_defining_modules_own() -> None:
    lazy: dict[str, str] = xds.kube._LAZY
    assert set(xds.kube.__all__) == set(lazy) | set(xds.kube.names.__all__)
    for name, module in lazy.items():
        defining = importlib.import_module(f"xds.kube.{module}")
        assert name in defining.__all__, (name, module)
        assert getattr(xds.kube, name) is getattr(defining, name)
    for name in xds.kube.names.__all__:
        assert getattr(xds.kube, name) == getattr(xds.kube.names, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = xds.kube.no_such_name


def test_the_public_face_lists_each_name_once_and_types_what_it_resolves() -> None:
    """``__all__`` holds every name once (the shared ones are ``names.__all__`` itself), and the
    imports type checkers read (under TYPE_CHECKING) name the modules ``_LAZY`` resolves."""
    assert len(xds.kube.__all__) == len(set(xds.kube.__all__))
    static: dict[str, str] = {}
    tree = ast.parse((ROOT / "xds/kube/__init__.py").read_text())
    (checking,) = [n for n in tree.body if isinstance(n, ast.If)]
    for node in checking.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        for alias in node.names:
            static[alias.name] = node.module.removeprefix("xds.kube.")
    assert static == xds.kube._LAZY


def string_constants(path: Path) -> dict[str, str]:
    """Module-level NAME = "literal" assignments."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            value = node.value.value
            for target in node.targets:
                if isinstance(target, ast.Name) and isinstance(value, str):
                    out[target.id] = value
    return out


def test_the_shared_names_are_defined_once() -> None:
    shared = {
        v: k
        for k, v in string_constants(ROOT / "xds/kube/names.py").items()
        if "/" in v or v.startswith(("aws-", "hugepages", "HugePages", "attestmesh"))
    }
    assert "aws.ec2.nitro/nitro_enclaves" in shared and "attestmesh" in shared
    # Equal strings that are other names: the certificate's organisation and a volume named
    # after the ConfigMap it mounts.
    elsewhere = {
        ("certs/ca/claims.py", "CLAIMS_CLASS_ORG"),
        ("sidecar/inject.py", "TRUST_VOLUME"),
    }
    again = []
    for package in ("attestmesh", "certs", "sidecar", "xds"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "xds/kube/names.py":
                continue
            for name, value in string_constants(path).items():
                where = (str(path.relative_to(ROOT)), name)
                if value in shared and where not in elsewhere:
                    again.append(f"{path.relative_to(ROOT)}: {name} = {value!r}")
    assert again == []


def test_the_api_group_is_the_policy_parsers() -> None:
    # one definition: certs.policy (the lowest layer that needs it); the adapter re-exports it
    import certs.policy
    from xds.kube import names

    assert names.GROUP is certs.policy.API_GROUP == "attestmesh.dev"
    assert "GROUP" not in string_constants(ROOT / "xds/kube/names.py")
