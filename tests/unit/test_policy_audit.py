"""Audit mode: an audit-mode policy records what it would have rejected and acts on nothing."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from certs.evidence.claims import Claims, Tee
from certs.policy import Admitted, Rejected, appraise_all, audit_findings, parse_policies

NOW = datetime(2026, 1, 1, tzinfo=UTC)
GOOD, NEW = "aa" * 48, "bb" * 48


def doc(name: str, mode: str, measurement: str) -> dict[str, Any]:
    return {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": name},
        "spec": {
            "selector": {"serviceAccounts": ["web"]},
            "allowedTees": ["sim"],
            "mode": mode,
            "referenceValues": {"sim": {"measurement": [measurement]}},
        },
    }


def claims(measurement: str) -> Claims:
    return Claims(Tee.SIM, {"measurement": measurement}, b"\0" * 64, False, "00")


def test_audit_policy_never_rejects_but_reports() -> None:
    # enforce admits the current image; the audit policy trials the next reference value
    policies = parse_policies([doc("current", "enforce", GOOD), doc("next", "audit", NEW)])
    decision = appraise_all(claims(GOOD), policies, NOW)
    assert isinstance(decision, Admitted)
    assert decision.policy == "default/current"
    findings = audit_findings(claims(GOOD), policies, NOW)
    assert [(f.policy, f.reason) for f in findings] == [("default/next", "measurement_not_allowed")]


def test_enforce_still_rejects_beside_audit() -> None:
    policies = parse_policies([doc("current", "enforce", GOOD), doc("next", "audit", NEW)])
    decision = appraise_all(claims(NEW), policies, NOW)
    assert isinstance(decision, Rejected) and decision.policy == "default/current"
    assert audit_findings(claims(NEW), policies, NOW) == ()


def test_audit_only_workload_is_admitted_with_findings() -> None:
    policies = parse_policies([doc("trial", "audit", NEW)])
    assert isinstance(appraise_all(claims(GOOD), policies, NOW), Admitted)
    assert len(audit_findings(claims(GOOD), policies, NOW)) == 1
