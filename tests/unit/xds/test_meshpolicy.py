from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from certs.ca import claims_class
from certs.errors import PolicyError
from certs.evidence.claims import Claims, Tee
from certs.evidence.composite import merge_claims
from certs.policy import API_VERSION
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, record, registration
from xds.meshpolicy import (
    ClaimsCondition,
    HttpMatch,
    MeshPolicy,
    Permission,
    Rule,
    Source,
    compile_permissions,
    parse_mesh_policies,
)
from xds.state import (
    AttestationRecord,
    IssuedCert,
    MeshState,
    Trigger,
    quarantine,
    record_attestation,
    register,
    spiffe_id,
)

SNP = "cd" * 48


def _doc(name: str = "db-access", namespace: str | None = "shop", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "destination": {"serviceAccount": "db"},
        "rules": [{"from": [{"serviceAccount": "web"}]}],
    }
    body.update(spec)
    meta: dict[str, Any] = {"name": name}
    if namespace is not None:
        meta["namespace"] = namespace
    return {"apiVersion": API_VERSION, "kind": "MeshPolicy", "metadata": meta, "spec": body}


def _problems(docs: list[Any]) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_mesh_policies(docs)
    return info.value.problems


# ---------------------------------------------------------------------------------------------
# parsing


def test_valid_documents_parse_to_the_model() -> None:
    full = _doc(
        rules=[
            {
                "from": [
                    {"serviceAccount": "web"},
                    {"serviceAccount": "batch", "namespace": "jobs"},
                    {"identity": "spiffe://other.example/ns/a/sa/b"},
                ],
                "whenClaims": {"tees": ["sev-snp", "tdx"], "measurements": {"measurement": [SNP]}},
                "to": [
                    {"ports": [5432], "paths": ["/v1/"], "methods": ["GET", "POST"]},
                    {"paths": ["/health"]},
                ],
            },
            {"from": [{"serviceAccount": "admin"}]},
        ],
    )
    audit = _doc("audit-only", None, mode="audit")
    first, second = parse_mesh_policies([full, audit])
    assert first == MeshPolicy(
        name="db-access",
        namespace="shop",
        destination_service_account="db",
        rules=(
            Rule(
                sources=(
                    Source(namespace="shop", service_account="web"),  # policy's namespace
                    Source(namespace="jobs", service_account="batch"),
                    Source(identity="spiffe://other.example/ns/a/sa/b"),
                ),
                when_claims=ClaimsCondition(
                    frozenset({"sev-snp", "tdx"}), (("measurement", frozenset({SNP})),)
                ),
                to=(
                    HttpMatch(frozenset({5432}), ("/v1/",), frozenset({"GET", "POST"})),
                    HttpMatch(paths=("/health",)),
                ),
            ),
            Rule(sources=(Source(namespace="shop", service_account="admin"),)),
        ),
    )
    assert second.namespace == "default" and second.audit
    assert parse_mesh_policies([]) == ()


def test_every_problem_is_listed() -> None:
    bad = {
        "apiVersion": "v1",
        "kind": "MeshPolicy",
        "metadata": {"name": "Bad", "namespace": "x_y"},
        "spec": {
            "destination": {},
            "mode": "permissive",
            "extra": True,
            "rules": [
                {"from": []},
                {"from": [{"identity": "web"}, {"serviceAccount": "web", "port": 1}, 5]},
                {
                    "from": [{"serviceAccount": "web"}],
                    "whenClaims": {"tees": ["tpm"], "measurements": {"m": ["xyz"]}},
                    "to": [{"ports": [0], "paths": ["api"], "methods": ["FETCH"]}, {"host": "x"}],
                },
                {"from": [{"identity": "spiffe://a/b", "serviceAccount": "x"}], "oops": 1},
                {"from": [{"serviceAccount": "web"}], "whenClaims": {}},
            ],
        },
    }
    assert _problems([bad, "nope", {"apiVersion": API_VERSION, "kind": "MeshPolicy"}]) == [
        "document[0]: must be apiVersion attestmesh.dev/v1alpha1, kind MeshPolicy",
        "document[0].metadata.name: is required (DNS-1123 label)",
        "document[0].metadata.namespace: not a DNS-1123 label",
        "document[0].spec.extra: unknown field",
        "document[0].spec.destination.serviceAccount: is required",
        "document[0].spec.mode: must be enforce or audit",
        "document[0].spec.rules[0].from: must be a non-empty list",
        "document[0].spec.rules[1].from[0]: not a SPIFFE ID: 'web'",
        "document[0].spec.rules[1].from[1]: allowed fields: identity | serviceAccount, namespace",
        "document[0].spec.rules[1].from[2]: must be an object",
        "document[0].spec.rules[2].whenClaims.tees: must list TEEs from "
        "['nitro', 'nvidia-gpu', 'sev-snp', 'sgx', 'sim', 'tdx']",
        "document[0].spec.rules[2].whenClaims.measurements.m: must be a non-empty hex list",
        "document[0].spec.rules[2].whenClaims: needs tees and/or measurements",
        "document[0].spec.rules[2].to[0].ports: must be a list of port numbers",
        "document[0].spec.rules[2].to[0].paths: must be a list of path prefixes starting with /",
        "document[0].spec.rules[2].to[0].methods: must be a subset of "
        "['DELETE', 'GET', 'HEAD', 'OPTIONS', 'PATCH', 'POST', 'PUT']",
        "document[0].spec.rules[2].to[1]: allowed fields: ports, paths, methods",
        "document[0].spec.rules[3]: allowed fields: from, whenClaims, to",
        "document[0].spec.rules[4].whenClaims: needs tees and/or measurements",
        "document[1]: must be an object",
        "document[2].metadata.name: is required (DNS-1123 label)",
        "document[2].spec: is required",
    ]


@pytest.mark.parametrize(
    ("rule", "where"),
    [
        # unhashable values must be problems, not TypeError
        ({"from": [{"serviceAccount": "web"}], "whenClaims": {"tees": [{}]}}, "whenClaims.tees"),
        ({"from": [{"serviceAccount": "web"}], "to": [{"methods": [["GET"]]}]}, "to[0].methods"),
        # a trailing newline is not part of a DNS label or of a hex string
        ({"from": [{"serviceAccount": "web\n"}]}, "from[0].serviceAccount"),
        ({"from": [{"serviceAccount": "web", "namespace": "a\n"}]}, "from[0].namespace"),
        (
            {"from": [{"serviceAccount": "web"}], "whenClaims": {"measurements": {"m": ["ab\n"]}}},
            "whenClaims.measurements.m",
        ),
        ({"from": [{"serviceAccount": "web"}], "to": "all"}, "to"),
    ],
)
def test_odd_values_are_problems(rule: dict[str, Any], where: str) -> None:
    problems = _problems([_doc(rules=[rule])])
    assert problems[0].startswith(f"db-access.spec.rules[0].{where}:"), problems


def test_names_with_a_trailing_newline_are_refused() -> None:
    assert _problems([_doc(name="db\n")]) == [
        "document[0].metadata.name: is required (DNS-1123 label)"
    ]
    spec_dest = _doc(destination={"serviceAccount": "db\n"})
    assert _problems([spec_dest]) == ["db-access.spec.destination.serviceAccount: is required"]


# ---------------------------------------------------------------------------------------------
# compile_permissions


def _mesh() -> MeshState:
    """db (destination) in shop; web and batch attested (sim, snp); api pending; evil
    quarantined; other-web attested in another namespace."""
    state = MeshState(TRUST_DOMAIN)
    workloads = [
        ("db-0", "shop", "db", None),
        ("web-1", "shop", "web", ("sim", {"measurement": "aa" * 48})),
        ("batch-1", "jobs", "batch", ("sev-snp", {"measurement": SNP})),
        ("api-1", "shop", "api", None),
        ("evil-1", "shop", "evil", ("sim", {"measurement": "aa" * 48})),
        ("web-9", "other", "web", ("sim", {"measurement": "aa" * 48})),
    ]
    for i, (name, ns, sa, attestation) in enumerate(workloads):
        state, _ = register(
            state, registration(name, namespace=ns, service_account=sa, port=15000 + i), NOW
        )
        if attestation is not None:
            tee, measurements = attestation
            state, _ = record_attestation(
                state, name, record(tee, measurements), IssuedCert(i, NOW), NOW, NOW
            )
    state, _ = quarantine(state, "evil-1", Trigger.APPRAISAL_FAILED, "x", NOW)
    return state


def _id(ns: str, sa: str) -> str:
    return spiffe_id(TRUST_DOMAIN, ns, sa)


def _compile(*docs: dict[str, Any], state: MeshState | None = None) -> tuple[Permission, ...]:
    return compile_permissions(parse_mesh_policies(list(docs)), state or _mesh(), "db-0")


def test_only_attested_callers_are_allowed() -> None:
    doc = _doc(
        rules=[
            {
                "from": [
                    {"serviceAccount": "web"},
                    {"serviceAccount": "api"},  # pending
                    {"serviceAccount": "evil"},  # quarantined
                    {"serviceAccount": "batch", "namespace": "jobs"},
                ]
            }
        ]
    )
    assert _compile(doc) == (Permission(_id("jobs", "batch")), Permission(_id("shop", "web")))


def test_identity_sources_match_the_spiffe_id() -> None:
    doc = _doc(rules=[{"from": [{"identity": _id("other", "web")}]}])
    assert _compile(doc) == (Permission(_id("other", "web")),)


def test_claims_conditions_filter_callers() -> None:
    everyone = [
        {"serviceAccount": "web"},
        {"serviceAccount": "batch", "namespace": "jobs"},
    ]
    # a claims rule admits the principal only with a certificate of the matching caller's class
    only_snp = _doc(rules=[{"from": everyone, "whenClaims": {"tees": ["sev-snp"]}}])
    snp_class = claims_class("sev-snp", {"measurement": SNP})
    assert _compile(only_snp) == (Permission(_id("jobs", "batch"), (), frozenset({snp_class})),)
    by_measurement = _doc(
        rules=[{"from": everyone, "whenClaims": {"measurements": {"measurement": ["AA" * 48]}}}]
    )
    sim_class = claims_class("sim", {"measurement": "aa" * 48})
    assert _compile(by_measurement) == (Permission(_id("shop", "web"), (), frozenset({sim_class})),)
    nobody = _doc(
        rules=[
            {
                "from": everyone,
                "whenClaims": {"tees": ["sim"], "measurements": {"measurement": [SNP]}},
            }
        ]
    )
    assert _compile(nobody) == ()
    missing_key = _doc(rules=[{"from": everyone, "whenClaims": {"measurements": {"mrtd": ["aa"]}}}])
    assert _compile(missing_key) == ()


def test_audit_policies_and_other_destinations_are_ignored() -> None:
    audit = _doc(mode="audit")
    other_dest = _doc("to-api", destination={"serviceAccount": "api"})
    other_ns = _doc("elsewhere", "other")
    assert _compile(audit, other_dest, other_ns) == ()


def test_quarantined_caller_disappears_when_quarantined() -> None:
    doc = _doc()
    state = _mesh()
    assert _compile(doc, state=state) == (Permission(_id("shop", "web")),)
    state, _ = quarantine(state, "web-1", Trigger.DEADLINE_MISSED, "late", NOW)
    assert _compile(doc, state=state) == ()


def test_to_rules_merge_per_principal() -> None:
    web = [{"serviceAccount": "web"}]
    get_ = {"methods": ["GET"]}
    post = {"methods": ["POST"], "paths": ["/w"]}
    two_rules = _doc(rules=[{"from": web, "to": [get_]}, {"from": web, "to": [post, get_]}])
    assert _compile(two_rules) == (
        Permission(
            _id("shop", "web"),
            (
                HttpMatch(methods=frozenset({"GET"})),
                HttpMatch(frozenset(), ("/w",), frozenset({"POST"})),
            ),
        ),
    )
    # an unrestricted rule wins over restricted ones, in either order and across policies
    unrestricted_last = _doc(rules=[{"from": web, "to": [get_]}, {"from": web}])
    unrestricted_first = _doc(rules=[{"from": web}, {"from": web, "to": [get_]}])
    assert _compile(unrestricted_last) == (Permission(_id("shop", "web")),)
    assert _compile(unrestricted_first) == (Permission(_id("shop", "web")),)
    across = (_doc("a", rules=[{"from": web, "to": [get_]}]), _doc("b"))
    assert _compile(*across) == (Permission(_id("shop", "web")),)


def test_unknown_destination() -> None:
    from xds.state import UnknownWorkloadError

    with pytest.raises(UnknownWorkloadError):
        compile_permissions((), _mesh(), "ghost")


# -- composite callers (CPU + attached GPUs) ------------------------------------------------------


def _claims(tee: Tee, measurements: dict[str, str]) -> Claims:
    return Claims(tee, measurements, bytes(64), False, "cd" * 32)


def _composite_mesh() -> MeshState:
    """db-0 (destination); cvm-1: SEV-SNP with an H100 attached (composite claims as the
    composite verifier merges them); snp-1: SEV-SNP alone; td-1: TDX alone."""
    gpu = _claims(Tee.NVIDIA_GPU, {"measurement_0": "11" * 48, "measurement_1": "22" * 48})
    callers = {
        "cvm-1": merge_claims(_claims(Tee.SEV_SNP, {"measurement": SNP}), [gpu]),
        "snp-1": _claims(Tee.SEV_SNP, {"measurement": SNP}),
        "td-1": _claims(Tee.TDX, {"mrtd": "33" * 48}),
    }
    state, _ = register(MeshState(TRUST_DOMAIN), registration("db-0", namespace="shop",
                                                              service_account="db"), NOW)  # fmt: skip
    for i, (name, claims) in enumerate(callers.items(), start=1):
        reg = registration(name, namespace="shop", service_account=name, port=15000 + i)
        state, _ = register(state, reg, NOW)
        rec = AttestationRecord(claims.tee.value, dict(claims.measurements), "shop/pol",
                                claims.evidence_sha256, NOW, claims)  # fmt: skip
        state, _ = record_attestation(state, name, rec, IssuedCert(i, NOW), NOW, NOW)
    return state


def _callers(when: dict[str, Any]) -> list[str]:
    everyone = [{"serviceAccount": n} for n in ("cvm-1", "snp-1", "td-1")]
    doc = _doc(rules=[{"from": everyone, "whenClaims": when}])
    perms = compile_permissions(parse_mesh_policies([doc]), _composite_mesh(), "db-0")
    return [p.principal.rsplit("/", 1)[-1] for p in perms]


def test_a_rule_naming_the_gpu_matches_a_composite_caller_attested_with_gpu_evidence() -> None:
    assert _callers({"tees": ["nvidia-gpu"]}) == ["cvm-1"]
    # the CPU TEE still matches it, with or without GPUs; any TEE listed is enough
    assert _callers({"tees": ["sev-snp"]}) == ["cvm-1", "snp-1"]
    assert _callers({"tees": ["tdx", "nvidia-gpu"]}) == ["cvm-1", "td-1"]
    assert _callers({"tees": ["tdx"]}) == ["td-1"]
    # GPU measurements by their composite keys; with the GPU TEE named too
    assert _callers({"measurements": {"gpu0.measurement_1": ["22" * 48]}}) == ["cvm-1"]
    assert _callers({"tees": ["nvidia-gpu"], "measurements": {"gpu0.measurement_1": ["00"]}}) == []


def test_a_composite_callers_class_is_that_of_all_its_claims() -> None:
    doc = _doc(
        rules=[{"from": [{"serviceAccount": "cvm-1"}], "whenClaims": {"tees": ["nvidia-gpu"]}}]
    )
    state = _composite_mesh()
    rec = state.get("cvm-1").attestation
    assert rec is not None
    (perm,) = compile_permissions(parse_mesh_policies([doc]), state, "db-0")
    assert perm.claim_classes == frozenset({claims_class(rec.tee, rec.measurements)})
    assert "gpu0.measurement_0" in rec.measurements  # the GPU's claims are part of the class


def test_a_gpu_attached_claim_is_not_believed_without_composite_claims() -> None:
    """Only verified composite claims attach a TEE: a record without claims is its own TEE."""
    state = _composite_mesh()
    w = state.get("cvm-1")
    assert w.attestation is not None
    bare = replace(w, attestation=replace(w.attestation, claims=None))
    state = replace(state, workloads={**state.workloads, "cvm-1": bare})
    doc = _doc(
        rules=[{"from": [{"serviceAccount": "cvm-1"}], "whenClaims": {"tees": ["nvidia-gpu"]}}]
    )
    assert compile_permissions(parse_mesh_policies([doc]), state, "db-0") == ()
