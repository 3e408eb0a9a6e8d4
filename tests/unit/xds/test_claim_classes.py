"""``whenClaims`` holds per certificate: the claims class (``certs.ca.claims_class``), the leaf
Subject that carries it, the permissions compiled per class, their merge, and the RBAC and HCM
shape that makes Envoy check it (the real-Envoy attack is tests/integration/test_envoy_claims.py).
"""

from __future__ import annotations

import re
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st
from pydantic.warnings import PydanticDeprecatedSince212

from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, claims_class
from certs.ca.templates import build_leaf
from certs.evidence import sim
from certs.issuance import AttestRequest
from tests.unit.fixtures_core import (
    MEASUREMENT,
    MEASUREMENT_HEX,
    NOW,
    TRUST_DOMAIN,
    Clock,
    csr_pem,
    make_control_plane,
    new_key,
    record,
    registration,
    spki,
)
from xds.build import (
    BuildSettings,
    build_inbound_listener,
    build_outbound_listener,
    build_rbac,
    xfcc_subject_fragment,
)
from xds.meshpolicy import (
    ClaimsCondition,
    HttpMatch,
    MeshPolicy,
    Permission,
    Rule,
    Source,
    compile_permissions,
)
from xds.state import (
    IssuedCert,
    MeshState,
    Trigger,
    quarantine,
    record_attestation,
    register,
    spiffe_id,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.listener.v3 import Listener
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
    )

X, Y, Z = "aa" * 48, "bb" * 48, "cc" * 48
WEB = spiffe_id(TRUST_DOMAIN, "shop", "web")
API = spiffe_id(TRUST_DOMAIN, "shop", "api")
GET = HttpMatch(methods=frozenset({"GET"}))
POST = HttpMatch(methods=frozenset({"POST"}))


def cls(measurement: str, tee: str = "sim") -> str:
    return claims_class(tee, {"measurement": measurement})


# ---------------------------------------------------------------------------------------------
# the class


def test_class_is_a_canonical_digest_of_tee_and_measurements() -> None:
    a = claims_class("sim", {"measurement": X, "extra": Y})
    assert re.fullmatch(r"claims-[0-9a-f]{48}", a)
    assert claims_class("sim", {"extra": Y, "measurement": X}) == a  # order is irrelevant
    assert claims_class("sim", {"measurement": X.upper(), "extra": Y}) == a  # hex case too
    assert claims_class("sev-snp", {"measurement": X, "extra": Y}) != a
    assert claims_class("sim", {"measurement": X, "extra": Z}) != a
    assert claims_class("sim", {"measurement": X}) != a  # one measurement fewer
    assert claims_class("sim", {"measurement": X, "other": Y}) != a  # another key
    assert claims_class("sim", {}) != claims_class("sev-snp", {})


@given(
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
    st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4),
)
def test_class_separates_different_claims(a: dict[str, str], b: dict[str, str]) -> None:
    """No two claim sets share a class unless they are equal (up to value case): the encoding is
    unambiguous (no concatenation that two different sets could both produce)."""
    same = {k: v.lower() for k, v in a.items()} == {k: v.lower() for k, v in b.items()}
    assert (claims_class("sim", a) == claims_class("sim", b)) == same


def _csr() -> x509.CertificateSigningRequest:
    key = ec.generate_private_key(ec.SECP256R1())
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .sign(key, hashes.SHA256())
    )


def test_leaf_subject_names_the_class(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TRUST_DOMAIN, NOW)
    kwargs = dict(
        spiffe_id=WEB,
        claims_extension=b"\x30\x00",
        issuer=ca.intermediate,
        serial=7,
        now=NOW,
        ttl=timedelta(minutes=10),
    )
    leaf = build_leaf(_csr(), claims_class=cls(X), **kwargs)  # type: ignore[arg-type]
    # RFC 2253/4514 order (last RDN first), as Envoy prints it into x-forwarded-client-cert
    assert leaf.subject.rfc4514_string() == f"OU={cls(X)},O=attestmesh"
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(san) == [x509.UniformResourceIdentifier(WEB)]  # still exactly one URI SAN
    unclassed = build_leaf(_csr(), **kwargs)  # type: ignore[arg-type]
    assert unclassed.subject == x509.Name([])
    for bad in ("claims-xyz", cls(X) + "0", f'{cls(X)}",O=x', cls(X).upper()):
        with pytest.raises(ValueError, match="not a claims class"):
            build_leaf(_csr(), claims_class=bad, **kwargs)  # type: ignore[arg-type]


def _attest(cp: object, name: str, platform: ec.EllipticCurvePrivateKey) -> object:
    key = new_key()
    nonce, _ = cp.challenge()  # type: ignore[attr-defined]
    evidence = sim.build_report(
        platform, report_data=expected_report_data(nonce, spki(key)), measurement=MEASUREMENT
    )
    return cp.attest(AttestRequest(name, "sim", evidence, csr_pem(key), nonce), None)  # type: ignore[attr-defined]


async def test_control_plane_issues_the_class_of_the_claims_it_records(tmp_path: Path) -> None:
    """The CA side and the xDS side agree: the class in the issued leaf is the class of the
    attestation record compile_permissions reads; a renewal keeps it."""
    platform = ec.generate_private_key(ec.SECP256R1())
    plane = make_control_plane(
        tmp_path, clock=Clock(NOW), platform_key=platform, registrations=[registration()]
    )
    subjects = []
    for _ in range(2):
        issued = await _attest(plane.cp, "web-1", platform)  # type: ignore[misc]
        leaf = x509.load_pem_x509_certificates(issued.chain_pem)[0]
        subjects.append(leaf.subject.rfc4514_string())
    rec = plane.cp.state.get("web-1").attestation
    expected = claims_class(rec.tee, rec.measurements)
    assert expected == cls(MEASUREMENT_HEX)
    assert subjects == [f"OU={expected},O=attestmesh"] * 2


# ---------------------------------------------------------------------------------------------
# compiling per class


def _state(*pods: tuple[str, str, str | None], quarantined: tuple[str, ...] = ()) -> MeshState:
    """db-0 (shop/db) plus pods (name, service account, measurement or None = pending)."""
    state = MeshState(TRUST_DOMAIN)
    state, _ = register(state, registration("db-0", namespace="shop", service_account="db"), NOW)
    for i, (name, sa, measurement) in enumerate(pods):
        reg = registration(name, namespace="shop", service_account=sa, port=15100 + i)
        state, _ = register(state, reg, NOW)
        if measurement is not None:
            state, _ = record_attestation(
                state, name, record("sim", {"measurement": measurement}), IssuedCert(i, NOW), NOW,
                NOW,
            )  # fmt: skip
    for name in quarantined:
        state, _ = quarantine(state, name, Trigger.OPERATOR, "test", NOW)
    return state


def _rule(sa: str, measurements: frozenset[str] | None, to: tuple[HttpMatch, ...] = ()) -> Rule:
    claims = (
        None
        if measurements is None
        else ClaimsCondition(measurements=(("measurement", measurements),))
    )
    return Rule((Source(namespace="shop", service_account=sa),), claims, to)  # fmt: skip


def _compile(state: MeshState, *rules: Rule) -> tuple[Permission, ...]:
    return compile_permissions([MeshPolicy("p", "shop", "db", rules)], state, "db-0")


def test_sibling_with_another_measurement_gets_no_class() -> None:
    state = _state(("web-x", "web", X), ("web-y", "web", Y))
    assert _compile(state, _rule("web", frozenset({X}))) == (
        Permission(WEB, (), frozenset({cls(X)})),
    )
    # each caller whose own claims satisfy the rule contributes its class
    assert _compile(state, _rule("web", frozenset({X, Y}))) == (
        Permission(WEB, (), frozenset({cls(X), cls(Y)})),
    )
    # the same class held by two pods is one class
    two = _state(("web-x", "web", X), ("web-x2", "web", X), ("web-y", "web", Y))
    assert _compile(two, _rule("web", frozenset({X}))) == (
        Permission(WEB, (), frozenset({cls(X)})),
    )


def test_only_attested_callers_contribute_classes() -> None:
    pending = _state(("web-x", "web", None), ("web-y", "web", Y))
    assert _compile(pending, _rule("web", frozenset({X}))) == ()
    q = _state(("web-x", "web", X), ("web-y", "web", Y), quarantined=("web-x",))
    assert _compile(q, _rule("web", frozenset({X}))) == ()
    assert _compile(q, _rule("web", frozenset({X, Y}))) == (
        Permission(WEB, (), frozenset({cls(Y)})),
    )


def test_unconditional_rule_wins_over_a_claims_rule() -> None:
    state = _state(("web-x", "web", X), ("web-y", "web", Y))
    either = (_rule("web", frozenset({X})), _rule("web", None))
    assert _compile(state, *either) == (Permission(WEB),)
    assert _compile(state, *reversed(either)) == (Permission(WEB),)


def test_classes_reach_their_own_routes() -> None:
    state = _state(("web-x", "web", X), ("web-y", "web", Y), ("api-z", "api", Z))
    # unconditional GET for every web pod; the X class may also POST
    got = _compile(state, _rule("web", None, (GET,)), _rule("web", frozenset({X}), (POST,)))
    assert got == (Permission(WEB, (GET,)), Permission(WEB, (POST,), frozenset({cls(X)})))
    # a class rule adding nothing to the unconditional one is dropped
    assert _compile(state, _rule("web", None, (GET,)), _rule("web", frozenset({X}), (GET,))) == (
        Permission(WEB, (GET,)),
    )
    # an unrestricted class beside a restricted unconditional rule stays separate
    assert _compile(state, _rule("web", None, (GET,)), _rule("web", frozenset({Y}))) == (
        Permission(WEB, (GET,)),
        Permission(WEB, (), frozenset({cls(Y)})),
    )
    # classes reaching the same routes share a permission; other principals are untouched
    got = _compile(
        state,
        _rule("web", frozenset({X}), (GET,)),
        _rule("web", frozenset({Y}), (GET,)),
        _rule("web", frozenset({Y}), (POST,)),
        _rule("api", None),
    )
    assert got == (
        Permission(API),
        Permission(WEB, (GET,), frozenset({cls(X)})),
        Permission(WEB, (GET, POST), frozenset({cls(Y)})),
    )


# ---------------------------------------------------------------------------------------------
# what Envoy gets


def _xfcc(subject: str) -> str:
    """The header as Envoy 1.40 sets it (SANITIZE_SET, Subject + URI), measured in
    tests/integration/test_envoy_claims.py."""
    return (
        f'By=spiffe://{TRUST_DOMAIN}/ns/shop/sa/db;Hash={"0f" * 32};Subject="{subject}";URI={WEB}'
    )


def test_fragment_matches_only_that_subject() -> None:
    fragment = xfcc_subject_fragment(cls(X))
    assert fragment in _xfcc(f"OU={cls(X)},O=attestmesh")
    for other in (
        f"OU={cls(Y)},O=attestmesh",  # another class
        f"OU={cls(X)}0,O=attestmesh",  # a longer OU
        f"CN=x,OU={cls(X)},O=attestmesh",  # an extra RDN before
        f"OU={cls(X)},O=attestmesh,C=US",  # an extra RDN after
        f"OU={cls(X)}+CN=x,O=attestmesh",  # a multi-valued RDN
        "",  # the empty Subject of a leaf issued without a class
    ):
        assert fragment not in _xfcc(other)


def test_rbac_requires_identity_and_class() -> None:
    rules = build_rbac(
        (
            Permission(API),
            Permission(WEB, (GET,), frozenset({cls(X)})),
            Permission(WEB, (), frozenset({cls(Y), cls(Z)})),
        )
    ).to_dict()
    policies = rules["policies"]
    assert list(policies) == [f"0000|{API}", f"0001|{WEB}", f"0002|{WEB}"]
    identity = {"authenticated": {"principalName": {"exact": WEB}}}

    def header(c: str) -> dict[str, object]:
        return {
            "header": {
                "name": "x-forwarded-client-cert",
                "stringMatch": {"contains": xfcc_subject_fragment(c)},
            }
        }

    assert policies[f"0000|{API}"]["principals"] == [
        {"authenticated": {"principalName": {"exact": API}}}
    ]
    assert policies[f"0001|{WEB}"]["principals"] == [
        {"andIds": {"ids": [identity, header(cls(X))]}}
    ]
    assert policies[f"0002|{WEB}"]["principals"] == [
        {
            "andIds": {
                "ids": [
                    identity,
                    {"orIds": {"ids": [header(c) for c in sorted({cls(Y), cls(Z)})]}},
                ]
            }
        }
    ]
    assert policies[f"0001|{WEB}"]["permissions"] != [{"any": True}]  # GET only
    assert policies[f"0002|{WEB}"]["permissions"] == [{"any": True}]


def _hcm(listener: Listener) -> HttpConnectionManager:
    typed = listener.filter_chains[0].filters[0].typed_config
    assert typed is not None
    hcm = typed.unpack()
    assert isinstance(hcm, HttpConnectionManager)
    return hcm


def test_inbound_hcm_sets_xfcc_from_the_verified_certificate() -> None:
    reg = registration("db-0", namespace="shop", service_account="db")
    inbound = build_inbound_listener(reg, TRUST_DOMAIN)
    hcm = _hcm(inbound)
    assert hcm.forward_client_cert_details.name == "SANITIZE_SET"
    details = hcm.set_current_client_cert_details
    assert details is not None and details.subject and details.uri
    assert not (details.cert or details.chain or details.dns)
    # outbound (plaintext from the local app): whatever the app sends is dropped, nothing set
    out = _hcm(build_outbound_listener("db", 15500, BuildSettings()))
    assert out.forward_client_cert_details.name == "SANITIZE"
    assert out.set_current_client_cert_details is None
