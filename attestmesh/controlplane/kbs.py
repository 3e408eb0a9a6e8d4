"""The KBS resource protocol served from the SecretPolicies and OpenBao (``certs.kbs`` for the
protocol): confidential containers fetch image decryption keys during the pull, inside the TEE,
so the node never sees them.

Attestation: the evidence must verify (the control plane's verifiers), bind the session's nonce
and ``tee-pubkey`` (``kbs_report_data``), and be admitted by the attestation policy governing
the workload it names; a quarantined workload cannot attest. A resource is released when the
session is attested, its workload is (still) not quarantined, some secret of a SecretPolicy is
served at that ``repository/type/tag`` and a rule of it releases the secret to the workload
(SPIFFE ID / service account, and ``whenClaims`` against the claims this evidence showed). The
OpenBao KV entry's ``value`` is the resource (an entry without ``value``: its canonical JSON),
encrypted to ``tee-pubkey`` (JWE, ``certs.sealing.jwe_encrypt``). Decisions are taken again
after the OpenBao read; releases and refusals are audit events and metrics (operation ``kbs``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from aiohttp import web

from attestmesh.controlplane.secrets import Limiter, SecretBackend, SecretPolicies
from certs.errors import AttestmeshError
from certs.evidence.claims import Tee, Verifier
from certs.kbs import (
    COOKIE,
    SESSION_TTL,
    Attested,
    KbsError,
    KbsSessions,
    check_binding,
    parse_attestation,
    parse_request,
    tee_key,
)
from certs.openbao import OpenBaoError
from certs.policy import AttestationPolicy, Rejected, appraise_all, policies_for
from certs.sealing import canonical_json, jwe_encrypt
from xds.secretpolicy import (
    Facts,
    KvSource,
    Operation,
    SecretRefused,
    authorize,
    kbs_resource,
)
from xds.state import Event, EventKind, MeshState, Status, WorkloadState

log = logging.getLogger(__name__)
MAX_BODY = 256 * 1024
ERRORS = "https://github.com/confidential-containers/kbs/errors/"
_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
Audit = Callable[[Sequence[Event]], Awaitable[None]]
Decision = Callable[[str, str, str], None]


class KbsService:
    def __init__(
        self,
        *,
        state: Callable[[], MeshState],
        verifiers: Callable[[], Mapping[Tee, Verifier]],
        attestation_policies: Callable[[], Sequence[AttestationPolicy]],
        secret_policies: SecretPolicies,
        backend: SecretBackend,
        audit: Audit,
        on_decision: Decision,
        clock: Callable[[], datetime],
        random_bytes: Callable[[int], bytes],
        limiter: Limiter | None = None,
    ) -> None:
        self._limiter = limiter
        self._state = state
        self._verifiers = verifiers
        self._attestation_policies = attestation_policies
        self._policies = secret_policies
        self._backend = backend
        self._audit = audit
        self._on_decision = on_decision
        self._clock = clock
        self.sessions = KbsSessions(clock=clock, random_bytes=random_bytes)

    def auth(self, body: Any) -> tuple[str, dict[str, str]]:
        tee = parse_request(body, frozenset(self._verifiers()))
        sid, session = self.sessions.challenge(tee)
        return sid, {"nonce": session.nonce, "extra-params": ""}

    def _workload(self, name: str) -> WorkloadState:
        state = self._state()
        w = state.workloads.get(name)
        if w is None:
            raise KbsError("attestation_refused", "the evidence is not admitted", 401)
        if w.status is Status.QUARANTINED:
            raise KbsError("quarantined", f"{name} is quarantined", 403)
        return w

    def attest(self, sid: str | None, body: Any) -> None:
        try:
            self._attest(sid, body)
        except KbsError as exc:
            self._on_decision("kbs_attest", "refused", exc.reason)
            raise
        self._on_decision("kbs_attest", "attested", "ok")

    def _attest(self, sid: str | None, body: Any) -> None:
        challenge = self.sessions.open(sid)  # 401 unless unexpired and unanswered
        jwk, ev = parse_attestation(body)
        key = tee_key(jwk)
        w = self._workload(ev.workload)
        verifier = self._verifiers().get(challenge.tee)
        if verifier is None:
            raise KbsError("tee_not_supported", "this KBS does not verify that TEE", 400)
        now = self._clock()
        try:
            claims = verifier.verify(ev.evidence, now=now, collateral=ev.collateral)
        except AttestmeshError as exc:
            log.info("KBS evidence for %s refused: %s", ev.workload, exc.reason)
            raise KbsError("evidence_invalid", "the evidence does not verify", 401) from None
        check_binding(claims.report_data, challenge.nonce, jwk)
        # Evidence from a TEE, bound to this challenge: only now is anything stored (the
        # challenge is spent, whatever the policy says next), so unauthenticated requests and
        # replayed evidence leave no state behind.
        self.sessions.spend(challenge)
        reg = w.registration
        governing = policies_for(
            self._attestation_policies(), reg.namespace, reg.service_account, reg.labels
        )
        decision = appraise_all(claims, governing, now)
        if isinstance(decision, Rejected):
            raise KbsError(decision.reason, "the evidence is not admitted by policy", 401)
        self.sessions.attested(
            challenge,
            Attested(
                ev.workload,
                key,
                claims.tee.value,
                dict(claims.measurements),
                claims.tcb_status,
            ),
        )

    def _decide(self, sid: str | None, resource: str) -> tuple[Attested, Any, str]:
        att = self.sessions.session(sid)
        w = self._workload(att.workload)
        reg = w.registration
        state = self._state()
        facts = Facts(
            spiffe_id=reg.spiffe_id(state.trust_domain),
            namespace=reg.namespace,
            service_account=reg.service_account,
            tee=att.tee,
            measurements=att.measurements,
            tcb_status=att.tcb_status,
        )
        ref = kbs_resource(self._policies.current, resource)
        if ref is None:
            raise KbsError("resource_unknown", f"no resource {resource}", 404)
        try:
            granted = authorize(self._policies.current, facts, ref, Operation.READ)
        except SecretRefused as exc:
            raise KbsError(exc.reason, "not released to this workload", 403) from None
        return att, granted, facts.spiffe_id

    async def resource(self, sid: str | None, repository: str, kind: str, tag: str) -> bytes:
        """The resource, as the JWE's JSON bytes."""
        for part in (repository, kind, tag):
            if not _SEGMENT.fullmatch(part):
                raise KbsError("request_malformed", "resource path segments", 400)
        path = f"{repository}/{kind}/{tag}"
        workload = ""
        try:
            att, granted, spiffe = self._decide(sid, path)
            workload = att.workload
            if self._limiter is not None:
                try:
                    self._limiter.take(f"kbs:{workload}", self._clock())
                except AttestmeshError:
                    self._on_decision("kbs", "refused", "too_many_requests")
                    raise KbsError("too_many_requests", "too many requests", 429) from None
            source = granted.secret.source
            assert isinstance(source, KvSource)  # kbsResource exists only on kv secrets
            entry = await self._backend.kv_read(source.mount, source.path, source.version)
            again = self._decide(sid, path)  # a quarantine or policy change meanwhile wins
            if again[1] != granted or again[0] != att:
                raise KbsError("policy_changed", "the decision changed during the request", 403)
        except KbsError as exc:
            if exc.status == 429:
                raise  # counted above, never recorded
            self._on_decision("kbs", "refused", exc.reason)
            if workload or (exc.status == 403 and sid):
                await self._refused(workload or self._session_workload(sid), path, exc)
            raise
        except OpenBaoError as exc:
            self._on_decision("kbs", "error", exc.reason)
            raise KbsError("backend_unavailable", "try again later", 503) from None
        value = entry.data.get("value")
        content = value.encode() if value is not None else canonical_json(dict(entry.data))
        jwe = jwe_encrypt(att.tee_pubkey, content)
        await self._audit(
            [
                Event(
                    EventKind.SECRET_RELEASED,
                    att.workload,
                    self._clock(),
                    reason=f"kbs {granted.ref} version {entry.version} as {path} to {spiffe}",
                    code="kbs",
                )
            ]
        )
        self._on_decision("kbs", "released", "ok")
        return json.dumps(jwe).encode()

    def _session_workload(self, sid: str | None) -> str:
        try:
            return self.sessions.session(sid).workload
        except KbsError:
            return ""

    async def _refused(self, workload: str, path: str, exc: KbsError) -> None:
        if workload and workload in self._state().workloads:
            event = Event(
                EventKind.SECRET_REFUSED,
                workload,
                self._clock(),
                reason=f"kbs {path}: {exc.detail}",
                code=exc.reason,
            )
            await self._audit([event])


def _problem(exc: KbsError) -> web.Response:
    return web.json_response({"type": ERRORS + exc.reason, "detail": exc.detail}, status=exc.status)


def build_kbs_app(service: KbsService) -> web.Application:
    async def read_json(request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise KbsError("request_malformed", "body is not JSON", 400) from None

    async def auth(request: web.Request) -> web.Response:
        try:
            sid, challenge = service.auth(await read_json(request))
        except KbsError as exc:
            return _problem(exc)
        resp = web.json_response(challenge)
        resp.set_cookie(
            COOKIE, sid, secure=True, httponly=True, samesite="Strict",
            max_age=int(SESSION_TTL.total_seconds()), path="/kbs",
        )  # fmt: skip
        return resp

    async def attest(request: web.Request) -> web.Response:
        try:
            service.attest(request.cookies.get(COOKIE), await read_json(request))
        except KbsError as exc:
            return _problem(exc)
        return web.Response(status=200)

    async def resource(request: web.Request) -> web.Response:
        m = request.match_info
        try:
            body = await service.resource(
                request.cookies.get(COOKIE), m["repository"], m["type"], m["tag"]
            )
        except KbsError as exc:
            return _problem(exc)
        return web.Response(body=body, content_type="application/json")

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/kbs/v0/auth", auth)
    app.router.add_post("/kbs/v0/attest", attest)
    app.router.add_get("/kbs/v0/resource/{repository}/{type}/{tag}", resource)
    return app


__all__ = ["KbsService", "build_kbs_app"]
