"""`attestmesh lint`: the guide's correct setup has no findings; each broken variant in
fixtures/ yields exactly the finding its first line names."""

from __future__ import annotations

import argparse
import copy
import io
import re
from decimal import Decimal
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attestmesh.lint import (
    Code,
    LoadError,
    Severity,
    SourcedObject,
    add_parser,
    allocator_of,
    eks_kube_reserved_cpu,
    lint,
    load_paths,
    parse_documents,
    parse_quantity,
    run,
    tolerates,
)
from tests.unit.manifests.helpers import (
    DEVICE_PLUGIN_PATCH,
    FIXTURES,
    MANIFESTS,
    UPSTREAM_DEVICE_PLUGIN,
    patched_device_plugin,
    strategic_merge,
    upstream_device_plugin,
)

NITRO = MANIFESTS / "nodes" / "nitro"
NODE_FILES = [NITRO / "ec2nodeclass.yaml", NITRO / "nodepool.yaml", NITRO / "nodeoverlay.yaml"]
WORKLOAD = MANIFESTS / "examples" / "workloads" / "nitro.yaml"
DP_SOURCE = "device-plugin(upstream+patch)"


def _objects(path: Path) -> list[SourcedObject]:
    return parse_documents(path.read_text(), path.relative_to(MANIFESTS.parent).as_posix())


@cache
def _correct_set() -> tuple[SourcedObject, ...]:
    objs: list[SourcedObject] = []
    for path in [*NODE_FILES, WORKLOAD]:
        objs.extend(_objects(path))
    objs.append(SourcedObject(DP_SOURCE, 0, patched_device_plugin()))
    return tuple(objs)


def correct_set() -> list[SourcedObject]:
    """The guide's setup as shipped: nodes/nitro, the patched device plugin, the workload
    (a fresh deep copy each time)."""
    return [SourcedObject(o.source, o.index, copy.deepcopy(o.obj)) for o in _correct_set()]


def _key(o: SourcedObject) -> tuple[str, str, str]:
    return (o.kind, o.namespace, o.name)


def with_fixture(path: Path) -> tuple[list[SourcedObject], Code]:
    text = path.read_text()
    expect = re.search(r"^# expect: (\w+)$", text, re.MULTILINE)
    assert expect, f"{path.name}: no '# expect:' line"
    objs = correct_set()
    for removed in re.findall(r"^# remove: (\S+)$", text, re.MULTILINE):
        kind, ns, name = removed.split("/")
        objs = [o for o in objs if _key(o) != (kind, ns, name)]
    replacements = parse_documents(text, f"fixtures/{path.name}")
    if "# device-plugin-patch" in text:
        (patch,) = replacements
        merged = strategic_merge(upstream_device_plugin(), dict(patch.obj))
        replacements = [SourcedObject(patch.source, 0, merged)]
    keys = {_key(r) for r in replacements}
    objs = [o for o in objs if _key(o) not in keys] + replacements
    return objs, Code(expect.group(1))


FIXTURE_FILES = sorted(FIXTURES.glob("*.yaml"))


# ------------------------------------------------------------------------------------------
# the correct setup


def test_correct_nitro_setup_has_no_findings() -> None:
    objs = correct_set()
    assert {o.kind for o in objs} == {
        "EC2NodeClass",
        "NodePool",
        "NodeOverlay",
        "ServiceAccount",
        "Deployment",
        "Service",
        "DaemonSet",
    }
    assert lint(objs) == []


def test_shipped_directories_lint_clean_with_the_patch_file_as_the_daemonset() -> None:
    objs = load_paths([str(MANIFESTS)], io.StringIO())
    assert any(o.source.endswith("patches/device-plugin.yaml") for o in objs)
    assert lint(objs) == []


def test_upstream_device_plugin_unpatched_has_exactly_the_two_gaps_the_patch_closes() -> None:
    objs = [o for o in correct_set() if o.source != DP_SOURCE]
    objs.append(SourcedObject("upstream", 1, upstream_device_plugin()))
    assert sorted(f.code for f in lint(objs)) == [
        Code.DEVICE_PLUGIN_MISSING_TOLERATION,
        Code.OVERLAY_ENCLAVE_CPUS_NOT_ADVERTISED,
    ]


# ------------------------------------------------------------------------------------------
# each broken variant


def test_every_code_has_a_fixture() -> None:
    expected = {with_fixture(p)[1] for p in FIXTURE_FILES}
    assert expected == set(Code)


@pytest.mark.parametrize("fixture", FIXTURE_FILES, ids=[p.stem for p in FIXTURE_FILES])
def test_broken_variant_yields_exactly_its_finding(fixture: Path) -> None:
    objs, expected = with_fixture(fixture)
    findings = lint(objs)
    assert [f.code for f in findings] == [expected], "\n".join(f.render() for f in findings)
    (finding,) = findings
    assert finding.severity is (
        Severity.WARNING if expected is Code.DEVICE_PLUGIN_MISSING else Severity.ERROR
    )
    assert finding.fix and finding.message and finding.object and finding.source


def _annotated(kind: str, labels: dict[str, str], annotations: dict[str, str]) -> SourcedObject:
    meta = {"labels": labels, "annotations": annotations}
    spec = {"containers": [{"name": "app", "image": "app:1"}]}
    obj: dict[str, Any]
    if kind == "Pod":
        obj = {"metadata": {"name": "x", "namespace": "a", **meta}, "spec": spec}
    elif kind == "CronJob":
        template = {"metadata": meta, "spec": spec}
        obj = {"metadata": {"name": "x"}, "spec": {"jobTemplate": {"spec": {"template": template}}}}
    else:
        obj = {"metadata": {"name": "x"}, "spec": {"template": {"metadata": meta, "spec": spec}}}
    return SourcedObject("t.yaml", 0, {"kind": kind, **obj})


@pytest.mark.parametrize("kind", ["Pod", "Deployment", "StatefulSet", "Job", "CronJob"])
def test_inject_opt_in_by_annotation_only_is_flagged_in_every_pod_template(kind: str) -> None:
    findings = lint([_annotated(kind, {}, {"attestmesh.dev/inject": "True"})])
    assert [f.code for f in findings] == [Code.INJECT_OPT_IN_BY_ANNOTATION]
    assert "attestmesh.dev/inject: enabled" in findings[0].fix
    # the label opts in (the annotation beside it is harmless), "false" is the opt-out
    for labels, ann in (
        ({"attestmesh.dev/inject": "enabled"}, {"attestmesh.dev/inject": "true"}),
        ({}, {"attestmesh.dev/inject": "false"}),
        ({"attestmesh.dev/inject": "enabled"}, {}),
    ):
        assert lint([_annotated(kind, labels, ann)]) == []


def test_finding_names_the_object_and_its_file() -> None:
    objs, _ = with_fixture(FIXTURES / "workload-no-toleration.yaml")
    (f,) = lint(objs)
    assert f.object == "Deployment/demo/enclave-app"
    assert f.source == "fixtures/workload-no-toleration.yaml#0"
    assert "aws-nitro-enclaves-k8s-dp=enabled:NoSchedule" in f.message


def test_overcommit_message_shows_the_arithmetic() -> None:
    objs, _ = with_fixture(FIXTURES / "workload-cpu-overcommit.yaml")
    (f,) = lint(objs)
    assert "2010m" in f.message and "1920m" in f.message
    assert "4 vCPUs" in f.message and "2 enclave CPUs" in f.message


def test_nitro_enclaves_disabled_is_reported_once_per_node_class() -> None:
    objs, _ = with_fixture(FIXTURES / "nodeclass-enclaves-disabled.yaml")
    extra = yaml.safe_load(WORKLOAD.read_text().split("---")[1])
    extra["metadata"]["name"] = "enclave-app-2"
    findings = lint([*objs, SourcedObject("extra", 0, extra)])
    assert [f.code for f in findings] == [Code.NITRO_ENCLAVES_DISABLED]
    assert "enclave-app-2" in findings[0].message


def test_workloads_without_enclave_requests_and_no_pool_are_ignored() -> None:
    objs = load_paths([str(MANIFESTS / "examples")], io.StringIO())
    assert lint(objs) == []  # no enclave pool among them: nothing to relate


def test_baked_ami_allocator_annotation_replaces_user_data() -> None:
    objs, _ = with_fixture(FIXTURES / "nodeclass-no-allocator.yaml")
    nc = next(o for o in objs if o.kind == "EC2NodeClass")
    annotated: dict[str, Any] = dict(nc.obj)
    annotated["metadata"] = {
        **nc.obj["metadata"],
        "annotations": {"attestmesh.dev/enclave-allocator": "memory_mib=4096,cpu_count=2"},
    }
    objs = [o for o in objs if o is not nc] + [SourcedObject("nc", 0, annotated)]
    assert lint(objs) == []


# ------------------------------------------------------------------------------------------
# the pure helpers


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4Gi", Decimal(4 * 2**30)),
        ("250m", Decimal("0.25")),
        ("2", Decimal(2)),
        (2, Decimal(2)),
        ("1.5", Decimal("1.5")),
        ("1k", Decimal(1000)),
        ("1e3", Decimal(1000)),
        ("4 GiB", None),
        ("", None),
        (True, None),
        (None, None),
    ],
)
def test_parse_quantity(text: Any, value: Decimal | None) -> None:
    assert parse_quantity(text) == value


def test_tolerations_match_like_the_scheduler() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    assert tolerates([{"key": "k", "operator": "Equal", "value": "v"}], taint)
    assert tolerates([{"key": "k", "operator": "Exists", "effect": "NoSchedule"}], taint)
    assert tolerates([{"operator": "Exists"}], taint)
    assert not tolerates([{"key": "k", "value": "w"}], taint)
    assert not tolerates([{"key": "k", "operator": "Exists", "effect": "NoExecute"}], taint)
    assert not tolerates([{"key": "other", "operator": "Exists"}], taint)
    assert not tolerates([], taint)


def test_eks_kube_reserved_cpu() -> None:
    assert eks_kube_reserved_cpu(1) == Decimal("0.06")
    assert eks_kube_reserved_cpu(2) == Decimal("0.07")
    assert eks_kube_reserved_cpu(4) == Decimal("0.08")
    assert eks_kube_reserved_cpu(8) == Decimal("0.09")


def test_allocator_is_read_from_user_data() -> None:
    (nc,) = _objects(NITRO / "ec2nodeclass.yaml")
    alloc = allocator_of(nc)
    assert alloc is not None
    assert (alloc.memory_mib, alloc.cpu_count) == (4096, 2)


# ------------------------------------------------------------------------------------------
# the CLI


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="attestmesh")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["lint", *argv])


def test_cli_exit_0_on_clean_manifests() -> None:
    out = io.StringIO()
    assert run(_args(str(MANIFESTS)), stdout=out) == 0
    assert "0 errors, 0 warnings" in out.getvalue()


def test_cli_exit_1_and_prints_file_object_and_fix(tmp_path: Path) -> None:
    for f in [*NODE_FILES, WORKLOAD, UPSTREAM_DEVICE_PLUGIN]:
        (tmp_path / f.name).write_text(f.read_text())
    out = io.StringIO()
    assert run(_args(str(tmp_path)), stdout=out) == 1
    text = out.getvalue()
    assert "aws-nitro-enclaves-k8s-ds.yaml#1: error: DevicePluginMissingToleration" in text
    assert "DaemonSet/kube-system/aws-nitro-enclaves-k8s-daemonset" in text
    assert "  fix: add toleration" in text
    assert "2 errors, 0 warnings" in text


def test_cli_warnings_exit_0_unless_warnings_as_errors(tmp_path: Path) -> None:
    for f in [*NODE_FILES, WORKLOAD]:
        (tmp_path / f.name).write_text(f.read_text())
    assert run(_args(str(tmp_path)), stdout=io.StringIO()) == 0
    assert run(_args("--warnings-as-errors", str(tmp_path)), stdout=io.StringIO()) == 1


def test_cli_reads_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "\n---\n".join(p.read_text() for p in [*NODE_FILES, WORKLOAD, DEVICE_PLUGIN_PATCH])
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    out = io.StringIO()
    assert run(_args("-"), stdout=out) == 0
    assert "7 objects" in out.getvalue()


def test_cli_exit_2_on_missing_path_or_bad_yaml(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(_args(str(tmp_path / "nope.yaml")), stdout=io.StringIO()) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed\n")
    assert run(_args(str(bad)), stdout=io.StringIO()) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_main_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from attestmesh.lint import main

    assert main(["lint"]) == 2
    assert "usage" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# robustness: lint never crashes on malformed objects

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**40), max_value=10**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["4Gi", "1e99", "1e5", "²", "9" * 60, "Exists", "NoSchedule", "enabled"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=3),
    ),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, (*prefix, i)))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lint_survives_any_value_anywhere(data: st.DataObject) -> None:
    objs = correct_set()
    index = data.draw(st.integers(0, len(objs) - 1))
    doc = copy.deepcopy(dict(objs[index].obj))
    path = data.draw(st.sampled_from(_paths(doc)))
    node: Any = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(_values)
    objs[index] = SourcedObject("mutated", 0, doc)
    findings = lint(objs)
    assert all(f.code in Code for f in findings)


def test_impossible_yaml_timestamp_is_a_load_error() -> None:
    with pytest.raises(LoadError):
        parse_documents("a: 2001-02-30", "x")


@given(st.text(max_size=200))
def test_parse_documents_raises_only_load_error(text: str) -> None:
    try:
        objs = parse_documents(text, "x")
    except LoadError:
        return
    assert all(isinstance(o, SourcedObject) for o in objs)
