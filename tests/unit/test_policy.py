from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from certs.errors import PolicyError
from certs.evidence.claims import Tee
from certs.policy import (
    DEFAULT_REATTESTATION,
    DEFAULT_TTL,
    Admitted,
    AttestationPolicy,
    Mode,
    OnFailure,
    ReferenceValues,
    Rejected,
    Selector,
    appraise,
    appraise_all,
    format_duration,
    parse_duration,
    parse_policies,
    policies_for,
)
from tests.unit.fixtures_core import MEASUREMENT_HEX, NOW, claims, policy_doc

SNP_MEASUREMENT = "cd" * 48
CHIP = "ef" * 64
TDX_MRTD = "12" * 48


def _problems(docs: list[Any]) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policies(docs)
    assert info.value.reason == "policy_invalid"
    assert info.value.detail == "; ".join(info.value.problems)
    return info.value.problems


def _policy(**kwargs: Any) -> AttestationPolicy:
    base: dict[str, Any] = {
        "name": "default/pol",
        "selector": Selector("default", frozenset({"web"})),
        "allowed_tees": frozenset({Tee.SIM}),
        "reference_values": {
            Tee.SIM: ReferenceValues(measurements={"measurement": frozenset({MEASUREMENT_HEX})})
        },
    }
    base.update(kwargs)
    return AttestationPolicy(**base)


# ---------------------------------------------------------------------------------------------
# parse_policies


def test_valid_multi_document_policy_parses_to_the_model() -> None:
    snp = policy_doc(
        "snp-web",
        "shop",
        service_accounts=["web", "api"],
        tees=["sev-snp", "sim"],
        refs={
            "sevSnp": {
                "measurement": [SNP_MEASUREMENT.upper()],
                "hostData": ["00" * 32],
                "minimumTcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
                "chipIds": [CHIP],
                "minimumGuestSvn": 2,
                "allowMigrationAgent": True,
                "allowSmt": False,
            },
            "sim": {"measurement": [MEASUREMENT_HEX]},
        },
        allowDebug=True,
        mode="audit",
        onFailure="quarantineAndEvict",
        certificateTTL="2h",
        reattestationInterval="1h30m",
    )
    snp["metadata"]["generation"] = 7
    tdx = policy_doc(
        "tdx-db",
        "shop",
        tees=["tdx"],
        refs={
            "tdx": {
                "mrtd": [TDX_MRTD],
                "rtmr0": ["34" * 48],
                "acceptedTcbStatuses": ["UpToDate", "SWHardeningNeeded"],
                "allowedAdvisories": ["INTEL-SA-00615"],
            }
        },
    )
    tdx["spec"]["selector"] = {"matchLabels": {"app": "db"}}
    sgx = policy_doc(
        "sgx",
        tees=["sgx"],
        refs={"sgx": {"mrsigner": ["aa" * 32], "productId": 3, "minimumSvn": 5}},
    )
    gpu = policy_doc(
        "gpu", tees=["nvidia-gpu"], refs={"nvidiaGpu": {"measurements": {"0": ["bb" * 48]}}}
    )

    first, second, third, fourth = parse_policies([snp, tdx, sgx, gpu])

    assert first == AttestationPolicy(
        name="shop/snp-web",
        selector=Selector("shop", frozenset({"web", "api"}), {}),
        allowed_tees=frozenset({Tee.SEV_SNP, Tee.SIM}),
        reference_values={
            Tee.SEV_SNP: ReferenceValues(
                measurements={
                    "measurement": frozenset({SNP_MEASUREMENT}),  # lower-cased
                    "host_data": frozenset({"00" * 32}),
                },
                minimum_tcb={"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
                platform_ids=frozenset({CHIP}),
                minimum_svn=2,
                allow_migration_agent=True,
                allow_smt=False,
            ),
            Tee.SIM: ReferenceValues(measurements={"measurement": frozenset({MEASUREMENT_HEX})}),
        },
        allow_debug=True,
        mode=Mode.AUDIT,
        on_failure=OnFailure.QUARANTINE_AND_EVICT,
        certificate_ttl=timedelta(hours=2),
        reattestation_interval=timedelta(hours=1, minutes=30),
        generation=7,
    )
    assert second.name == "shop/tdx-db"
    assert second.selector == Selector("shop", frozenset(), {"app": "db"})
    assert second.certificate_ttl == DEFAULT_TTL
    assert second.reattestation_interval == DEFAULT_REATTESTATION
    assert second.mode is Mode.ENFORCE and second.on_failure is OnFailure.QUARANTINE
    assert second.reference_values[Tee.TDX] == ReferenceValues(
        measurements={"mrtd": frozenset({TDX_MRTD}), "rtmr0": frozenset({"34" * 48})},
        accepted_tcb_statuses=frozenset({"UpToDate", "SWHardeningNeeded"}),
        allowed_advisories=frozenset({"INTEL-SA-00615"}),
    )
    assert third.reference_values[Tee.SGX] == ReferenceValues(
        measurements={"mrsigner": frozenset({"aa" * 32})}, product_id=3, minimum_svn=5
    )
    assert fourth.reference_values[Tee.NVIDIA_GPU].measurements == {
        "measurement_0": frozenset({"bb" * 48})
    }


def test_empty_document_list_is_no_policies() -> None:
    assert parse_policies([]) == ()


def test_every_problem_in_one_document_is_reported_at_once() -> None:
    doc = policy_doc(
        "Bad_Name",
        tees=["sim", "quantum"],
        refs={"sim": {"measurement": ["xyz", "abc"]}, "mars": {}},
        allowDebug="yes",
        mode="loud",
        onFailure="explode",
        certificateTTL="48h",
        reattestationInterval="soon",
        extra=1,
    )
    doc["apiVersion"] = "v1"
    doc["kind"] = "Policy"
    doc["spec"]["selector"] = {"serviceAccounts": [], "colour": "red"}  # empty: no selector
    problems = _problems([doc])
    assert problems == [
        "document[0].apiVersion: must be attestmesh.dev/v1alpha1",
        "document[0].kind: must be AttestationPolicy",
        "document[0].metadata.name: not a DNS-1123 label: 'Bad_Name'",
        "Bad_Name.spec.extra: unknown field (allowed: allowDebug, allowedTees, "
        "certificateTTL, mode, onFailure, onTcbChange, reattestationInterval, referenceValues, "
        "requires, selector, tcbChangeGracePeriod)",
        "Bad_Name.spec.selector.colour: unknown field (allowed: matchLabels, serviceAccounts)",
        "Bad_Name.spec.selector: needs serviceAccounts and/or matchLabels",
        "Bad_Name.spec.allowedTees: unknown TEE 'quantum' "
        "(one of sim, nitro, sev-snp, tdx, sgx, nvidia-gpu)",
        "Bad_Name.spec.referenceValues.mars: unknown TEE section",
        "Bad_Name.spec.referenceValues.sim.measurement[0]: not a hex string: 'xyz'",
        "Bad_Name.spec.referenceValues.sim.measurement[1]: not a hex string: 'abc'",
        "Bad_Name.spec.allowDebug: must be true or false",
        "Bad_Name.spec.mode: must be one of enforce, audit",
        "Bad_Name.spec.onFailure: must be one of quarantine, quarantineAndEvict",
        "Bad_Name.spec.certificateTTL: must be between 1m and 24h",
        "Bad_Name.spec.reattestationInterval: invalid duration 'soon' (use e.g. 90s, 10m, 1h30m)",
    ]


def test_problems_of_several_documents_are_all_listed() -> None:
    missing_refs = policy_doc("a", tees=["sev-snp"], refs={})
    no_spec = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": "b"},
    }
    not_object = ["just", "a", "list"]
    no_name = policy_doc()
    del no_name["metadata"]["name"]
    interval_too_long = policy_doc("c", certificateTTL="10m", reattestationInterval="20m")
    interval_too_short = policy_doc("d", reattestationInterval="2s")
    problems = _problems(
        [missing_refs, no_spec, not_object, no_name, interval_too_long, interval_too_short]
    )
    assert problems == [
        "a.spec.referenceValues.sevSnp: required because sev-snp is allowed",
        "b.spec: is required",
        "document[2]: must be an object",
        "document[3].metadata.name: is required",
        "c.spec.reattestationInterval: must not exceed certificateTTL",
        "d.spec.reattestationInterval: must be at least 5s",
    ]


@pytest.mark.parametrize(
    ("tee", "section", "refs", "expected"),
    [
        (
            "sim",
            "sim",
            {"measurement": ["aa"], "mrenclave": ["bb"]},
            "pol.spec.referenceValues.sim.mrenclave: unknown field (allowed: measurement)",
        ),
        (
            "sev-snp",
            "sevSnp",
            {"measurement": ["aa"], "minimumTcb": {"fpga": 1}},
            "pol.spec.referenceValues.sevSnp.minimumTcb.fpga: unknown field "
            "(allowed: bootloader, microcode, snp, tee)",
        ),
        (
            "tdx",
            "tdx",
            {"mrtd": ["aa"], "productId": 1},
            "pol.spec.referenceValues.tdx.productId: unknown field (allowed: "
            "acceptedTcbStatuses, allowedAdvisories, mrconfigid, mrseam, mrtd, rtmr0, rtmr1, "
            "rtmr2, rtmr3)",
        ),
        (
            "sim",
            "sim",
            {},
            "pol.spec.referenceValues.sim: at least one reference measurement is required",
        ),
        (
            "tdx",
            "tdx",
            {"mrtd": ["aa"], "acceptedTcbStatuses": ["Fine"]},
            "pol.spec.referenceValues.tdx.acceptedTcbStatuses: unknown TCB status 'Fine'",
        ),
        (
            "sev-snp",
            "sevSnp",
            {"measurement": ["aa"], "minimumTcb": {"snp": -1}},
            "pol.spec.referenceValues.sevSnp.minimumTcb.snp: must be an integer >= 0",
        ),
        (
            "sgx",
            "sgx",
            {"mrenclave": ["aa"], "minimumSvn": True},
            "pol.spec.referenceValues.sgx.minimumSvn: must be an integer >= 0",
        ),
        (
            "nvidia-gpu",
            "nvidiaGpu",
            {"measurements": {"first": ["aa"]}},
            "pol.spec.referenceValues.nvidiaGpu.measurements.first: index must be a number",
        ),
        (
            "sim",
            "sim",
            {"measurement": []},
            "pol.spec.referenceValues.sim.measurement: must be a non-empty list of hex strings",
        ),
        ("sim", "sim", "aa", "pol.spec.referenceValues.sim: must be an object"),
    ],
)
def test_reference_value_problems(tee: str, section: str, refs: Any, expected: str) -> None:
    assert expected in _problems([policy_doc(tees=[tee], refs={section: refs})])


def test_unknown_fields_are_rejected_at_every_level() -> None:
    doc = policy_doc(surprise=True)
    doc["spec"]["selector"]["namespaceSelector"] = {}
    doc["spec"]["referenceValues"]["sim"]["pcr0"] = ["aa"]
    problems = _problems([doc])
    assert [p.split(":")[0] for p in problems] == [
        "pol.spec.surprise",
        "pol.spec.selector.namespaceSelector",
        "pol.spec.referenceValues.sim.pcr0",
    ]
    assert all("unknown field" in p for p in problems)


def test_duplicate_policy_names_are_refused() -> None:
    assert _problems([policy_doc("x"), policy_doc("x"), policy_doc("x", "other")]) == [
        "default/x: defined more than once"
    ]


@pytest.mark.parametrize("bad", [{"web": 1}, ["web"], "web"])
def test_match_labels_must_map_strings_to_strings(bad: Any) -> None:
    doc = policy_doc()
    doc["spec"]["selector"] = {"serviceAccounts": ["web"], "matchLabels": bad}
    assert _problems([doc]) == ["pol.spec.selector.matchLabels: must map strings to strings"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90s", timedelta(seconds=90)),
        ("10m", timedelta(minutes=10)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("2h0m5s", timedelta(hours=2, seconds=5)),
        (" 1h ", timedelta(hours=1)),
    ],
)
def test_parse_duration(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected
    assert parse_duration(format_duration(expected)) == expected


@pytest.mark.parametrize("text", ["", "  ", "1d", "10", "m", "1m1h", "-5s", "1.5h", 90, None])
def test_parse_duration_rejects(text: Any) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


def test_non_string_duration_in_a_document_is_a_problem_not_a_crash() -> None:
    assert _problems([policy_doc(certificateTTL=3600)]) == [
        "pol.spec.certificateTTL: invalid duration 3600 (use e.g. 90s, 10m, 1h30m)"
    ]


# ---------------------------------------------------------------------------------------------
# policies_for


def test_policies_for_matches_namespace_service_account_and_labels() -> None:
    by_sa = _policy(name="a", selector=Selector("shop", frozenset({"web"})))
    by_label = _policy(name="b", selector=Selector("shop", frozenset(), {"tier": "front"}))
    both = _policy(name="c", selector=Selector("shop", frozenset({"web"}), {"tier": "front"}))
    other_ns = _policy(name="d", selector=Selector("other", frozenset({"web"})))
    policies = [by_sa, by_label, both, other_ns]
    assert policies_for(policies, "shop", "web", {"tier": "front"}) == (by_sa, by_label, both)
    assert policies_for(policies, "shop", "web") == (by_sa,)
    assert policies_for(policies, "shop", "api", {"tier": "front"}) == (by_label,)
    assert policies_for(policies, "shop", "api", {"tier": "back"}) == ()
    assert policies_for(policies, "other", "web") == (other_ns,)


# ---------------------------------------------------------------------------------------------
# appraise


def test_appraise_admits_matching_claims() -> None:
    policy = _policy(certificate_ttl=timedelta(minutes=20))
    c = claims(measurements={"measurement": MEASUREMENT_HEX.upper()})
    decision = appraise(c, policy, NOW)
    assert decision == Admitted(c, "default/pol", NOW, timedelta(minutes=20))


def _snp_policy(**ref: Any) -> AttestationPolicy:
    values: dict[str, Any] = {"measurements": {"measurement": frozenset({SNP_MEASUREMENT})}}
    values.update(ref)
    return _policy(
        allowed_tees=frozenset({Tee.SEV_SNP, Tee.SGX, Tee.TDX}),
        reference_values={
            Tee.SEV_SNP: ReferenceValues(**values),
            Tee.SGX: ReferenceValues(**values),
            Tee.TDX: ReferenceValues(**values),
        },
    )


def _snp_claims(**overrides: Any) -> Any:
    base: dict[str, Any] = {"tee": Tee.SEV_SNP, "measurements": {"measurement": SNP_MEASUREMENT}}
    base.update(overrides)
    return claims(**base)


@pytest.mark.parametrize(
    ("policy", "c", "reasons"),
    [
        (
            _policy(),
            claims(Tee.NITRO, measurements={"pcr0": "00"}),
            ("tee_not_allowed: nitro not in [<Tee.SIM: 'sim'>]",),
        ),
        (_policy(), claims(debug=True), ("debug_not_allowed",)),
        (
            _policy(),
            claims(measurements={"measurement": "ff" * 48}),
            ("measurement_not_allowed: measurement=" + "ff" * 48,),
        ),
        (_policy(), claims(measurements={"other": "00"}), ("measurement_missing: measurement",)),
        (
            _snp_policy(minimum_tcb={"snp": 8, "microcode": 100}),
            _snp_claims(tcb={"snp": 7, "microcode": 200}),
            ("tcb_below_minimum: snp=7 < 8",),
        ),
        (
            _snp_policy(minimum_tcb={"bootloader": 1}),
            _snp_claims(tcb={}),
            ("tcb_below_minimum: bootloader=None < 1",),
        ),
        (
            _snp_policy(platform_ids=frozenset({CHIP})),
            _snp_claims(platform_id="00" * 64),
            ("platform_not_allowed: " + "00" * 64,),
        ),
        (
            _snp_policy(platform_ids=frozenset({CHIP})),
            _snp_claims(platform_id=None),
            ("platform_not_allowed: None",),
        ),
        (
            _snp_policy(minimum_svn=3),
            _snp_claims(svn=2),
            ("svn_below_minimum: 2 < 3",),
        ),
        (
            _snp_policy(minimum_svn=3),
            _snp_claims(svn=None),
            ("svn_below_minimum: None < 3",),
        ),
        (
            _snp_policy(product_id=4),
            _snp_claims(tee=Tee.SGX, product_id=5),
            ("product_id_mismatch: 5 != 4",),
        ),
        (
            _snp_policy(),
            _snp_claims(tee=Tee.TDX, tcb_status="OutOfDate"),
            ("tcb_status_not_accepted: OutOfDate",),
        ),
        (
            _snp_policy(allowed_advisories=frozenset({"INTEL-SA-1"})),
            _snp_claims(
                tee=Tee.TDX,
                tcb_status="UpToDate",
                advisories=("INTEL-SA-3", "INTEL-SA-1", "INTEL-SA-2"),
            ),
            ("advisories_not_allowed: INTEL-SA-2,INTEL-SA-3",),
        ),
        (
            _snp_policy(),
            _snp_claims(details={"migration_agent_allowed": True}),
            ("migration_agent_not_allowed",),
        ),
        (
            _snp_policy(allow_smt=False),
            _snp_claims(details={"smt_allowed": True}),
            ("smt_not_allowed",),
        ),
    ],
)
def test_appraise_rejection_reasons(
    policy: AttestationPolicy, c: Any, reasons: tuple[str, ...]
) -> None:
    decision = appraise(c, policy, NOW)
    assert isinstance(decision, Rejected)
    assert decision.policy == "default/pol" and decision.at == NOW
    assert len(decision.reasons) == len(reasons)
    for got, want in zip(decision.reasons, reasons, strict=True):
        assert got.startswith(want), got
    assert decision.reason == reasons[0].split(":")[0]


def test_appraise_collects_every_reason() -> None:
    policy = _snp_policy(minimum_tcb={"snp": 8}, minimum_svn=2, allow_smt=False)
    c = _snp_claims(
        debug=True,
        measurements={"measurement": "00" * 48},
        tcb={"snp": 1},
        svn=1,
        details={"smt_allowed": True, "migration_agent_allowed": True},
    )
    decision = appraise(c, policy, NOW)
    assert isinstance(decision, Rejected)
    assert [r.split(":")[0] for r in decision.reasons] == [
        "debug_not_allowed",
        "measurement_not_allowed",
        "tcb_below_minimum",
        "svn_below_minimum",
        "migration_agent_not_allowed",
        "smt_not_allowed",
    ]


def test_appraise_permits_what_the_policy_allows() -> None:
    policy = _snp_policy(
        minimum_tcb={"snp": 8},
        platform_ids=frozenset({CHIP}),
        minimum_svn=2,
        allow_migration_agent=True,
        allow_smt=True,
    )
    policy = _policy(
        allowed_tees=policy.allowed_tees, reference_values=policy.reference_values, allow_debug=True
    )
    c = _snp_claims(
        debug=True,
        tcb={"snp": 9},
        platform_id=CHIP.upper(),
        svn=2,
        details={"smt_allowed": True, "migration_agent_allowed": True},
    )
    assert isinstance(appraise(c, policy, NOW), Admitted)


def test_smt_and_migration_details_only_count_for_sev_snp() -> None:
    policy = _snp_policy(allow_smt=False)
    c = _snp_claims(tee=Tee.TDX, details={"smt_allowed": True, "migration_agent_allowed": True})
    assert isinstance(appraise(c, policy, NOW), Admitted)


# ---------------------------------------------------------------------------------------------
# appraise_all


def test_appraise_all_without_governing_policy_is_no_policy() -> None:
    decision = appraise_all(claims(), [], NOW)
    assert isinstance(decision, Rejected)
    assert decision.reason == "no_policy"
    assert decision.policy == ""


def test_appraise_all_is_a_conjunction_with_the_shortest_ttl() -> None:
    long = _policy(name="ns/long", certificate_ttl=timedelta(hours=4))
    short = _policy(name="ns/short", certificate_ttl=timedelta(minutes=15))
    decision = appraise_all(claims(), [long, short], NOW)
    assert decision == Admitted(claims(), "ns/long,ns/short", NOW, timedelta(minutes=15))


def test_appraise_all_rejects_when_any_policy_rejects_and_lists_all_reasons() -> None:
    lenient = _policy(name="ns/lenient", allow_debug=True)
    strict = _policy(name="ns/strict")
    other = _policy(
        name="ns/other",
        reference_values={
            Tee.SIM: ReferenceValues(measurements={"measurement": frozenset({"00" * 48})})
        },
    )
    decision = appraise_all(claims(debug=True), [lenient, strict, other], NOW)
    assert isinstance(decision, Rejected)
    assert decision.policy == "ns/strict,ns/other"
    assert [r.split(":")[0] for r in decision.reasons] == [
        "debug_not_allowed",
        "debug_not_allowed",
        "measurement_not_allowed",
    ]
    assert decision.reason == "debug_not_allowed"


def test_trailing_newline_is_not_a_valid_name_or_hex() -> None:
    doc = policy_doc("pol\n", refs={"sim": {"measurement": ["abc\n"]}})
    doc["metadata"]["namespace"] = "shop\n"
    problems = _problems([doc])
    assert len(problems) == 3
