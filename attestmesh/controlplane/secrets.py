"""Secret release to attested workloads: the service and its HTTPS (mutual TLS) adapter.

A workload's agent asks with its attested mesh certificate (the TLS client certificate, chained
to the mesh CA). For every request the service, in this order:

1. finds who asks (``xds.secretpolicy.live_holder``): the named workload must be attested, not
   quarantined, and the presented certificate must be its newest live one (not revoked,
   superseded or withdrawn); the claims on record for that certificate are the facts;
2. authorizes against the SecretPolicies in force *now* (``authorize``);
3. reads the secret from the backend (OpenBao KV v2 / transit) with the control plane's own
   credential;
4. checks 1 and 2 again (the read awaited: a quarantine or a policy change in between wins);
5. records the audit event durably (no audit, no release), then answers with the secret sealed
   (``certs.sealing.seal``) to the public key of the certificate the caller presented, the key
   its evidence bound and whose private half stays in its TEE.

The agent says which version it holds (``have_version``): an unchanged KV entry is answered
``unchanged`` without sealing anything, so polling for rotation costs no release event.

Refusals carry bounded reason codes. ``unknown_secret``, ``not_allowed`` and
``claims_not_allowed`` answer alike (``not_allowed``), so policy contents cannot be probed.
Nothing here logs or returns a secret's value except inside the sealed envelope.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import AttestmeshError
from certs.openbao import KvSecret, OpenBaoError, transit_version
from certs.sealing import ReleaseContext, canonical_json, seal
from xds.secretpolicy import (
    Facts,
    Granted,
    KvSource,
    Operation,
    SecretPolicy,
    SecretRefused,
    TransitSource,
    authorize,
    facts_of,
    live_holder,
    parse_secret_policies,
    secret_ref,
)
from xds.state import Event, EventKind, MeshState

log = logging.getLogger(__name__)
MAX_BODY = 256 * 1024
MAX_TRANSIT_PLAINTEXT = 64 * 1024
# Refusals the caller sees as one: it may not learn which secrets exist or what a rule needs.
_HIDDEN = frozenset({"unknown_secret", "not_allowed", "claims_not_allowed"})
# Backend failures: retry later; the metric keeps the precise reason.
_BACKEND = frozenset(
    {"bao_unreachable", "bao_denied", "bao_error", "bao_malformed", "bao_credential"}
)


class SecretBackend(Protocol):
    async def kv_read(self, mount: str, path: str, version: int | None = None) -> KvSecret: ...

    async def transit_encrypt(self, mount: str, key: str, plaintext: bytes) -> str: ...

    async def transit_decrypt(self, mount: str, key: str, ciphertext: str) -> tuple[bytes, int]: ...


@dataclass(frozen=True, slots=True)
class PeerCertificate:
    """The TLS client certificate, as the decision needs it."""

    uris: tuple[str, ...]
    serial: int
    public_key: ec.EllipticCurvePublicKey


def parse_peer(der: bytes | None) -> PeerCertificate:
    if not der:
        raise SecretRefused("no_client_certificate", "present the workload's mesh certificate")
    try:
        cert = x509.load_der_x509_certificate(der)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = tuple(san.get_values_for_type(x509.UniformResourceIdentifier))
    except (ValueError, x509.ExtensionNotFound):
        raise SecretRefused("identity_mismatch", "the certificate names no SPIFFE ID") from None
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SecretRefused("identity_mismatch", "a mesh certificate has a P-256 key")
    return PeerCertificate(uris, cert.serial_number, key)


class SecretPolicies:
    """The SecretPolicies in force; replaced whole (a bad document set changes nothing)."""

    def __init__(self, policies: Sequence[SecretPolicy] = ()) -> None:
        self._policies = tuple(policies)

    @property
    def current(self) -> tuple[SecretPolicy, ...]:
        return self._policies

    def set_docs(self, docs: Sequence[object]) -> tuple[SecretPolicy, ...]:
        self._policies = parse_secret_policies(docs)  # PolicyError leaves the old ones
        return self._policies

    def set_policies(self, policies: Sequence[SecretPolicy]) -> tuple[SecretPolicy, ...]:
        """Policies parsed one by one (SecretPolicy resources): the cross-policy rules apply
        here. In (namespace, name) order, a policy naming a secret or a KBS resource another
        one kept already is left out, logged (its own Accepted condition cannot say it)."""
        kept: list[SecretPolicy] = []
        refs: set[str] = set()
        resources: set[str] = set()
        for p in sorted(policies, key=lambda p: (p.namespace, p.name)):
            mine = {f"{p.namespace}/{n}" for n in p.secrets}
            kbs = {s.kbs_resource for s in p.secrets.values() if s.kbs_resource is not None}
            if mine & refs or kbs & resources:
                log.error(
                    "SecretPolicy %s/%s left out: it names a secret or KBS resource that "
                    "another policy defines (%s)",
                    p.namespace,
                    p.name,
                    sorted((mine & refs) | (kbs & resources)),
                )
                continue
            refs |= mine
            resources |= kbs
            kept.append(p)
        self._policies = tuple(kept)
        return self._policies


@dataclass(frozen=True, slots=True)
class Released:
    """The outcome of a granted request. ``envelope``: the sealed secret (None for wrap, and
    when the caller holds this version already: ``unchanged``)."""

    ref: str
    version: int
    envelope: dict[str, Any] | None = None
    ciphertext: str | None = None  # wrap
    unchanged: bool = False


Decision = Callable[[str, str, str], None]  # (operation, result, reason): a metric
Audit = Callable[[Sequence[Event]], Awaitable[None]]  # durable before the answer
Run = Callable[[Granted, Facts], Awaitable[tuple[Released, str]]]


class Limiter(Protocol):
    """A per-workload request budget: ``take`` raises AttestmeshError when it is spent."""

    def take(self, name: str, now: datetime) -> None: ...


class SecretService:
    def __init__(
        self,
        *,
        state: Callable[[], MeshState],
        policies: SecretPolicies,
        backend: SecretBackend,
        audit: Audit,
        on_decision: Decision,
        clock: Callable[[], datetime],
        limiter: Limiter | None = None,
    ) -> None:
        self._limiter = limiter
        self._state = state
        self._policies = policies
        self._backend = backend
        self._audit = audit
        self._on_decision = on_decision
        self._clock = clock

    def _decide(
        self, peer: PeerCertificate, workload: str, spelled: str, op: Operation
    ) -> tuple[Facts, Granted]:
        state = self._state()
        w = live_holder(state, workload, peer.uris, peer.serial)
        facts = facts_of(state, w)
        ref = secret_ref(spelled, w.registration.namespace)
        return facts, authorize(self._policies.current, facts, ref, op)

    async def _refuse(self, workload: str, op: Operation, exc: AttestmeshError) -> None:
        self._on_decision(op.value, "refused", exc.reason)
        if workload in self._state().workloads:  # no events in the name of nobody
            event = Event(
                EventKind.SECRET_REFUSED,
                workload,
                self._clock(),
                reason=f"{op.value}: {exc.detail}",
                code=exc.reason,
            )
            await self._audit([event])

    async def _guarded(
        self, peer: PeerCertificate, workload: str, spelled: str, op: Operation, run: Run
    ) -> Released:
        if self._limiter is not None:
            # before anything is read or recorded: a workload looping on requests can neither
            # load OpenBao nor grow the audit log without bound (counted, not recorded)
            try:
                self._limiter.take(workload, self._clock())
            except AttestmeshError:
                self._on_decision(op.value, "refused", "too_many_requests")
                raise SecretRefused("too_many_requests", "too many secret requests") from None
        try:
            facts, granted = self._decide(peer, workload, spelled, op)
            released, note = await run(granted, facts)
            # the backend was awaited: a quarantine, renewal or policy change meanwhile wins
            again = self._decide(peer, workload, spelled, op)
            if again != (facts, granted):
                raise SecretRefused("policy_changed", "the decision changed during the request")
        except SecretRefused as exc:
            await self._refuse(workload, op, exc)
            raise
        except OpenBaoError as exc:
            self._on_decision(op.value, "error", exc.reason)
            raise
        if released.unchanged:
            self._on_decision(op.value, "unchanged", "ok")
            return released
        event = Event(
            EventKind.SECRET_RELEASED,
            workload,
            self._clock(),
            reason=f"{op.value} {released.ref} {note} to {facts.spiffe_id}",
            code=op.value,
        )
        await self._audit([event])  # durable before the secret leaves
        self._on_decision(op.value, "released", "ok")
        return released

    async def release(
        self, peer: PeerCertificate, workload: str, spelled: str, have_version: int | None
    ) -> Released:
        """A KV v2 secret sealed to ``peer``'s key, or ``unchanged``."""

        async def run(granted: Granted, facts: Facts) -> tuple[Released, str]:
            source = granted.secret.source
            assert isinstance(source, KvSource)  # authorize(READ) grants kv secrets only
            entry = await self._backend.kv_read(source.mount, source.path, source.version)
            if have_version == entry.version:
                return Released(granted.ref, entry.version, unchanged=True), ""
            context = ReleaseContext(facts.spiffe_id, granted.ref, entry.version)
            envelope = seal(peer.public_key, canonical_json(dict(entry.data)), context)
            return Released(granted.ref, entry.version, envelope), f"version {entry.version}"

        return await self._guarded(peer, workload, spelled, Operation.READ, run)

    async def unwrap(
        self, peer: PeerCertificate, workload: str, spelled: str, ciphertext: str
    ) -> Released:
        """Transit decrypt; the plaintext sealed to ``peer``'s key."""
        try:
            transit_version(ciphertext)  # malformed input never reaches OpenBao
        except OpenBaoError as exc:
            raise SecretRefused("request_malformed", exc.detail) from None

        async def run(granted: Granted, facts: Facts) -> tuple[Released, str]:
            source = granted.secret.source
            assert isinstance(source, TransitSource)
            plaintext, version = await self._backend.transit_decrypt(
                source.mount, source.key, ciphertext
            )
            context = ReleaseContext(facts.spiffe_id, granted.ref, version)
            envelope = seal(peer.public_key, plaintext, context)
            return Released(granted.ref, version, envelope), f"key version {version}"

        return await self._guarded(peer, workload, spelled, Operation.UNWRAP, run)

    async def wrap(
        self, peer: PeerCertificate, workload: str, spelled: str, plaintext: bytes
    ) -> Released:
        """Transit encrypt: nothing secret leaves, so nothing is sealed."""
        if len(plaintext) > MAX_TRANSIT_PLAINTEXT:
            raise SecretRefused("request_malformed", "plaintext is too large")

        async def run(granted: Granted, facts: Facts) -> tuple[Released, str]:
            source = granted.secret.source
            assert isinstance(source, TransitSource)
            ct = await self._backend.transit_encrypt(source.mount, source.key, plaintext)
            version = transit_version(ct)
            return Released(granted.ref, version, ciphertext=ct), f"key version {version}"

        return await self._guarded(peer, workload, spelled, Operation.WRAP, run)


# ---------------------------------------------------------------------------------------------
# the HTTPS adapter


def secrets_tls(bundle_pem: bytes) -> ssl.SSLContext:
    """Mutual TLS: only certificates chaining to the mesh CA get to ask at all."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=bundle_pem.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def public_refusal(exc: AttestmeshError) -> tuple[int, dict[str, str]]:
    if isinstance(exc, OpenBaoError):
        if exc.reason == "bao_not_found":
            return 404, {"error": "secret_unavailable", "detail": "the secret has no value"}
        return 503, {"error": "backend_unavailable", "detail": "try again later"}
    if exc.reason in _HIDDEN:
        return 403, {"error": "not_allowed", "detail": "not released to this workload"}
    if exc.reason == "too_many_requests":
        return 429, {"error": exc.reason, "detail": exc.detail}
    if exc.reason in ("request_malformed", "no_client_certificate"):
        return 400, {"error": exc.reason, "detail": exc.detail}
    return 403, {"error": exc.reason, "detail": exc.detail}


def _request(body: Any, *fields: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise SecretRefused("request_malformed", "body must be a JSON object")
    allowed = {"workload", "secret", *fields}
    if set(body) - allowed:
        raise SecretRefused("request_malformed", f"allowed fields: {sorted(allowed)}")
    for key in ("workload", "secret"):
        value = body.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= 253:
            raise SecretRefused("request_malformed", f"{key} must be a non-empty string")
    return body


def released_json(r: Released) -> dict[str, Any]:
    out: dict[str, Any] = {"secret": r.ref, "version": r.version}
    if r.unchanged:
        out["unchanged"] = True
    if r.envelope is not None:
        out["envelope"] = r.envelope
    if r.ciphertext is not None:
        out["ciphertext"] = r.ciphertext
    return out


def build_secrets_app(service: SecretService) -> web.Application:
    """``POST /v1/secrets/release`` {workload, secret, have_version?};
    ``POST /v1/secrets/unwrap`` {workload, secret, ciphertext};
    ``POST /v1/secrets/wrap`` {workload, secret, plaintext (base64)}."""

    async def body_of(request: web.Request) -> tuple[PeerCertificate, Any]:
        transport = request.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        der = ssl_object.getpeercert(True) if ssl_object is not None else None
        peer = parse_peer(der)
        try:
            return peer, await request.json(loads=json.loads)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise SecretRefused("request_malformed", "body is not JSON") from None

    def guarded(
        handler: Callable[[web.Request], Awaitable[dict[str, Any]]],
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def wrapper(request: web.Request) -> web.Response:
            try:
                return web.json_response(await handler(request))
            except AttestmeshError as exc:
                status, body = public_refusal(exc)
                log.info("secret request refused: %s: %s", exc.reason, exc.detail)
                return web.json_response(body, status=status)

        return wrapper

    async def release(request: web.Request) -> dict[str, Any]:
        peer, raw = await body_of(request)
        body = _request(raw, "have_version")
        have = body.get("have_version")
        if have is not None and (not isinstance(have, int) or isinstance(have, bool)):
            raise SecretRefused("request_malformed", "have_version must be an integer")
        return released_json(await service.release(peer, body["workload"], body["secret"], have))

    async def unwrap(request: web.Request) -> dict[str, Any]:
        peer, raw = await body_of(request)
        body = _request(raw, "ciphertext")
        ct = body.get("ciphertext")
        if not isinstance(ct, str):
            raise SecretRefused("request_malformed", "ciphertext must be a string")
        return released_json(await service.unwrap(peer, body["workload"], body["secret"], ct))

    async def wrap(request: web.Request) -> dict[str, Any]:
        peer, raw = await body_of(request)
        body = _request(raw, "plaintext")
        try:
            plaintext = base64.b64decode(str(body.get("plaintext", "")), validate=True)
        except (binascii.Error, ValueError):
            raise SecretRefused("request_malformed", "plaintext must be base64") from None
        return released_json(await service.wrap(peer, body["workload"], body["secret"], plaintext))

    app = web.Application(client_max_size=MAX_BODY)
    app.router.add_post("/v1/secrets/release", guarded(release))
    app.router.add_post("/v1/secrets/unwrap", guarded(unwrap))
    app.router.add_post("/v1/secrets/wrap", guarded(wrap))
    return app


__all__ = [
    "Limiter",
    "PeerCertificate",
    "Released",
    "SecretBackend",
    "SecretPolicies",
    "SecretService",
    "build_secrets_app",
    "parse_peer",
    "public_refusal",
    "released_json",
    "secrets_tls",
]
