"""Identity is per pod (issue 8 item 3): a request is bound to the pod by its projected
service-account token (TokenReview ``user.extra`` pod-name / pod-uid), not to the service
account every replica shares.

The attacks run through the real Kubernetes-mode control plane (HTTPS attestation API, TokenReview
against the fake API server, quarantine actions) the way ``test_kube_mode`` does: a sibling pod
of the same service account, holding its own valid token, tries to attest, fail and renew in
web-0's name; a quarantined pod tries to obtain a certificate by naming its sibling."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from sidecar.agent import SimEvidenceSource, build_csr, client_ssl_context
from tests.component.test_kube_mode import (
    BAD,
    GOOD,
    PLATFORM,
    WEB_TOKEN,
    WEBHOOKS,
    WORKLOAD,
    Plane,
    control_plane,
    pod_obj,
    policy_cr,
    seed,
)
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS
from xds.kube import (
    EXTRA_POD_NAME,
    EXTRA_POD_UID,
    LABEL_QUARANTINED,
    ReviewedToken,
    TokenReviewError,
    check_pod_binding,
    parse_token_review,
    registration_from_pod,
)
from xds.state import Endpoint, Registration, Status, WorkloadState
from xds.store import workload_from_doc, workload_to_doc

SIBLING = "shop/web-1"
SIBLING_TOKEN = "tok-web-1"  # web-1's own projected token: valid, same service account
LEGACY_TOKEN = "tok-legacy"  # a valid token of the service account bound to no pod
FOREIGN_PLATFORM = ec.generate_private_key(ec.SECP256R1())  # a platform the policy never trusts
T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)

# --- pure: the TokenReview answer and the binding ------------------------------------------------


def review(user: dict[str, Any], audiences: list[str] | None = None, **status: Any) -> Any:
    return {
        "kind": "TokenReview",
        "status": {
            "authenticated": True,
            "user": user,
            "audiences": ["attestmesh"] if audiences is None else audiences,
            **status,
        },
    }


def sa_user(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    user: dict[str, Any] = {"username": "system:serviceaccount:shop:web", "uid": "sa-1"}
    if extra is not None:
        user["extra"] = extra
    return user


BOUND = {EXTRA_POD_NAME: ["web-0"], EXTRA_POD_UID: ["uid-0"]}


def test_parse_token_review_reads_the_pod_claims() -> None:
    assert parse_token_review(review(sa_user(BOUND)), "attestmesh") == ReviewedToken(
        "shop", "web", "web-0", "uid-0"
    )
    # a legacy secret-based token: the service account only
    assert parse_token_review(review(sa_user()), "attestmesh") == ReviewedToken("shop", "web")
    # other extra keys (newer servers add credential-id, node-name) are ignored
    more = {**BOUND, "authentication.kubernetes.io/credential-id": ["JTI=x"]}
    assert parse_token_review(review(sa_user(more)), "attestmesh").pod_uid == "uid-0"


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ({"status": {"authenticated": False, "error": "expired"}}, "token_invalid"),
        ("not a review", "token_invalid"),
        # the server must confirm the audience it was asked about
        (review(sa_user(BOUND), audiences=[]), "token_audience"),
        (review(sa_user(BOUND), audiences=["https://kubernetes.default.svc"]), "token_audience"),
        ({"status": {"authenticated": True, "user": sa_user(BOUND)}}, "token_audience"),
        (review({"username": "alice", "extra": BOUND}), "token_not_service_account"),
        (review(sa_user({EXTRA_POD_NAME: ["web-0", "web-1"]})), "token_review_malformed"),
        (review(sa_user({EXTRA_POD_UID: "uid-0"})), "token_review_malformed"),
        (review(sa_user({EXTRA_POD_UID: [""]})), "token_review_malformed"),
        (review(sa_user(["not", "a", "map"])), "token_review_malformed"),  # type: ignore[arg-type]
    ],
)
def test_parse_token_review_refuses(answer: Any, reason: str) -> None:
    with pytest.raises(TokenReviewError) as exc:
        parse_token_review(answer, "attestmesh")
    assert exc.value.reason == reason


REG = Registration(
    "shop/web-0", "shop", "web", "web", Endpoint("10.1.0.5", 15006), 8080, pod_uid="uid-0"
)


@pytest.mark.parametrize(
    ("token", "reg", "reason", "detail"),
    [
        (ReviewedToken("shop", "other", "web-0", "uid-0"), REG, "token_service_account_mismatch",
         "token of shop/other presented for shop/web-0"),
        (ReviewedToken("pay", "web", "web-0", "uid-0"), REG, "token_service_account_mismatch",
         "token of pay/web presented for shop/web-0"),
        (ReviewedToken("shop", "web"), REG, "token_not_pod_bound", EXTRA_POD_NAME),
        (ReviewedToken("shop", "web", "web-0"), REG, "token_not_pod_bound", EXTRA_POD_UID),
        (ReviewedToken("shop", "web", "web-1", "uid-1"), REG, "token_pod_mismatch",
         "token bound to pod shop/web-1 presented for shop/web-0"),
        # the API server vouches for a pod named web-0, but not the one registered (recreated,
        # and this replica has not seen it yet)
        (ReviewedToken("shop", "web", "web-0", "uid-old"), REG, "token_pod_uid_mismatch",
         "token bound to pod uid uid-old presented for shop/web-0"),
        (ReviewedToken("shop", "web", "web-0", "uid-0"), Registration(
            "shop/web-0", "shop", "web", "web", Endpoint("10.1.0.5", 1), 2),
         "registration_without_pod_uid", "shop/web-0"),
        (ReviewedToken("shop", "web", "web-0", "uid-0"), Registration(
            "web-0", "shop", "web", "web", Endpoint("10.1.0.5", 1), 2, pod_uid="uid-0"),
         "registration_not_a_pod", "web-0"),
    ],
)  # fmt: skip
def test_check_pod_binding_names_the_claim_that_fails(
    token: ReviewedToken, reg: Registration, reason: str, detail: str
) -> None:
    with pytest.raises(TokenReviewError) as exc:
        check_pod_binding(token, reg)
    assert exc.value.reason == reason
    assert detail in exc.value.detail
    assert "uid-0" not in exc.value.detail  # the registered pod's uid is not disclosed


def test_check_pod_binding_accepts_the_pods_own_token() -> None:
    check_pod_binding(ReviewedToken("shop", "web", "web-0", "uid-0"), REG)


def test_registration_carries_the_pod_uid_and_the_store_keeps_it() -> None:
    obj = pod_obj()
    obj["metadata"]["uid"] = "3f1c-uid"
    reg = registration_from_pod(obj)
    assert reg is not None and reg.pod_uid == "3f1c-uid"
    del obj["metadata"]["uid"]
    assert (registration_from_pod(obj) or reg).pod_uid is None
    doc = workload_to_doc(WorkloadState(reg))
    assert doc["registration"]["pod_uid"] == "3f1c-uid"
    assert workload_from_doc(doc).registration == reg
    del doc["registration"]["pod_uid"]  # a document written before pod binding
    assert workload_from_doc(doc).registration.pod_uid is None


# --- the fake API server answers as the real one ----------------------------------------------


REAL = json.loads((Path(__file__).parents[1] / "fakekube" / "tokenreview_1.20.2.json").read_text())


def normalized(answers: dict[str, Any]) -> dict[str, Any]:
    """Answers with the uids (pods', the service account's) replaced by what they stand for."""
    text = json.dumps(answers, sort_keys=True)
    sa_uid = answers["bound"]["user"]["uid"]
    for uid, name in ((answers["pod_uid"], "<pod>"), (answers["new_pod_uid"], "<new pod>"),
                      (sa_uid, "<service account>")):  # fmt: skip
        text = text.replace(uid, name)
    return dict(json.loads(text))


async def test_fake_token_review_answers_as_kube_apiserver_1_20_does() -> None:
    """The scenario ``tests/fakekube/record_tokenreview.py`` ran against a real kube-apiserver
    1.20.2 (``tokenreview_1.20.2.json``), replayed on the fake: the same answers, byte for byte
    up to uids. Including the real server's 10 s success cache, during which a deleted pod's
    token is still vouched for."""
    clock = [T0]
    async with FakeKube(now=lambda: clock[0]) as kube:
        await kube.put_object("namespaces", {"metadata": {"name": "shop"}})
        await kube.put_object("pods", pod_obj())
        pod_uid = uid_of(kube, "web-0")
        kube.add_token("bound", "shop", "web", pod="web-0")
        kube.add_token("unbound", "shop", "web")
        kube.add_token("vault", "shop", "web", audiences=["vault"], pod="web-0")

        def review(token: str) -> Any:
            body = {"kind": "TokenReview", "spec": {"token": token, "audiences": ["attestmesh"]}}
            return kube._token_review(body)["status"]

        fake: dict[str, Any] = {"server": REAL["server"], "pod_uid": pod_uid}
        fake |= {"bound": review("bound"), "unbound": review("unbound")}
        fake["other_audience"] = review("vault")
        await kube.delete_object("pods", "shop", "web-0")
        fake["pod_gone_cached"] = review("bound")
        clock[0] += timedelta(seconds=11)
        fake["pod_gone"] = review("bound")
        await kube.put_object("pods", pod_obj())
        fake["new_pod_uid"] = uid_of(kube, "web-0")
        fake["pod_recreated"] = review("bound")
    assert REAL["server"] == "v1.20.2"
    assert normalized(fake) == normalized(REAL)
    # and what attestmesh makes of them
    assert parse_token_review({"status": REAL["bound"]}, "attestmesh") == ReviewedToken(
        "shop", "web", "web-0", REAL["pod_uid"]
    )
    assert parse_token_review({"status": REAL["unbound"]}, "attestmesh").pod_uid is None
    for refused in ("other_audience", "pod_gone", "pod_recreated"):
        with pytest.raises(TokenReviewError) as exc:
            parse_token_review({"status": REAL[refused]}, "attestmesh")
        assert exc.value.reason == "token_invalid"


def test_fake_binds_tokens_only_to_pods_that_exist() -> None:
    kube = FakeKube()
    with pytest.raises(ValueError, match="no pod"):
        kube.add_token("nothing", "shop", "web", pod="web-9")


# --- attacks through the real Kubernetes-mode control plane ---------------------------------------


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube(bookmark_interval=0.1, extra_resources=(WEBHOOKS, CONFIGMAPS)) as k:
        yield k


@pytest.fixture(scope="module")
def sim_key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "platform.pem"
    path.write_bytes(
        PLATFORM.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


async def seed_siblings(kube: FakeKube) -> None:
    """web-0 on node n1, web-1 on node n2: one StatefulSet, one service account."""
    await seed(kube, policy_cr("web"))
    await kube.put_object("nodes", {"metadata": {"name": "n2"}, "spec": {}})
    sibling = pod_obj("web-1", "10.1.0.6")
    sibling["spec"]["nodeName"] = "n2"
    await kube.put_object("pods", sibling)
    kube.add_token(SIBLING_TOKEN, "shop", "web", pod="web-1")
    kube.add_token(LEGACY_TOKEN, "shop", "web")


async def attempt(
    plane: Plane,
    session: aiohttp.ClientSession,
    path: str,
    workload: str,
    token: str,
    platform: ec.EllipticCurvePrivateKey = PLATFORM,
    measurement: bytes = GOOD,
) -> tuple[int, dict[str, Any]]:
    """One request on the real HTTPS API as an agent would send it: challenge, evidence bound
    to the nonce and key, then ``path`` (/v1/attest or /v1/renew) with ``token``."""
    ssl = client_ssl_context(plane.running.bundle_pem)
    async with session.post(plane.url + "/v1/challenge", json={}, ssl=ssl) as resp:
        nonce = base64.b64decode((await resp.json())["nonce"])
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    evidence = SimEvidenceSource(platform, measurement).collect(
        expected_report_data(nonce, spki), nonce=nonce, spki=spki
    )
    body = {
        "workload": workload,
        "tee": evidence.tee,
        "evidence": base64.b64encode(evidence.evidence).decode(),
        "csr": build_csr(key).decode(),
        "nonce": base64.b64encode(nonce).decode(),
    }
    headers = {"Authorization": f"Bearer {token}"}
    async with session.post(plane.url + path, json=body, ssl=ssl, headers=headers) as resp:
        return resp.status, await resp.json()


def uid_of(kube: FakeKube, name: str) -> str:
    return str((kube.get("pods", "shop", name) or {})["metadata"]["uid"])


def rejected_attestations(plane: Plane) -> float:
    (metric,) = plane.running.metrics.attestations.collect()
    return sum(
        s.value
        for s in metric.samples
        if s.name.endswith("_total") and s.labels.get("result") == "rejected"
    )


def sample(plane: Plane, name: str, **labels: str) -> float:
    value = plane.running.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def pod_and_node_writes(kube: FakeKube, pod: str, node: str) -> list[tuple[str, str, str]]:
    return [
        r
        for r in kube.requests
        if r[0] in ("PATCH", "PUT", "POST", "DELETE")
        and (f"/pods/{pod}" in r[1] or f"/nodes/{node}" in r[1])
    ]


# Every identity refusal answers alike (no oracle for enumerating workloads); the identity
# check's own reason is logged by the control plane.
REFUSED = {"error": "identity_invalid", "detail": "unknown workload or bad credentials"}


def refusal_logged(caplog: pytest.LogCaptureFixture) -> str:
    """The detail of the last identity refusal the control plane logged."""
    prefix = f"identity refused for {WORKLOAD}: "
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]
    assert lines, "no identity refusal was logged"
    return lines[-1][len(prefix) :]


async def test_a_sibling_pod_cannot_attest_fail_or_renew_in_web0s_name(
    kube: FakeKube, tmp_path: Path, sim_key: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await seed_siblings(kube)
    async with (
        control_plane(kube, tmp_path / "state", sim_key) as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp
        assert cp.state.get(WORKLOAD).registration.pod_uid == uid_of(kube, "web-0")
        status, body = await attempt(plane, session, "/v1/attest", WORKLOAD, WEB_TOKEN)
        assert status == 200, body
        await plane.mode.drained()
        serials = [c.serial for c in cp.state.get(WORKLOAD).certificates]
        issued = sample(plane, "attestmesh_certificates_issued_total")
        before = pod_and_node_writes(kube, "web-0", "n1")
        events_before = kube.list("events", "shop")

        # web-1 holds a valid token of the same service account. In web-0's name it tries a good
        # attestation, a renewal, a tampered measurement (would quarantine web-0) and evidence
        # from a platform nobody trusts (would quarantine web-0 and taint its node, n1).
        tries = [
            ("/v1/attest", PLATFORM, GOOD),
            ("/v1/renew", PLATFORM, GOOD),
            ("/v1/attest", PLATFORM, BAD),
            ("/v1/renew", PLATFORM, BAD),
            ("/v1/attest", FOREIGN_PLATFORM, GOOD),
            ("/v1/renew", FOREIGN_PLATFORM, GOOD),
        ]
        for path, platform, measurement in tries:
            status, body = await attempt(
                plane, session, path, WORKLOAD, SIBLING_TOKEN, platform, measurement
            )
            assert (status, body) == (401, REFUSED), (path, body)
            assert refusal_logged(caplog).startswith(
                "token_pod_mismatch: token bound to pod shop/web-1 presented for shop/web-0"
            )
        # the service account's legacy (pod-less) token is no better
        for path in ("/v1/attest", "/v1/renew"):
            status, body = await attempt(
                plane, session, path, WORKLOAD, LEGACY_TOKEN, measurement=BAD
            )
            assert (status, body) == (401, REFUSED), body
            detail = refusal_logged(caplog)
            assert detail.startswith("token_not_pod_bound: ")
            assert "authentication.kubernetes.io/pod-name" in detail

        await plane.mode.drained()
        # nothing changed: web-0 attested with the same certificates, no new certificate, no
        # quarantine label, condition, Event, eviction or node taint; only refusals counted
        w = cp.state.get(WORKLOAD)
        assert w.status is Status.ATTESTED and [c.serial for c in w.certificates] == serials
        assert cp.state.revocations == ()
        assert sample(plane, "attestmesh_certificates_issued_total") == issued
        assert pod_and_node_writes(kube, "web-0", "n1") == before
        assert kube.list("events", "shop") == events_before
        web0 = kube.get("pods", "shop", "web-0") or {}
        assert LABEL_QUARANTINED not in web0["metadata"]["labels"]
        assert not (kube.get("nodes", "", "n1") or {})["spec"].get("taints")
        refused = sample(
            plane, "attestmesh_api_rejections_total", endpoint="attest", reason="identity_invalid"
        ) + sample(
            plane, "attestmesh_api_rejections_total", endpoint="renew", reason="identity_invalid"
        )
        assert refused == len(tries) + 2
        assert rejected_attestations(plane) == 0  # no evidence was even looked at
        # every TokenReview asked the API server about the attestmesh audience
        assert kube.token_reviews
        assert all(r["audiences"] == ["attestmesh"] for r in kube.token_reviews)

        # web-0 itself still renews with its own token; and its own tampered evidence is what
        # quarantines it (the refused payload was a real threat)
        status, body = await attempt(plane, session, "/v1/renew", WORKLOAD, WEB_TOKEN)
        assert status == 200, body
        status, body = await attempt(
            plane, session, "/v1/renew", WORKLOAD, WEB_TOKEN, measurement=BAD
        )
        assert status == 403, body
        assert cp.status_of(WORKLOAD) is Status.QUARANTINED
        assert cp.status_of(SIBLING) is Status.PENDING  # the sibling gained nothing either


async def test_a_quarantined_pod_cannot_get_a_certificate_by_naming_its_sibling(
    kube: FakeKube, tmp_path: Path, sim_key: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await seed_siblings(kube)
    async with (
        control_plane(kube, tmp_path / "state", sim_key) as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp
        for name, token in ((WORKLOAD, WEB_TOKEN), (SIBLING, SIBLING_TOKEN)):
            status, body = await attempt(plane, session, "/v1/attest", name, token)
            assert status == 200, body
        # web-1 runs a tampered image: its own evidence quarantines it
        status, body = await attempt(
            plane, session, "/v1/renew", SIBLING, SIBLING_TOKEN, measurement=BAD
        )
        assert status == 403, body
        assert cp.status_of(SIBLING) is Status.QUARANTINED
        await plane.mode.drained()
        assert (kube.get("pods", "shop", "web-1") or {})["metadata"]["labels"][
            LABEL_QUARANTINED
        ] == "true"
        issued = sample(plane, "attestmesh_certificates_issued_total")
        web0 = cp.state.get(WORKLOAD)

        # it asks for a certificate in its healthy sibling's name, with good evidence
        for path in ("/v1/attest", "/v1/renew"):
            status, body = await attempt(plane, session, path, WORKLOAD, SIBLING_TOKEN)
            assert (status, body) == (401, REFUSED), body
            assert refusal_logged(caplog).startswith(
                "token_pod_mismatch: token bound to pod shop/web-1"
            )
        # and in its own name it is quarantined
        status, body = await attempt(plane, session, "/v1/attest", SIBLING, SIBLING_TOKEN)
        assert (status, body["error"]) == (403, "quarantined"), body
        assert sample(plane, "attestmesh_certificates_issued_total") == issued
        assert cp.state.get(WORKLOAD) == web0  # web-0 untouched: no certificate added for it
        assert cp.status_of(SIBLING) is Status.QUARANTINED


async def test_a_recreated_pod_is_a_new_workload_and_the_old_pods_token_is_refused(
    kube: FakeKube, tmp_path: Path, sim_key: Path, caplog: pytest.LogCaptureFixture
) -> None:
    await seed_siblings(kube)
    kube.token_cache_ttl = timedelta(minutes=10)  # however slow this test runs
    async with (
        control_plane(kube, tmp_path / "state", sim_key) as plane,
        aiohttp.ClientSession() as session,
    ):
        status, body = await attempt(plane, session, "/v1/attest", WORKLOAD, WEB_TOKEN)
        assert status == 200, body
    old_uid = uid_of(kube, "web-0")

    # while the control plane is down, the StatefulSet replaces web-0 (same name, new uid)
    await kube.delete_object("pods", "shop", "web-0")
    await kube.put_object("pods", pod_obj("web-0", "10.1.0.7"))
    assert uid_of(kube, "web-0") != old_uid
    kube.add_token("tok-web-0-new", "shop", "web", pod="web-0")
    async with (
        control_plane(kube, tmp_path / "state", sim_key) as plane,
        aiohttp.ClientSession() as session,
    ):
        cp = plane.running.cp
        w = cp.state.get(WORKLOAD)
        # the previous pod's standing is not the new pod's: registered afresh, not attested
        assert w.registration.pod_uid == uid_of(kube, "web-0")
        assert (w.status, w.attestation, w.certificates) == (Status.PENDING, None, ())
        # the previous pod's token, while the API server's success cache still vouches for
        # it: the uid it is bound to is not the registered pod's
        status, body = await attempt(plane, session, "/v1/attest", WORKLOAD, WEB_TOKEN)
        assert (status, body) == (401, REFUSED), body
        assert refusal_logged(caplog) == (
            f"token_pod_uid_mismatch: token bound to pod uid {old_uid} presented for "
            "shop/web-0, a different pod of that name"
        )
        # once the cache has expired, the API server refuses it itself
        kube.expire_token_cache()
        status, body = await attempt(plane, session, "/v1/attest", WORKLOAD, WEB_TOKEN)
        assert (status, body) == (401, REFUSED), body
        assert refusal_logged(caplog) == (
            f"token_invalid: [invalid bearer token, Pod UID ({uid_of(kube, 'web-0')}) does not "
            f"match claim ({old_uid})]"
        )
        # the new pod's own token
        status, body = await attempt(plane, session, "/v1/attest", WORKLOAD, "tok-web-0-new")
        assert status == 200, body
        assert cp.status_of(WORKLOAD) is Status.ATTESTED
