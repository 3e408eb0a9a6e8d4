"""manifests/observability: the PrometheusRule alerts pass ``promtool check rules`` and fire (and
stay quiet) as intended under ``promtool test rules`` with synthetic series; every metric the
alerts and the Grafana dashboard use is one the control plane exports.

promtool comes from Debian's ``prometheus`` package (.ci/run installs it); a missing promtool
fails these tests, it does not skip them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from attestmesh.metrics import Metrics
from tests.vectors import REPO

OBS = REPO / "manifests" / "observability"
RULE = OBS / "prometheusrule.yaml"
DASHBOARD = OBS / "grafana-dashboard.json"
METRIC = re.compile(r"\battestmesh_[a-z0-9_]+")


def _promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool missing: apt-get install prometheus (see .ci/run)"
    return path


def _rules_file(tmp_path: Path, groups: Any = None) -> Path:
    doc = yaml.safe_load(RULE.read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    path = tmp_path / "rules.yml"
    path.write_text(
        yaml.safe_dump({"groups": groups if groups is not None else doc["spec"]["groups"]})
    )
    return path


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_rules_pass_promtool_check(tmp_path: Path) -> None:
    result = _run("check", "rules", str(_rules_file(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


def test_promtool_check_rejects_a_broken_rule(tmp_path: Path) -> None:
    groups = yaml.safe_load(RULE.read_text())["spec"]["groups"]
    groups[0]["rules"][0]["expr"] = (
        "sum by (trigger) (increase(attestmesh_quarantine_events_total[10m]) >"
    )
    result = _run("check", "rules", str(_rules_file(tmp_path, groups)))
    assert result.returncode != 0


def _series(name: str, values: str) -> dict[str, str]:
    return {"series": name, "values": values}


UP = _series("attestmesh_xds_streams", "3x200")


def _case(series: list[dict[str, str]], eval_time: str, alert: str,
          expected: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    return {
        "interval": "1m",
        "input_series": [UP, *series] if alert != "AttestmeshControlPlaneAbsent" else series,
        "alert_rule_test": [{"eval_time": eval_time, "alertname": alert, "exp_alerts": expected}],
    }


QUARANTINE_DESC = (
    "`attestmesh quarantine list` shows who and why; a tcb_changed or tcb_revoked trigger means "
    "vendor collateral moved the platform."
)
FAILURE_DESC = 'By reason: sum by (tee, reason) (rate(attestmesh_attestations_total{result!="admitted"}[10m])).'
CASES: dict[str, list[dict[str, Any]]] = {
    "quarantine": [
        _case([_series('attestmesh_quarantine_events_total{trigger="tcb_changed"}', "0 0 0 1 1 1 1")],
              "5m", "AttestmeshWorkloadQuarantined",
              [{"exp_labels": {"severity": "warning", "trigger": "tcb_changed"},
                "exp_annotations": {"summary": "1 workloads quarantined (tcb_changed) in 10 minutes",
                                    "description": QUARANTINE_DESC}}]),
        _case([_series('attestmesh_quarantine_events_total{trigger="tcb_changed"}', "0x10")],
              "5m", "AttestmeshWorkloadQuarantined", []),
    ],
    "failure-rate": [
        _case([_series('attestmesh_attestations_total{tee="tdx",result="admitted",reason="ok"}', "0+10x40"),
               _series('attestmesh_attestations_total{tee="tdx",result="rejected",reason="binding_mismatch"}', "0+5x40")],
              "25m", "AttestmeshAttestationFailureRate",
              [{"exp_labels": {"severity": "warning"},
                "exp_annotations": {"summary": "33.33% of attestations fail",
                                    "description": FAILURE_DESC}}]),
        _case([_series('attestmesh_attestations_total{tee="tdx",result="admitted",reason="ok"}', "0+10x40"),
               _series('attestmesh_attestations_total{tee="tdx",result="rejected",reason="binding_mismatch"}', "0+0.5x40")],
              "25m", "AttestmeshAttestationFailureRate", []),
        # a burst shorter than the 10 minutes "for": no alert yet
        _case([_series('attestmesh_attestations_total{tee="tdx",result="admitted",reason="ok"}', "0+10x40"),
               _series('attestmesh_attestations_total{tee="tdx",result="rejected",reason="x"}', "0x10 0+20x30")],
              "15m", "AttestmeshAttestationFailureRate", []),
    ],
    "tcb": [
        _case([_series('attestmesh_tcb_reappraisals_total{outcome="deferred"}', "0 0 2 2 2")],
              "4m", "AttestmeshTcbChangeQuarantines",
              [{"exp_labels": {"severity": "warning"},
                "exp_annotations": {"summary": "TCB re-appraisal is quarantining workloads (now or after the grace period)"}}]),
        _case([_series('attestmesh_tcb_reappraisals_total{outcome="audit"}', "0 0 2 2 2")],
              "4m", "AttestmeshTcbChangeQuarantines", []),
        _case([_series('attestmesh_tcb_collateral_refreshes_total{vendor="intel",result="unavailable"}', "0+1x200")],
              "150m", "AttestmeshCollateralUnavailable",
              [{"exp_labels": {"severity": "warning", "vendor": "intel"},
                "exp_annotations": {"summary": "intel collateral cannot be refreshed; the previous collateral stays in force"}}]),
        _case([_series('attestmesh_tcb_collateral_refreshes_total{vendor="intel",result="changed"}', "0+1x200")],
              "150m", "AttestmeshCollateralUnavailable", []),
    ],
    "ca": [
        _case([_series("attestmesh_ca_intermediate_expiry_timestamp_seconds", "1728000x200")],
              "2h", "AttestmeshIntermediateCaExpiring",
              [{"exp_labels": {"severity": "critical"},
                "exp_annotations": {"summary": "the signing intermediate CA expires in 19d 22h 0m 0s",
                                    "description": "rotation keeps it months ahead; a month left means rotation is not happening."}}]),
        _case([_series("attestmesh_ca_intermediate_expiry_timestamp_seconds", "17280000x200")],
              "2h", "AttestmeshIntermediateCaExpiring", []),
    ],
    "xds": [
        _case([_series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="0.5"}', "0x40"),
               _series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="1.0"}', "0x40"),
               _series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="2.5"}', "0+10x40"),
               _series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="+Inf"}', "0+10x40")],
              "20m", "AttestmeshXdsPushLatencyHigh",
              [{"exp_labels": {"severity": "warning", "type": "cds"},
                "exp_annotations": {"summary": "p99 push-to-ACK of cds is 2.485s"}}]),
        _case([_series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="0.5"}', "0+10x40"),
               _series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="1.0"}', "0+10x40"),
               _series('attestmesh_xds_push_ack_seconds_bucket{type="cds",le="+Inf"}', "0+10x40")],
              "20m", "AttestmeshXdsPushLatencyHigh", []),
        _case([_series('attestmesh_xds_nacks_total{type="lds"}', "0 0 2 2")],
              "3m", "AttestmeshXdsNacks",
              [{"exp_labels": {"severity": "warning", "type": "lds"},
                "exp_annotations": {"summary": "Envoy rejected 2 lds responses in 10 minutes",
                                    "description": "`attestmesh status` shows which nodes are NACKED."}}]),
        _case([], "10m", "AttestmeshControlPlaneAbsent",
              [{"exp_labels": {"severity": "critical"},
                "exp_annotations": {"summary": "no control plane metrics are being scraped"}}]),
        _case([UP], "10m", "AttestmeshControlPlaneAbsent", []),
    ],
}  # fmt: skip


@pytest.mark.parametrize("group", sorted(CASES))
def test_alerts_fire_when_they_should_and_only_then(tmp_path: Path, group: str) -> None:
    rules = _rules_file(tmp_path)
    tests = tmp_path / f"{group}.test.yml"
    tests.write_text(
        yaml.safe_dump(
            {"rule_files": [rules.name], "evaluation_interval": "1m", "tests": CASES[group]}
        )
    )
    result = _run("test", "rules", str(tests))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _exported() -> set[str]:
    names: set[str] = set()
    for family in Metrics().registry.collect():
        for sample_name in (
            family.name,
            f"{family.name}_total",
            f"{family.name}_bucket",
            f"{family.name}_sum",
            f"{family.name}_count",
        ):
            names.add(sample_name)
    return names


def test_every_metric_in_the_alerts_and_the_dashboard_is_exported() -> None:
    exported = _exported()
    rules_text = RULE.read_text()
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(METRIC.findall(rules_text)) | {m for e in exprs for m in METRIC.findall(e)}
    assert used, "no metric referenced"
    assert used <= exported, sorted(used - exported)
    # the dashboard covers what the issue names: quarantines, failures, CA, push, NACKs, TCB
    for metric in (
        "attestmesh_quarantined_workloads",
        "attestmesh_attestations_total",
        "attestmesh_ca_intermediate_expiry_timestamp_seconds",
        "attestmesh_xds_push_ack_seconds_bucket",
        "attestmesh_xds_nacks_total",
        "attestmesh_tcb_reappraisals_total",
    ):
        assert any(metric in e for e in exprs), metric


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert dash["templating"]["list"][0]["type"] == "datasource"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine
