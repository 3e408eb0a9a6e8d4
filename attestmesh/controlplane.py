"""The control plane service: holds mesh state and applies transitions.

Every transition is persisted (``StateStore.save``) before it is announced (``Publisher``:
xDS snapshots; Kubernetes actions), metrics follow. Time and randomness are injected.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol

from attestmesh.metrics import Metrics
from certs.ca import (
    CertificateAuthority,
    Issuer,
    build_leaf,
    encode_claims_extension,
    rotation_step,
)
from certs.errors import AttestmeshError, CollateralError, PolicyError
from certs.evidence.claims import Claims, Collateral, Tee, Verifier
from certs.issuance import (
    AttestRequest,
    EvidenceRejected,
    IdentityError,
    decide,
    verify_request,
)
from certs.nonces import NonceBook
from certs.policy import (
    DEFAULT_REATTESTATION,
    AttestationPolicy,
    Rejected,
    appraise_all,
    audit_findings,
    parse_policies,
    policies_for,
)
from xds.build import TrustMaterial
from xds.meshpolicy import MeshPolicy
from xds.state import (
    AttestationRecord,
    Event,
    EventKind,
    IssuedCert,
    MeshState,
    Registration,
    Status,
    Trigger,
    ensure_may_issue,
    overdue,
    prune_revocations,
    quarantine,
    record_attestation,
    register,
    release,
    unregister,
)
from xds.store import StateStore

log = logging.getLogger(__name__)
CRL_VALIDITY = timedelta(hours=24)
# A vendor service that is down or answers with an error is not the workload's failure: the
# request fails (HTTP 503, the agent retries) but never quarantines; the re-attestation deadline
# stays the backstop.
COLLATERAL_OUTAGE = frozenset({"collateral_unreachable", "collateral_http_status"})
# A failed CA rotation step (disk full, unreadable root key) is retried this much later; the
# signing intermediate has months left when rotation starts.
CA_ROTATION_RETRY = timedelta(minutes=1)


class Publisher(Protocol):
    """Announces a persisted state: xDS snapshots, Kubernetes actions."""

    def publish(
        self, state: MeshState, mesh_policies: Sequence[MeshPolicy], trust: TrustMaterial
    ) -> None: ...

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None: ...


class IdentityCheck(Protocol):
    async def check(self, reg: Registration, token: str | None) -> None: ...


class CollateralSource(Protocol):
    async def collateral_for(
        self, evidence: bytes, supplied: Collateral, now: datetime
    ) -> dict[str, bytes]: ...


class RegistrationTokenCheck:
    """Local mode: a registration entry may carry the SHA-256 of a join token."""

    async def check(self, reg: Registration, token: str | None) -> None:
        if reg.token_sha256 is None:
            return
        got = hashlib.sha256((token or "").encode()).hexdigest()
        if not hmac.compare_digest(got, reg.token_sha256):
            raise IdentityError("identity_invalid", f"bad registration token for {reg.name}")


@dataclass(frozen=True, slots=True)
class Issued:
    chain_pem: bytes
    bundle_pem: bytes
    serial: int
    not_after: datetime
    renew_after: datetime
    reattest_by: datetime
    spiffe_id: str
    claims: Claims


Clock = Callable[[], datetime]


class ControlPlane:
    def __init__(
        self,
        *,
        state: MeshState,
        store: StateStore,
        ca: CertificateAuthority,
        verifiers: Mapping[Tee, Verifier],
        policies: Sequence[AttestationPolicy],
        mesh_policies: Sequence[MeshPolicy],
        metrics: Metrics,
        publisher: Publisher,
        clock: Clock,
        serials: Callable[[], int],
        random_bytes: Callable[[int], bytes],
        identity: IdentityCheck | None = None,
        collateral_sources: Mapping[Tee, CollateralSource] | None = None,
    ) -> None:
        self._state = state
        self._store = store
        self._ca = ca
        self._verifiers = dict(verifiers)
        self._policies = tuple(policies)
        self._mesh_policies = tuple(mesh_policies)
        self._metrics = metrics
        self._publisher = publisher
        self._clock = clock
        self._serials = serials
        self._random = random_bytes
        self._identity = identity or RegistrationTokenCheck()
        self._collateral = dict(collateral_sources or {})
        self._nonces = NonceBook(key=random_bytes(32))  # stateless nonces: nothing to exhaust
        self._crl_at: datetime | None = None
        self._ca_retry_at: datetime | None = None
        self._trust = self._build_trust(clock())
        self._update_gauges()

    # -- reads --------------------------------------------------------------------------------
    @property
    def state(self) -> MeshState:
        return self._state

    @property
    def trust(self) -> TrustMaterial:
        return self._trust

    @property
    def mesh_policies(self) -> tuple[MeshPolicy, ...]:
        return self._mesh_policies

    @property
    def policies(self) -> tuple[AttestationPolicy, ...]:
        return self._policies

    @property
    def ca(self) -> CertificateAuthority:
        return self._ca

    def status_of(self, workload: str) -> Status:
        return self._state.get(workload).status

    def trust_json(self) -> dict[str, str]:
        return {
            "trust_bundle": self._trust.bundle_pem.decode(),
            "crl": self._trust.crl_pem.decode(),
        }

    # -- transitions --------------------------------------------------------------------------
    def _apply(self, new: MeshState, events: Sequence[Event]) -> None:
        now = self._clock()
        new = prune_revocations(new, now)
        self._store.save(self._state, new, events)  # durable before announced
        old_revoked = self._state.revoked_serials()
        self._state = new
        if new.revoked_serials() != old_revoked:
            self._trust = self._build_trust(now)
        self._update_gauges()
        self._publisher.publish(new, self._mesh_policies, self._trust)
        if events:
            self._publisher.on_events(new, events)

    def _build_trust(self, now: datetime) -> TrustMaterial:
        revoked = [(r.serial, r.revoked_at) for r in self._state.revocations]
        self._crl_at = now
        return TrustMaterial(self._ca.bundle_pem, self._ca.crl_pem(revoked, now, CRL_VALIDITY))

    def _update_gauges(self) -> None:
        count = sum(w.status is Status.QUARANTINED for w in self._state.workloads.values())
        self._metrics.quarantined.set(count)
        expiry = self._ca.intermediate.cert.not_valid_after_utc
        self._metrics.ca_intermediate_expiry.set(expiry.timestamp())

    def register(self, regs: Sequence[Registration]) -> None:
        now = self._clock()
        state, events = self._state, []
        for reg in regs:
            state, ev = register(state, reg, now)
            events += ev
        self._apply(state, events)

    def challenge(self) -> tuple[bytes, datetime]:
        """A fresh authenticated nonce and its expiry; issuing keeps no state."""
        return self._nonces.issue(self._clock(), self._random)

    async def authenticate(self, workload: str, token: str | None) -> Status:
        """The workload's status, once the caller proved to be it. Raises UnknownWorkloadError
        or IdentityError (the API answers both alike); changes nothing."""
        w = self._state.get(workload)
        await self._identity.check(w.registration, token)
        return self._state.get(workload).status  # fresh: the check awaited

    async def attest(self, req: AttestRequest, token: str | None) -> Issued:
        """Verify, appraise and issue. A failed re-attestation of an attested workload
        quarantines it; request errors (identity, nonce, CSR) never do."""
        started = time.perf_counter()
        now = self._clock()
        w = self._state.get(req.workload)
        await self._identity.check(w.registration, token)
        self._nonces.consume(req.nonce, now)
        ensure_may_issue(self._state, req.workload)
        try:
            collateral = await self._collateral_for(req, now)
            verified = verify_request(
                req if collateral is None else replace(req, collateral=collateral),
                self._verifiers,
                now,
            )
            governing = policies_for(
                self._policies,
                w.registration.namespace,
                w.registration.service_account,
                w.registration.labels,
            )
            admitted = decide(verified, governing, now)
        except EvidenceRejected as exc:
            self._metrics.attestations.labels(exc.tee, "rejected", exc.reason).inc()
            if self._state.get(req.workload).status is Status.ATTESTED:  # fresh: awaits above
                self.quarantine(req.workload, _trigger_for(exc), "; ".join(exc.reasons))
            raise
        ttl = admitted.certificate_ttl
        interval = min((p.reattestation_interval for p in governing), default=DEFAULT_REATTESTATION)
        serial = self._serials()
        spiffe = w.registration.spiffe_id(self._state.trust_domain)
        ca = self._ca
        leaf = build_leaf(
            verified.csr,
            spiffe_id=spiffe,
            claims_extension=encode_claims_extension(admitted.claims, admitted.policy, now),
            issuer=ca.intermediate,
            serial=serial,
            now=now,
            ttl=ttl,
        )
        not_after = leaf.not_valid_after_utc
        due = min(now + interval, not_after)
        record = AttestationRecord(
            tee=admitted.claims.tee.value,
            measurements=dict(admitted.claims.measurements),
            policy=admitted.policy,
            evidence_sha256=admitted.claims.evidence_sha256,
            at=now,
            claims=admitted.claims,
        )
        state, events = record_attestation(
            self._state, req.workload, record, IssuedCert(serial, not_after), due, now
        )
        for finding in audit_findings(verified.claims, governing, now):
            self._metrics.audit_findings.labels(finding.reason).inc()
            events.append(Event(EventKind.AUDIT, req.workload, now, "; ".join(finding.reasons)))
        self._apply(state, events)
        self._metrics.attestations.labels(admitted.claims.tee.value, "admitted", "ok").inc()
        self._metrics.certificates_issued.inc()
        self._metrics.issuance_seconds.observe(time.perf_counter() - started)
        return Issued(
            chain_pem=ca.chain_pem(leaf),
            bundle_pem=ca.bundle_pem,
            serial=serial,
            not_after=not_after,
            renew_after=now + (not_after - now) / 2,
            reattest_by=due,
            spiffe_id=spiffe,
            claims=admitted.claims,
        )

    async def _collateral_for(self, req: AttestRequest, now: datetime) -> dict[str, bytes] | None:
        try:
            source = self._collateral.get(Tee(req.tee))
        except ValueError:
            return None
        if source is None:
            return None
        try:
            return await source.collateral_for(req.evidence, req.collateral, now)
        except AttestmeshError as exc:
            if isinstance(exc, CollateralError) and exc.reason in COLLATERAL_OUTAGE:
                self._metrics.attestations.labels(Tee(req.tee).value, "error", exc.reason).inc()
                raise
            raise EvidenceRejected(exc.reason, exc.detail, req.tee) from exc

    def quarantine(self, name: str, trigger: Trigger, reason: str) -> bool:
        return bool(self._quarantine_all([(name, trigger, reason)]))

    def _quarantine_all(self, decisions: Sequence[tuple[str, Trigger, str]]) -> list[str]:
        """Quarantine several workloads in one transition: persisted and announced once."""
        now = self._clock()
        state, events = self._state, []
        for name, trigger, reason in decisions:
            state, ev = quarantine(state, name, trigger, reason, now)
            events += ev
        if not events:
            return []
        self._apply(state, events)
        for e in events:
            assert e.trigger is not None
            self._metrics.quarantine_events.labels(e.trigger.value).inc()
            log.warning("quarantined %s (%s): %s", e.workload, e.trigger, e.reason)
        return [e.workload for e in events]

    def unregister(self, name: str) -> bool:
        """The workload is gone (its pod was deleted): its endpoint leaves every cluster."""
        state, events = unregister(self._state, name, self._clock())
        if events:
            self._apply(state, events)
        return bool(events)

    def release(self, name: str) -> bool:
        state, events = release(self._state, name, self._clock())
        if events:
            self._apply(state, events)
        return bool(events)

    def check_deadlines(self) -> list[str]:
        """Quarantine attested workloads that missed their re-attestation deadline; rotate the
        intermediate CA when its predicates say so; refresh the CRLs before they go stale."""
        now = self._clock()
        late = overdue(self._state, now)
        self._quarantine_all(
            [(name, Trigger.DEADLINE_MISSED, "re-attestation deadline missed") for name in late]
        )
        self._rotate_ca(now)
        if self._crl_at is not None and now - self._crl_at > CRL_VALIDITY / 2:
            self._trust = self._build_trust(now)
            self._publisher.publish(self._state, self._mesh_policies, self._trust)
        return late

    def _rotate_ca(self, now: datetime) -> None:
        """The dumb ticker over the CA's rotation predicates. Each step is persisted before it
        is kept; after any step the CRL set changes (a CRL per live intermediate), so the trust
        material is rebuilt and published. Leaves issued from here on chain to the new signer;
        the trust bundle (the root) never changes."""
        if self._ca_retry_at is not None and now < self._ca_retry_at:
            return
        before = self._ca
        try:
            for _ in range(3):  # at most prepare, activate, retire
                rotated = rotation_step(self._ca, now)
                if rotated is None:
                    break
                log.info(
                    "CA rotation: signing %s, prepared %s, previous %s",
                    _serial_of(rotated.intermediate),
                    _serial_of(rotated.prepared),
                    _serial_of(rotated.previous),
                )
                self._ca = rotated
            self._ca_retry_at = None
        except (OSError, AttestmeshError) as exc:
            self._ca_retry_at = now + CA_ROTATION_RETRY
            log.error("CA rotation failed, retrying at %s: %s", self._ca_retry_at, exc)
        if self._ca is not before:
            self._trust = self._build_trust(now)
            self._update_gauges()
            self._publisher.publish(self._state, self._mesh_policies, self._trust)

    def set_policies(self, docs: Sequence[object]) -> tuple[AttestationPolicy, ...]:
        """Replace the attestation policies; invalid documents leave the previous ones in force.
        Running workloads whose last claims the new policy no longer admits are quarantined."""
        try:
            policies = parse_policies(list(docs))
        except PolicyError:
            self._metrics.policy_reloads.labels("invalid").inc()
            raise
        self._policies = policies
        self._metrics.policy_reloads.labels("ok").inc()
        now = self._clock()
        no_longer_admitted = []
        for name, w in sorted(self._state.workloads.items()):
            if w.status is not Status.ATTESTED or w.attestation is None:
                continue
            if w.attestation.claims is None:
                continue
            reg = w.registration
            governing = policies_for(policies, reg.namespace, reg.service_account, reg.labels)
            decision = appraise_all(w.attestation.claims, governing, now)
            if isinstance(decision, Rejected):
                no_longer_admitted.append(
                    (name, Trigger.POLICY_CHANGED, "; ".join(decision.reasons))
                )
        self._quarantine_all(no_longer_admitted)
        return policies

    def set_mesh_policies(self, policies: Sequence[MeshPolicy]) -> None:
        self._mesh_policies = tuple(policies)
        self._publisher.publish(self._state, self._mesh_policies, self._trust)

    def events(self, workload: str | None = None) -> list[Event]:
        return self._store.events(workload)


def _serial_of(issuer: Issuer | None) -> str:
    return "-" if issuer is None else format(issuer.cert.serial_number, "x")


def _trigger_for(exc: EvidenceRejected) -> Trigger:
    if exc.reason == "revoked":
        return Trigger.TCB_REVOKED
    return Trigger.APPRAISAL_FAILED if exc.appraisal else Trigger.VERIFICATION_FAILED
