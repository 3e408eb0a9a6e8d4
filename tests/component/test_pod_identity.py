"""Identity is per pod (issue 8 item 3): a request is bound to the pod by its projected
service-account token (TokenReview ``user.extra`` pod-name / pod-uid), not to the service
account every replica shares.

Here: the pure parts, and the fake API server's TokenReview checked against what a real
kube-apiserver 1.20.2 answered (the fake still serves the few control-plane tests that need a
fault or an API 1.20 lacks, and those attest through it). The attacks run through the
Kubernetes-mode control plane against the real server: tests/kube_real/test_pod_identity.py (a
sibling pod of the same service account, holding its own valid token, tries to attest, fail and
renew in web-0's name; a quarantined pod tries to obtain a certificate by naming its sibling; a
recreated pod's old token)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.component.test_kube_mode import (
    pod_obj,
)
from tests.fakekube import FakeKube
from xds.kube import (
    EXTRA_POD_NAME,
    EXTRA_POD_UID,
    ReviewedToken,
    TokenReviewError,
    check_pod_binding,
    parse_token_review,
    registration_from_pod,
)
from xds.state import Endpoint, Registration, WorkloadState
from xds.store import workload_from_doc, workload_to_doc

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


def uid_of(kube: FakeKube, name: str) -> str:
    return str((kube.get("pods", "shop", name) or {})["metadata"]["uid"])


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
