"""Audit mode: an audit-mode policy records what it would have rejected and acts on nothing:
it never rejects, and it never admits either (only an enforcing policy admits)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
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


def test_audit_only_workload_is_refused_with_findings() -> None:
    # an audit-only identity is not admitted, whatever its evidence shows: audit never admits
    policies = parse_policies([doc("trial", "audit", NEW)])
    for measurement in (GOOD, NEW):
        decision = appraise_all(claims(measurement), policies, NOW)
        assert isinstance(decision, Rejected)
        assert (decision.reason, decision.policy) == ("no_enforcing_policy", "default/trial")
    assert len(audit_findings(claims(GOOD), policies, NOW)) == 1
    assert audit_findings(claims(NEW), policies, NOW) == ()


def test_lenient_audit_policy_admits_nothing_the_enforcing_one_refuses() -> None:
    # the finding: an audit policy allowing debug, any TEE and any measurement must not
    # widen what the enforcing policy admits
    lenient = doc("lenient", "audit", NEW)
    lenient["spec"]["allowDebug"] = True
    lenient["spec"]["allowedTees"] = ["sim", "tdx"]
    lenient["spec"]["referenceValues"]["tdx"] = {"mrtd": ["cc" * 48]}
    policies = parse_policies([doc("current", "enforce", GOOD), lenient])
    debug = Claims(Tee.SIM, {"measurement": NEW}, b"\0" * 64, True, "00")
    decision = appraise_all(debug, policies, NOW)
    assert isinstance(decision, Rejected) and decision.policy == "default/current"
    assert {r.split(":")[0] for r in decision.reasons} == {
        "debug_not_allowed",
        "measurement_not_allowed",
    }
    assert isinstance(appraise_all(debug, parse_policies([lenient]), NOW), Rejected)


def test_audit_policy_does_not_set_the_certificate_ttl() -> None:
    current = doc("current", "enforce", GOOD)
    current["spec"]["certificateTTL"] = "2h"
    trial = doc("next", "audit", GOOD)
    trial["spec"]["certificateTTL"] = "5m"
    trial["spec"]["reattestationInterval"] = "1m"
    decision = appraise_all(claims(GOOD), parse_policies([current, trial]), NOW)
    assert isinstance(decision, Admitted)
    assert (decision.policy, decision.certificate_ttl) == ("default/current", timedelta(hours=2))
