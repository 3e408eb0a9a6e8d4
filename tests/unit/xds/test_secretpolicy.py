"""xds/secretpolicy.py: parsing (every problem listed; arbitrary input raises only
PolicyError) and the decisions: who asks (live_holder) and what they may have (authorize)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from certs.errors import PolicyError
from xds.secretpolicy import (
    Facts,
    Operation,
    SecretRefused,
    authorize,
    kbs_resource,
    live_holder,
    parse_secret_policies,
    secret_ref,
)
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    QuarantineRecord,
    Registration,
    Status,
    Trigger,
    WorkloadState,
)

TD = "td"
NOW = datetime(2026, 12, 1, tzinfo=UTC)
M = "ab" * 48
DOC: dict[str, Any] = {
    "apiVersion": "attestmesh.dev/v1alpha1",
    "kind": "SecretPolicy",
    "metadata": {"name": "p", "namespace": "pay"},
    "spec": {
        "secrets": [
            {"name": "db", "kv": {"mount": "secret", "path": "pay/db"}, "kbsResource": "r/t/db"},
            {"name": "mk", "transit": {"mount": "transit", "key": "m", "operations": ["unwrap"]}},
        ],
        "rules": [
            {
                "from": [{"serviceAccount": "api"}],
                "secrets": ["db", "mk"],
                "whenClaims": {"tees": ["tdx"], "measurements": {"mrtd": [M.upper()]}},
            },
            {"from": [{"identity": f"spiffe://{TD}/ns/other/sa/batch"}], "secrets": ["db"]},
        ],
    },
}
(POLICY,) = parse_secret_policies([DOC])


def facts(**kw: Any) -> Facts:
    base: dict[str, Any] = {
        "spiffe_id": f"spiffe://{TD}/ns/pay/sa/api",
        "namespace": "pay",
        "service_account": "api",
        "tee": "tdx",
        "measurements": {"mrtd": M},
        "tcb_status": "UpToDate",
    }
    return Facts(**{**base, **kw})


def test_authorize_grants_by_service_account_and_claims() -> None:
    g = authorize([POLICY], facts(), "pay/db", Operation.READ)
    assert (g.ref, g.policy, g.secret.name) == ("pay/db", "p", "db")
    assert authorize([POLICY], facts(), "pay/mk", Operation.UNWRAP).secret.name == "mk"


def test_authorize_grants_by_identity_without_claims() -> None:
    f = facts(spiffe_id=f"spiffe://{TD}/ns/other/sa/batch", namespace="other", tee="sim")
    assert authorize([POLICY], f, "pay/db", Operation.READ).ref == "pay/db"


@pytest.mark.parametrize(
    ("f", "ref", "op", "reason"),
    [
        (facts(), "pay/nope", Operation.READ, "unknown_secret"),
        (facts(), "other/db", Operation.READ, "unknown_secret"),
        (facts(service_account="web"), "pay/db", Operation.READ, "not_allowed"),
        (facts(namespace="x"), "pay/db", Operation.READ, "not_allowed"),
        (facts(tee="sev-snp"), "pay/db", Operation.READ, "claims_not_allowed"),
        (facts(measurements={"mrtd": "cd" * 48}), "pay/db", Operation.READ, "claims_not_allowed"),
        (facts(measurements={}), "pay/db", Operation.READ, "claims_not_allowed"),
        (facts(), "pay/db", Operation.UNWRAP, "operation_not_allowed"),
        (facts(), "pay/mk", Operation.WRAP, "operation_not_allowed"),
        (facts(), "pay/mk", Operation.READ, "operation_not_allowed"),
    ],
)
def test_authorize_refuses(f: Facts, ref: str, op: Operation, reason: str) -> None:
    with pytest.raises(SecretRefused) as e:
        authorize([POLICY], f, ref, op)
    assert e.value.reason == reason


def test_tcb_status_requirement() -> None:
    doc = copy.deepcopy(DOC)
    doc["spec"]["rules"][0]["whenClaims"] = {"tcbStatuses": ["UpToDate"]}
    (p,) = parse_secret_policies([doc])
    assert authorize([p], facts(), "pay/db", Operation.READ)
    with pytest.raises(SecretRefused, match="claims"):
        authorize([p], facts(tcb_status="OutOfDate"), "pay/db", Operation.READ)
    with pytest.raises(SecretRefused, match="claims"):
        authorize([p], facts(tcb_status=None), "pay/db", Operation.READ)


def test_secret_ref_and_kbs_lookup() -> None:
    assert secret_ref("db", "pay") == "pay/db"
    assert secret_ref("pay/db", "other") == "pay/db"
    for bad in ("a/b/c", "DB", "", "../x", "pay/"):
        with pytest.raises(SecretRefused):
            secret_ref(bad, "pay")
    assert kbs_resource([POLICY], "r/t/db") == "pay/db"
    assert kbs_resource([POLICY], "r/t/x") is None


def test_the_same_secret_in_two_policies_is_refused() -> None:
    other = copy.deepcopy(DOC)
    other["metadata"]["name"] = "q"
    other["spec"]["secrets"][0].pop("kbsResource")
    with pytest.raises(PolicyError) as e:
        parse_secret_policies([DOC, other])
    assert any("secret pay/db: defined by policy p" in p for p in e.value.problems)


def test_every_problem_is_listed() -> None:
    doc = copy.deepcopy(DOC)
    doc["spec"]["secrets"][0]["kv"]["version"] = 0
    doc["spec"]["rules"][1]["secrets"] = ["nope"]
    doc["spec"]["extra"] = 1
    with pytest.raises(PolicyError) as e:
        parse_secret_policies([doc])
    assert len(e.value.problems) == 3


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4)))  # fmt: skip
def test_arbitrary_documents_raise_only_policy_error(doc: Any) -> None:
    with contextlib.suppress(PolicyError):
        parse_secret_policies([doc])


@given(st.sampled_from(["spec", "spec.secrets.0", "spec.rules.0", "spec.rules.0.whenClaims"]),
       st.recursive(st.none() | st.integers() | st.text(max_size=6), lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=6), c, max_size=3)))  # fmt: skip
def test_arbitrary_values_in_place_raise_only_policy_error(where: str, value: Any) -> None:
    doc = copy.deepcopy(DOC)
    *parents, last = where.split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[int(last) if isinstance(node, list) else last] = value
    with contextlib.suppress(PolicyError):
        parse_secret_policies([doc])


# -- live_holder ------------------------------------------------------------------------


def _state(status: Status = Status.ATTESTED, serials: tuple[int, ...] = (1, 2)) -> MeshState:
    reg = Registration("pay/api-0", "pay", "api", "api", Endpoint("10.0.0.1", 15006), 8080)
    w = WorkloadState(
        reg,
        status=status,
        attestation=AttestationRecord("tdx", {"mrtd": M}, "pol", "00", NOW),
        certificates=tuple(IssuedCert(s, NOW) for s in serials),
        quarantine=QuarantineRecord(Trigger.OPERATOR, "x", NOW)
        if status is Status.QUARANTINED
        else None,
    )
    return MeshState(TD, {reg.name: w})


URI = (f"spiffe://{TD}/ns/pay/sa/api",)


def test_live_holder_accepts_the_newest_certificate_only() -> None:
    assert live_holder(_state(), "pay/api-0", URI, 2).registration.name == "pay/api-0"
    for workload, uris, serial, reason, state in [
        ("pay/api-0", URI, 1, "certificate_not_live", _state()),
        ("pay/api-0", URI, None, "certificate_not_live", _state()),
        ("pay/api-0", ("spiffe://td/ns/pay/sa/web",), 2, "identity_mismatch", _state()),
        ("pay/api-1", URI, 2, "unknown_workload", _state()),
        ("pay/api-0", URI, 2, "quarantined", _state(Status.QUARANTINED)),
        ("pay/api-0", URI, 2, "not_attested", _state(Status.PENDING)),
        ("pay/api-0", URI, 2, "certificate_not_live", _state(serials=())),
    ]:
        with pytest.raises(SecretRefused) as e:
            live_holder(state, workload, uris, serial)
        assert e.value.reason == reason, (workload, serial, reason)


def test_facts_follow_the_record() -> None:
    from xds.secretpolicy import facts_of

    state = _state()
    w = state.workloads["pay/api-0"]
    f = facts_of(state, w)
    assert (f.spiffe_id, f.tee, dict(f.measurements), f.tcb_status) == (
        URI[0],
        "tdx",
        {"mrtd": M},
        None,
    )
    w2 = replace(w, attestation=replace(w.attestation, tee="sgx"))  # type: ignore[type-var]
    assert facts_of(state, w2).tee == "sgx"
