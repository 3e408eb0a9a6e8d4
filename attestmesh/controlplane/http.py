"""The attestation API over HTTPS (aiohttp): challenge, attest, renew, trust. Thin: it
translates JSON to ``AttestRequest`` and errors to HTTP, and delegates to the control-plane
service (``Issuing``, which ``ControlPlane`` implements), typed end to end.

Who is registered is not revealed to a caller who cannot prove to be that workload: an
unknown workload and bad credentials get one answer (401 identity_invalid, one fixed detail),
and anything that depends on the workload's state (e.g. renew's 409 not_attested) is answered
only after the identity check. The metrics keep the distinct reasons (``unknown_identity``,
``identity_invalid``); the identity check's own detail goes to the debug log."""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Protocol

from aiohttp import web

from attestmesh.controlplane.issued import Issued
from certs.csr import CsrError
from certs.errors import AttestmeshError, CollateralError
from certs.issuance import AttestRequest, EvidenceRejected, IdentityError
from certs.nonces import NonceError
from certs.standing import QuarantinedError, Status, UnknownWorkloadError

log = logging.getLogger(__name__)
MAX_BODY = 1 << 20
MAX_COLLATERAL_ITEMS = 16
IDENTITY_REFUSED = "unknown workload or bad credentials"


class Issuing(Protocol):
    """What the API needs from the control-plane service."""

    def challenge(self) -> tuple[bytes, datetime]:
        """A fresh nonce and its expiry."""
        ...

    async def attest(self, req: AttestRequest, token: str | None) -> Issued: ...

    async def authenticate(self, workload: str, token: str | None) -> Status: ...

    def status_of(self, workload: str) -> Status: ...

    def trust_json(self) -> dict[str, str]: ...

    def withdraw(self, issued: Issued) -> bool: ...


class ApiMetrics(Protocol):
    """What the API counts (the composition root's metrics provide it)."""

    def api_rejected(self, endpoint: str, reason: str) -> None: ...


class RequestError(AttestmeshError):
    """The request itself is malformed."""


def _http_status(exc: AttestmeshError) -> int:
    if exc.reason in ("nonce_capacity", "store_unavailable", "attest_worker_failed"):
        return 503  # the control plane cannot take it now: retry shortly
    if exc.reason == "too_many_attestations":
        return 429  # this workload's attestation budget (after its identity was checked)
    if isinstance(exc, RequestError | CsrError | NonceError):
        return 400
    if isinstance(exc, IdentityError | UnknownWorkloadError):
        return 401
    if isinstance(exc, EvidenceRejected | QuarantinedError):
        return 403
    if isinstance(exc, CollateralError):
        return 503  # a vendor collateral service is unavailable: retry later
    if exc.reason in ("not_attested", "certificate_revoked"):
        return 409
    return 400


def public_error(exc: AttestmeshError) -> tuple[int, dict[str, str]]:
    """The status and body a refused caller gets. An unknown workload and bad credentials
    answer alike, so names cannot be enumerated."""
    if isinstance(exc, IdentityError | UnknownWorkloadError):
        return 401, {"error": "identity_invalid", "detail": IDENTITY_REFUSED}
    return _http_status(exc), {"error": exc.reason, "detail": exc.detail}


def _b64(body: Mapping[str, object], key: str, *, required: bool = True) -> bytes:
    value = body.get(key)
    if value is None and not required:
        return b""
    if not isinstance(value, str):
        raise RequestError("request_malformed", f"{key} must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("request_malformed", f"{key} is not valid base64") from None


def _text(body: Mapping[str, object], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise RequestError("request_malformed", f"{key} must be a non-empty string")
    return value


def parse_attest_body(body: object) -> AttestRequest:
    if not isinstance(body, dict):
        raise RequestError("request_malformed", "body must be a JSON object")
    workload, tee, csr = _text(body, "workload"), _text(body, "tee"), _text(body, "csr")
    collateral_raw = body.get("collateral", {})
    if not isinstance(collateral_raw, dict) or len(collateral_raw) > MAX_COLLATERAL_ITEMS:
        raise RequestError("request_malformed", "collateral must map names to base64 strings")
    collateral = {str(k): _b64(collateral_raw, k) for k in collateral_raw}
    try:
        csr_pem = csr.encode("ascii")
    except UnicodeEncodeError:
        raise RequestError("request_malformed", "csr must be PEM (ASCII)") from None
    return AttestRequest(
        workload=workload,
        tee=tee,
        evidence=_b64(body, "evidence"),
        csr_pem=csr_pem,
        nonce=_b64(body, "nonce"),
        collateral=collateral,
    )


def issued_json(issued: Issued) -> dict[str, str]:
    """The certificate answer; with ``next_nonce`` (and its ``next_nonce_expires_at``): the
    nonce for this workload's next attestation, so it need not ask for a challenge."""
    body = {
        "certificate_chain": issued.chain_pem.decode(),
        "trust_bundle": issued.bundle_pem.decode(),
        "serial": str(issued.serial),
        "spiffe_id": issued.spiffe_id,
        "not_after": issued.not_after.isoformat(),
        "renew_after": issued.renew_after.isoformat(),
        "reattest_by": issued.reattest_by.isoformat(),
    }
    if issued.next_nonce and issued.next_nonce_expires is not None:
        body["next_nonce"] = base64.b64encode(issued.next_nonce).decode()
        body["next_nonce_expires_at"] = issued.next_nonce_expires.isoformat()
    return body


def build_app(cp: Issuing, metrics: ApiMetrics) -> web.Application:
    def guarded(
        endpoint: str, handler: Callable[[web.Request], Awaitable[web.Response]]
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def wrapper(request: web.Request) -> web.Response:
            try:
                return await handler(request)
            except AttestmeshError as exc:
                metrics.api_rejected(endpoint, exc.reason)
                status, body = public_error(exc)
                if body["error"] != exc.reason or body["detail"] != exc.detail:
                    log.debug("%s refused: %s: %s", endpoint, exc.reason, exc.detail)
                return web.json_response(body, status=status)

        return wrapper

    async def read_json(request: web.Request) -> object:
        try:
            return await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError):
            raise RequestError("request_malformed", "body is not JSON") from None
        except RecursionError:  # e.g. 200,000 nested arrays: the decoder's depth limit
            raise RequestError("request_malformed", "body is nested too deeply") from None

    async def challenge(request: web.Request) -> web.Response:
        nonce, expires = cp.challenge()
        return web.json_response(
            {"nonce": base64.b64encode(nonce).decode(), "expires_at": expires.isoformat()}
        )

    def token_of(request: web.Request) -> str | None:
        auth = request.headers.get("Authorization", "")
        return auth[7:] if auth.startswith("Bearer ") else None

    def deliver(request: web.Request, issued: Issued) -> web.Response:
        """Answer with the certificate, unless the client is gone: then nobody holds its key,
        and the control plane takes the issuance back (the agent retries)."""
        transport = request.transport
        if transport is None or transport.is_closing():
            cp.withdraw(issued)
            raise web.HTTPServiceUnavailable(text="client went away")
        return web.json_response(issued_json(issued))

    async def attest(request: web.Request) -> web.Response:
        req = parse_attest_body(await read_json(request))
        return deliver(request, await cp.attest(req, token_of(request)))

    async def renew(request: web.Request) -> web.Response:
        req = parse_attest_body(await read_json(request))
        token = token_of(request)
        # "not attested" is told only to the workload itself: the identity check comes first
        # (cp.attest checks it for the others; an unknown name raises here, answered alike)
        if (
            cp.status_of(req.workload) is Status.PENDING
            and await cp.authenticate(req.workload, token) is Status.PENDING
        ):
            raise AttestmeshError("not_attested", "renewal needs an attested workload; attest")
        return deliver(request, await cp.attest(req, token))

    async def trust(request: web.Request) -> web.Response:
        return web.json_response(cp.trust_json())

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/challenge", guarded("challenge", challenge))
    app.router.add_post("/v1/attest", guarded("attest", attest))
    app.router.add_post("/v1/renew", guarded("renew", renew))
    app.router.add_get("/v1/trust", guarded("trust", trust))
    return app
