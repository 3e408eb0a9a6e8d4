"""The pure snapshot builder: consistency, content-hash versions, quarantine, sharing."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic.warnings import PydanticDeprecatedSince212

from tests.unit.xds.meshfixture import NOW, TD, TRUST, allow, many_callers, two_workloads
from xds.build import Packer, Snapshot, TrustMaterial, build_snapshot, build_snapshots
from xds.meshpolicy import HttpMatch
from xds.resources import INBOUND_ROUTE, MESH_TRUST, TypeUrl
from xds.state import Trigger, quarantine

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    import envoy_data_plane.envoy.config.cluster.v3
    import envoy_data_plane.envoy.config.endpoint.v3
    import envoy_data_plane.envoy.config.listener.v3
    import envoy_data_plane.envoy.config.route.v3
    import envoy_data_plane.envoy.extensions.filters.http.rbac.v3
    import envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3
    import envoy_data_plane.envoy.extensions.transport_sockets.tls.v3  # noqa: F401
    from envoy_data_plane.google.protobuf import Any as AnyMsg

POLICIES = [allow("backend", "frontend"), allow("frontend", "backend")]


def decoded(snap: Snapshot, t: TypeUrl, name: str) -> dict[str, Any]:
    any_ = AnyMsg.parse(snap.get(t)[name])
    assert any_.type_url == t
    out: dict[str, Any] = any_.to_dict()
    return out


def endpoints(snap: Snapshot, cluster: str) -> list[tuple[str, int]]:
    cla = decoded(snap, TypeUrl.ENDPOINT, cluster)
    return [
        (e["endpoint"]["address"]["socketAddress"]["address"],
         e["endpoint"]["address"]["socketAddress"]["portValue"])
        for group in cla.get("endpoints", []) for e in group["lbEndpoints"]
    ]  # fmt: skip


def principals(snap: Snapshot) -> list[str]:
    rc = decoded(snap, TypeUrl.ROUTE, INBOUND_ROUTE)
    route = rc["virtualHosts"][0]["routes"][0]
    rbac = route["typedPerFilterConfig"]["envoy.filters.http.rbac"]["rbac"]["rules"]
    return sorted(
        p["authenticated"]["principalName"]["exact"]
        for policy in rbac.get("policies", {}).values()
        for p in policy["principals"]
    )


def test_snapshot_is_consistent_and_complete() -> None:
    snap = build_snapshot(two_workloads(), "frontend", POLICIES, TRUST)
    assert snap.consistent()
    assert set(snap.get(TypeUrl.CLUSTER)) == {"inbound|app", "out|backend"}
    assert set(snap.get(TypeUrl.ENDPOINT)) == {"out|backend"}
    assert set(snap.get(TypeUrl.LISTENER)) == {"inbound", "out|backend"}
    assert set(snap.get(TypeUrl.ROUTE)) == {"inbound"}
    assert set(snap.get(TypeUrl.SECRET)) == {MESH_TRUST}
    assert endpoints(snap, "out|backend") == [("127.0.0.1", 15002)]
    assert principals(snap) == [f"spiffe://{TD}/ns/default/sa/backend"]
    cluster = decoded(snap, TypeUrl.CLUSTER, "out|backend")
    tls = cluster["transportSocket"]["typedConfig"]["commonTlsContext"]
    sans = tls["combinedValidationContext"]["defaultValidationContext"]
    assert sans["matchTypedSubjectAltNames"] == [
        {"sanType": "URI", "matcher": {"exact": f"spiffe://{TD}/ns/default/sa/backend"}}
    ]
    assert tls["tlsCertificateSdsSecretConfigs"][0]["name"] == "workload-cert"
    secret = decoded(snap, TypeUrl.SECRET, MESH_TRUST)["validationContext"]
    assert secret["onlyVerifyLeafCertCrl"] is True and "crl" in secret


def test_missing_references_make_a_snapshot_inconsistent() -> None:
    snap = build_snapshot(two_workloads(), "frontend", POLICIES, TRUST)
    broken = Snapshot.of(
        {t: dict(snap.get(t)) for t in TypeUrl if t is not TypeUrl.ENDPOINT}, snap.references
    )
    assert not broken.consistent()
    assert broken.missing() == {(TypeUrl.ENDPOINT, "out|backend")}


def test_versions_are_content_hashes() -> None:
    state = two_workloads()
    a = build_snapshot(state, "frontend", POLICIES, TRUST, packer=Packer())
    b = build_snapshot(state, "frontend", POLICIES, TRUST, packer=Packer())
    assert a.versions == b.versions and all(a.versions.values())
    c = build_snapshot(state, "frontend", POLICIES, TrustMaterial(TRUST.bundle_pem, b"crl2"))
    changed = {t for t in TypeUrl if a.version(t) != c.version(t)}
    assert changed == {TypeUrl.SECRET}


def test_policy_change_touches_only_rds() -> None:
    state = two_workloads()
    a = build_snapshot(state, "backend", POLICIES, TRUST)
    b = build_snapshot(state, "backend", [allow("frontend", "backend")], TRUST)
    assert {t for t in TypeUrl if a.version(t) != b.version(t)} == {TypeUrl.ROUTE}
    assert principals(b) == []  # nobody may call backend any more: deny all


def test_http_match_becomes_rbac_permissions() -> None:
    to = HttpMatch(frozenset({8443}), ("/api", "/v2"), frozenset({"GET"}))
    snap = build_snapshot(two_workloads(), "backend", [allow("backend", "frontend", to)], TRUST)
    rc = decoded(snap, TypeUrl.ROUTE, INBOUND_ROUTE)
    rules = rc["virtualHosts"][0]["routes"][0]["typedPerFilterConfig"]["envoy.filters.http.rbac"][
        "rbac"
    ]["rules"]
    (policy,) = rules["policies"].values()
    assert policy["permissions"] == [
        {"andRules": {"rules": [
            {"destinationPort": 8443},
            {"orRules": {"rules": [
                {"urlPath": {"path": {"prefix": "/api"}}},
                {"urlPath": {"path": {"prefix": "/v2"}}},
            ]}},
            {"header": {"name": ":method", "stringMatch": {"exact": "GET"}}},
        ]}}
    ]  # fmt: skip


def test_quarantine_empties_endpoints_and_rbac() -> None:
    state, _ = quarantine(two_workloads(), "backend", Trigger.OPERATOR, "test", NOW)
    fe_before = build_snapshot(two_workloads(), "frontend", POLICIES, TRUST)
    fe = build_snapshot(state, "frontend", POLICIES, TRUST)
    be = build_snapshot(state, "backend", POLICIES, TRUST)
    assert endpoints(fe, "out|backend") == []  # callers lose the quarantined endpoints
    assert principals(fe) == []  # and stop admitting it (applies to open connections)
    assert endpoints(be, "out|frontend") == []  # the quarantined node reaches nobody
    assert principals(be) == []  # and admits nobody
    assert fe.consistent() and be.consistent()
    # the caller's cluster pins to an identity nobody holds instead of an empty SAN list
    cluster = decoded(fe, TypeUrl.CLUSTER, "out|backend")
    ctx = cluster["transportSocket"]["typedConfig"]["commonTlsContext"]
    sans = ctx["combinedValidationContext"]["defaultValidationContext"]
    assert sans["matchTypedSubjectAltNames"][0]["matcher"]["exact"].endswith("/-/none")
    assert fe.version(TypeUrl.LISTENER) == fe_before.version(TypeUrl.LISTENER)


def test_identical_resources_are_packed_once_and_shared() -> None:
    packer = Packer()
    state = many_callers(50)
    snaps = build_snapshots(state, [allow("backend", f"client-{i}") for i in range(3)], TRUST,
                            packer=packer)  # fmt: skip
    clients = [snaps[f"client-{i}"] for i in range(50)]
    first = clients[0]
    for snap in clients[1:]:
        assert snap.get(TypeUrl.SECRET)[MESH_TRUST] is first.get(TypeUrl.SECRET)[MESH_TRUST]
        assert (
            snap.get(TypeUrl.ENDPOINT)["out|backend"] is first.get(TypeUrl.ENDPOINT)["out|backend"]
        )
        assert snap.get(TypeUrl.CLUSTER)["out|backend"] is first.get(TypeUrl.CLUSTER)["out|backend"]
    packed = packer.packed
    # per node only its listeners and app cluster are its own: 52 nodes, 2 replicas
    assert packed < 52 * 3
    # revoking the policy turns the backends' RBAC into the deny-all table the clients already
    # share: nothing new is serialized
    again = build_snapshots(state, [], TRUST, packer=packer)
    assert packer.packed == packed
    assert again["backend-0"].version(TypeUrl.ROUTE) == snaps["client-0"].version(TypeUrl.ROUTE)
