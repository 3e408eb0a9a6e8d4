"""Agent identity: TokenReview of a pod's projected service-account token.

``parse_token_review`` and ``check_pod_binding`` are pure (what the API server answered ->
what the token stands for; whether that is the registration's very pod); ``TokenReviewer``
asks the API server; ``TokenReviewIdentity`` is the control plane's ``IdentityCheck``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from certs.errors import AttestmeshError
from certs.issuance import IdentityError
from xds.kube.client import KubeClient, KubeError
from xds.kube.names import EXTRA_POD_NAME, EXTRA_POD_UID, TOKEN_AUDIENCE
from xds.kube.workloads import WorkloadRef
from xds.state import Registration

log = logging.getLogger(__name__)


class TokenReviewError(AttestmeshError):
    """A workload's service-account token was not accepted."""


@dataclass(frozen=True, slots=True)
class ReviewedToken:
    """What the API server says a valid service-account token stands for. ``pod_name`` and
    ``pod_uid`` are set for a token bound to a pod (the projected token the kubelet mounts);
    a legacy secret-based token, or one requested without a pod binding, has neither."""

    namespace: str
    service_account: str
    pod_name: str | None = None
    pod_uid: str | None = None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _extra_value(extra: Mapping[str, Any], key: str) -> str | None:
    values = extra.get(key)
    if values is None:
        return None
    if not isinstance(values, list) or len(values) != 1:
        raise TokenReviewError("token_review_malformed", f"user.extra {key!r} must hold one value")
    value = values[0]
    if not isinstance(value, str) or not value:
        raise TokenReviewError("token_review_malformed", f"user.extra {key!r} is not a name")
    return value


def parse_token_review(review: Any, audience: str) -> ReviewedToken:
    """A TokenReview the API server answered -> the service account (and pod) its token stands
    for. Refused (``TokenReviewError``): not authenticated; ``audience`` not among
    ``status.audiences`` (the server must confirm the audience it was asked for); not a
    service account; a malformed pod claim."""
    status = _mapping(_mapping(review).get("status"))
    if status.get("authenticated") is not True:
        raise TokenReviewError("token_invalid", str(status.get("error", "not authenticated")))
    audiences = status.get("audiences")
    if not isinstance(audiences, list) or audience not in audiences:
        raise TokenReviewError("token_audience", f"token is not for audience {audience!r}")
    user = _mapping(status.get("user"))
    username = str(user.get("username", ""))
    parts = username.split(":")
    if len(parts) != 4 or parts[:2] != ["system", "serviceaccount"] or not all(parts[2:]):
        raise TokenReviewError("token_not_service_account", f"user {username!r}")
    extra = user.get("extra") or {}
    if not isinstance(extra, Mapping):
        raise TokenReviewError("token_review_malformed", "user.extra is not a map")
    return ReviewedToken(
        parts[2], parts[3], _extra_value(extra, EXTRA_POD_NAME), _extra_value(extra, EXTRA_POD_UID)
    )


def check_pod_binding(token: ReviewedToken, reg: Registration) -> None:
    """The token must stand for the very pod ``reg`` was derived from: its namespace, service
    account, pod name and pod uid. A token of a sibling pod (same service account) or of an
    earlier pod of the same name is not this pod's. Raises ``TokenReviewError`` naming the
    claim that is missing or differs (never the registration's uid)."""
    if (token.namespace, token.service_account) != (reg.namespace, reg.service_account):
        raise TokenReviewError(
            "token_service_account_mismatch",
            f"token of {token.namespace}/{token.service_account} presented for {reg.name} "
            f"({reg.namespace}/{reg.service_account})",
        )
    for key, value in ((EXTRA_POD_NAME, token.pod_name), (EXTRA_POD_UID, token.pod_uid)):
        if value is None:
            raise TokenReviewError(
                "token_not_pod_bound",
                f"token of {token.namespace}/{token.service_account} has no {key} claim (a "
                f"legacy or unbound token); {reg.name} needs the projected token bound to its pod",
            )
    try:
        ref = WorkloadRef.parse(reg.name)
    except ValueError:
        raise TokenReviewError("registration_not_a_pod", f"{reg.name} is not a pod") from None
    if (token.namespace, token.pod_name) != (ref.namespace, ref.pod):
        raise TokenReviewError(
            "token_pod_mismatch",
            f"token bound to pod {token.namespace}/{token.pod_name} presented for {reg.name}",
        )
    if reg.pod_uid is None:
        raise TokenReviewError("registration_without_pod_uid", f"{reg.name} has no pod uid")
    if token.pod_uid != reg.pod_uid:
        raise TokenReviewError(
            "token_pod_uid_mismatch",
            f"token bound to pod uid {token.pod_uid} presented for {reg.name}, a different pod "
            "of that name",
        )


class TokenReviewer:
    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    async def verify_token(self, token: str, audience: str = TOKEN_AUDIENCE) -> ReviewedToken:
        """A TokenReview for ``audience`` -> what a valid service-account token stands for
        (``parse_token_review``)."""
        if not token:
            raise TokenReviewError("token_missing", "no service-account token presented")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [audience]},
        }
        try:
            review = await self.kube.call(self.kube.auth.create_token_review, body)
        except KubeError as exc:
            raise TokenReviewError("token_review_failed", exc.detail) from None
        return parse_token_review(review, audience)


class TokenReviewIdentity:
    """IdentityCheck: the agent's projected service-account token, checked with TokenReview,
    must be bound to the registration's pod: namespace, service account, pod name and pod uid
    (``check_pod_binding``). A refusal is logged; the API counts it."""

    def __init__(self, reviewer: TokenReviewer, audience: str = TOKEN_AUDIENCE) -> None:
        self._reviewer = reviewer
        self._audience = audience

    async def check(self, reg: Registration, token: str | None) -> None:
        try:
            check_pod_binding(await self._reviewer.verify_token(token or "", self._audience), reg)
        except TokenReviewError as exc:
            log.warning("identity refused for %s: %s: %s", reg.name, exc.reason, exc.detail)
            raise IdentityError("identity_invalid", f"{exc.reason}: {exc.detail}") from None


__all__ = [
    "ReviewedToken",
    "TokenReviewError",
    "TokenReviewIdentity",
    "TokenReviewer",
    "check_pod_binding",
    "parse_token_review",
]
