"""Mesh state and its transitions: registration, attestation, quarantine, release. Pure.

Every transition returns a new immutable ``MeshState`` plus the ``Event``s it caused; the
control plane persists the new state before it announces anything (xDS push, Kubernetes).
A state's workloads are a persistent map (:class:`xds.pmap.PMap`): a transition shares every
record it did not change with the state it came from, so it costs what it changed, not the
size of the mesh, and a state once handed out never changes under its readers.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from itertools import chain, islice
from typing import overload

from certs.evidence.claims import Claims
from certs.standing import QuarantinedError as QuarantinedError
from certs.standing import Status as Status
from certs.standing import UnknownWorkloadError as UnknownWorkloadError
from xds.pmap import PMap


class Trigger(enum.StrEnum):
    VERIFICATION_FAILED = "verification_failed"
    APPRAISAL_FAILED = "appraisal_failed"
    DEADLINE_MISSED = "deadline_missed"
    POLICY_CHANGED = "policy_changed"
    TCB_REVOKED = "tcb_revoked"
    TCB_CHANGED = "tcb_changed"  # re-appraisal after vendor collateral or a minimum TCB moved
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Endpoint:
    address: str
    port: int


@dataclass(frozen=True, slots=True)
class Registration:
    """Static facts about a workload: who it is and where its sidecar listens.

    ``name`` is unique and is its Envoy node id. ``service`` is the mesh service it serves in
    its own namespace ("" for none): a service is (namespace, name), so a workload can never
    join another namespace's service. ``outbound`` maps the services it calls (``name`` in its
    own namespace, ``name.namespace`` elsewhere) to the local port of its Envoy's outbound
    listener for that service. ``ready`` False (in Kubernetes:
    its EndpointSlice endpoint is not ready, or terminating) keeps it out of its service's
    endpoints; it stays registered and may still attest.
    """

    name: str
    namespace: str
    service_account: str
    service: str
    inbound: Endpoint
    app_port: int
    outbound: Mapping[str, int] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    token_sha256: str | None = None
    ready: bool = True
    pod_uid: str | None = None  # Kubernetes: the pod's metadata.uid (tokens are bound to it)

    def spiffe_id(self, trust_domain: str) -> str:
        return spiffe_id(trust_domain, self.namespace, self.service_account)


ServiceKey = tuple[str, str]
"""A mesh service: (namespace, name). Names are never compared across namespaces."""


def service_key(reg: Registration) -> ServiceKey | None:
    """The mesh service ``reg`` serves (None: it serves none)."""
    return (reg.namespace, reg.service) if reg.service else None


def resolve_service(caller_namespace: str, spelled: str) -> ServiceKey:
    """An outbound entry as the caller wrote it -> the service it means: ``name`` is in the
    caller's own namespace, ``name.namespace`` names another namespace explicitly."""
    name, sep, namespace = spelled.partition(".")
    return (namespace if sep else caller_namespace, name)


def spiffe_id(trust_domain: str, namespace: str, service_account: str) -> str:
    return f"spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"


@dataclass(frozen=True, slots=True)
class AttestationRecord:
    tee: str
    measurements: Mapping[str, str]
    policy: str
    evidence_sha256: str
    at: datetime
    claims: Claims | None = None  # the appraised claims, kept to re-appraise on policy change


@dataclass(frozen=True, slots=True)
class IssuedCert:
    serial: int
    not_after: datetime


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """Why a workload is quarantined. ``code`` is the typed reason (a bounded vocabulary, e.g.
    ``measurement_not_allowed``), ``reason`` the human detail; ``platform`` is set only when
    authentic evidence showed the platform itself failing (e.g. TCB revoked or out of date per
    vendor collateral): only then may its node be marked untrusted. Nothing parses ``reason``."""

    trigger: Trigger
    reason: str
    at: datetime
    code: str = ""
    platform: bool = False


@dataclass(frozen=True, slots=True)
class Revocation:
    serial: int
    not_after: datetime
    revoked_at: datetime
    workload: str


class Revocations(Sequence[Revocation]):
    """The mesh's revocations, in the order they were made: an immutable sequence that
    appending shares. Held as full chunks of ``_CHUNK`` (tuples, never changed once full)
    and a short tail, with the serials in a :class:`PMap`: :meth:`added` copies the tail and,
    when a chunk fills, the tuple of chunks (O(len / _CHUNK + _CHUNK) pointers) instead of
    the whole sequence, and :meth:`revokes` answers by serial in O(1). A superseding
    attestation adds one revocation: with a tuple it copied all of them (O(revocations) per
    attestation, ~35 us at 50,000). Equal to a tuple (or another ``Revocations``) of the
    same items; slices are tuples; :meth:`without` (a prune, an unrevoke) rebuilds."""

    __slots__ = ("_chunks", "_len", "_serials", "_tail")

    _CHUNK = 256

    _chunks: tuple[tuple[Revocation, ...], ...]
    _tail: tuple[Revocation, ...]
    _len: int
    _serials: PMap[int, Revocation]

    def __init__(self, items: Iterable[Revocation] = ()) -> None:
        if isinstance(items, Revocations):
            self._chunks, self._tail = items._chunks, items._tail
            self._len, self._serials = items._len, items._serials
            return
        every = tuple(items)
        for r in every:
            if not isinstance(r, Revocation):
                raise TypeError(f"not a Revocation: {r!r}")
        self._chunks, self._tail = _chunked((), every)
        self._len = len(every)
        self._serials = PMap((r.serial, r) for r in every)

    @classmethod
    def _of(
        cls,
        chunks: tuple[tuple[Revocation, ...], ...],
        tail: tuple[Revocation, ...],
        length: int,
        serials: PMap[int, Revocation],
    ) -> Revocations:
        made = object.__new__(cls)
        made._chunks, made._tail, made._len, made._serials = chunks, tail, length, serials
        return made

    def added(self, items: Iterable[Revocation]) -> Revocations:
        """These revocations and ``items`` after them (self when there are none)."""
        more = tuple(items)
        if not more:
            return self
        chunks, tail = _chunked(self._chunks, self._tail + more)
        if len(more) == 1:  # (a superseding attestation: one)
            serials = self._serials.set(more[0].serial, more[0])
        else:
            serials = self._serials.update({r.serial: r for r in more})
        return self._of(chunks, tail, self._len + len(more), serials)

    def without(self, serials: Collection[int]) -> Revocations:
        """These revocations less those of ``serials`` (self when none of them is here)."""
        gone = {s for s in serials if s in self._serials}
        if not gone:
            return self
        return Revocations(r for r in self if r.serial not in gone)

    def revokes(self, serial: int) -> bool:
        """Whether the certificate ``serial`` is revoked here."""
        return serial in self._serials

    def serials(self) -> frozenset[int]:
        return frozenset(self._serials)

    def extends(self, other: Revocations) -> bool:
        """Whether these are ``other``'s revocations with more (or none) added after them (by
        identity of what is shared: O(len / _CHUNK))."""
        n = len(other._chunks)
        if self._len < other._len or len(self._chunks) < n:
            return False
        if any(a is not b for a, b in zip(self._chunks, other._chunks, strict=False)):
            return False
        rest = other._tail
        if len(self._chunks) == n:
            return self._tail[: len(rest)] == rest
        return self._chunks[n][: len(rest)] == rest

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> Revocation: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Revocation, ...]: ...

    def __getitem__(self, index: int | slice) -> Revocation | tuple[Revocation, ...]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return tuple(self)[index]
            if stop <= start:
                return ()
            full = self._len - len(self._tail)
            if start >= full:  # (what was just added: in the tail)
                return self._tail[start - full : stop - full]
            first = start // self._CHUNK
            offset = first * self._CHUNK
            picked = chain.from_iterable((*self._chunks[first:], self._tail))
            return tuple(islice(picked, start - offset, stop - offset))
        i = index + self._len if index < 0 else index
        if not 0 <= i < self._len:
            raise IndexError("revocation index out of range")
        chunk, at = divmod(i, self._CHUNK)
        return self._chunks[chunk][at] if chunk < len(self._chunks) else self._tail[at]

    def __iter__(self) -> Iterator[Revocation]:
        for chunk in self._chunks:
            yield from chunk
        yield from self._tail

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, Revocation):
            return False
        held = self._serials.get(value.serial)
        if held is None:
            return False  # (every item's serial is in the map)
        return held == value or any(r == value for r in self)  # (a serial revoked twice)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Revocations):
            if other._len != self._len:
                return False
        elif isinstance(other, tuple):
            if len(other) != self._len:
                return False
        else:
            return NotImplemented
        return all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Revocations({tuple(self)!r})"

    def __reduce__(self) -> tuple[type[Revocations], tuple[tuple[Revocation, ...]]]:
        return (type(self), (tuple(self),))


def _chunked(
    chunks: tuple[tuple[Revocation, ...], ...], tail: tuple[Revocation, ...]
) -> tuple[tuple[tuple[Revocation, ...], ...], tuple[Revocation, ...]]:
    """``chunks`` with the full chunks of ``tail`` after them, and what is left of it."""
    size = Revocations._CHUNK
    if len(tail) < size:
        return chunks, tail
    full = len(tail) - len(tail) % size
    more = tuple(tail[i : i + size] for i in range(0, full, size))
    return chunks + more, tail[full:]


@dataclass(frozen=True, slots=True)
class TcbDeferral:
    """A quarantine decided after a TCB change, waiting out the policy's
    ``tcbChangeGracePeriod``: it happens at ``due`` unless the workload attests again first
    (its evidence is then no longer ``evidence_sha256``). Kept in the workload's row, so the
    deadline survives a restart and holds on every replica."""

    due: datetime
    evidence_sha256: str
    reason: str
    code: str
    revoked: bool = False


@dataclass(frozen=True, slots=True)
class WorkloadState:
    registration: Registration
    status: Status = Status.PENDING
    attestation: AttestationRecord | None = None
    next_attestation_due: datetime | None = None
    certificates: tuple[IssuedCert, ...] = ()
    quarantine: QuarantineRecord | None = None
    tcb_deferral: TcbDeferral | None = None


class EventKind(enum.StrEnum):
    REGISTERED = "registered"
    ATTESTED = "attested"
    QUARANTINED = "quarantined"
    RELEASED = "released"
    UNREGISTERED = "unregistered"
    AUDIT = "audit"  # an audit-mode policy would have rejected; nothing was done
    REFUSED = "refused"  # a request with unverifiable evidence was refused; nothing changed
    # a secret sealed to the workload (never its value); a secret request refused (code)
    SECRET_RELEASED = "secret_released"  # noqa: S105 (an event kind)
    SECRET_REFUSED = "secret_refused"  # noqa: S105 (an event kind)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    workload: str
    at: datetime
    reason: str = ""
    trigger: Trigger | None = None
    code: str = ""  # typed reason code (QUARANTINED, REFUSED)
    platform: bool = False  # QUARANTINED on authentic evidence of a failing platform


@dataclass(frozen=True, slots=True)
class MeshState:
    """``workloads`` may be given as any mapping; it is held as a :class:`PMap` (a copy of a
    plain dict, once: transitions then share structure). ``revocations`` likewise as any
    sequence of them, held as :class:`Revocations`."""

    trust_domain: str
    workloads: Mapping[str, WorkloadState] = field(default_factory=PMap)
    revocations: Revocations = field(default_factory=Revocations)

    def __post_init__(self) -> None:
        if not isinstance(self.workloads, PMap):
            object.__setattr__(self, "workloads", PMap(self.workloads))
        given: Iterable[Revocation] = self.revocations  # (a tuple, a list: held as one)
        if not isinstance(given, Revocations):
            object.__setattr__(self, "revocations", Revocations(given))

    def get(self, name: str) -> WorkloadState:
        try:
            return self.workloads[name]
        except KeyError:
            raise UnknownWorkloadError("unknown_identity", f"no workload {name!r}") from None

    def attested(self) -> list[WorkloadState]:
        return [w for w in self.workloads.values() if w.status is Status.ATTESTED]

    def revoked_serials(self) -> frozenset[int]:
        return self.revocations.serials()


def _records(state: MeshState) -> PMap[str, WorkloadState]:
    w = state.workloads
    return w if isinstance(w, PMap) else PMap(w)  # always a PMap (__post_init__)


def with_rows(state: MeshState, rows: Mapping[str, WorkloadState | None]) -> MeshState:
    """``state`` with these records (None: the workload gone), sharing every other one (a
    persistent map's update: what the rows cost, not the mesh)."""
    return replace(
        state,
        workloads=_records(state).update(
            {n: w for n, w in rows.items() if w is not None},
            [n for n, w in rows.items() if w is None],
        ),
    )


def _with(state: MeshState, w: WorkloadState) -> MeshState:
    return replace(state, workloads=_records(state).set(w.registration.name, w))


def register_all(
    state: MeshState, regs: Sequence[Registration], now: datetime
) -> tuple[MeshState, list[Event], list[str]]:
    """Add or update many registrations in one step (one copy of the mesh, not one per
    registration); returns the new state, its events and the names that changed."""
    workloads: dict[str, WorkloadState] = {}  # the records that change
    events: list[Event] = []
    changed: list[str] = []
    for reg in regs:
        current = workloads.get(reg.name) or state.workloads.get(reg.name)
        if current is None:
            workloads[reg.name] = WorkloadState(reg)
            events.append(Event(EventKind.REGISTERED, reg.name, now))
        elif current.registration != reg:
            workloads[reg.name] = replace(current, registration=reg)
        else:
            continue
        changed.append(reg.name)
    if not changed:
        return state, [], []
    return replace(state, workloads=_records(state).update(workloads)), events, changed


def register(state: MeshState, reg: Registration, now: datetime) -> tuple[MeshState, list[Event]]:
    """Add or update a registration; status, certificates and quarantine are kept."""
    current = state.workloads.get(reg.name)
    if current is not None:
        if current.registration == reg:
            return state, []
        return _with(state, replace(current, registration=reg)), []
    return _with(state, WorkloadState(reg)), [Event(EventKind.REGISTERED, reg.name, now)]


def ensure_may_issue(state: MeshState, name: str) -> WorkloadState:
    """Raise unless a certificate may be issued to this workload."""
    w = state.get(name)
    if w.status is Status.QUARANTINED:
        reason = w.quarantine.reason if w.quarantine else ""
        raise QuarantinedError("quarantined", f"{name} is quarantined: {reason}")
    return w


MAX_LIVE_CERTIFICATES = 4
"""Live certificates kept per workload (an agent holds one, and one more while it renews).
Older ones are superseded and revoked, so a workload's record does not grow with how often it
attests, and a quarantine still revokes every certificate its workload could present."""


def record_attestation(
    state: MeshState,
    name: str,
    record: AttestationRecord,
    cert: IssuedCert,
    due: datetime,
    now: datetime,
) -> tuple[MeshState, list[Event]]:
    """A fresh successful attestation issued ``cert``; re-attestation is due at ``due``."""
    w = ensure_may_issue(state, name)
    live = (*(c for c in w.certificates if c.not_after > now), cert)
    superseded = live[:-MAX_LIVE_CERTIFICATES]
    new = replace(
        w,
        status=Status.ATTESTED,
        attestation=record,
        next_attestation_due=due,
        certificates=live[-MAX_LIVE_CERTIFICATES:],
        quarantine=None,
        tcb_deferral=None,  # fresh evidence: a TCB finding about the old one no longer applies
    )
    state = _with(state, new)
    if superseded:
        revoked = tuple(Revocation(c.serial, c.not_after, now, name) for c in superseded)
        state = replace(state, revocations=state.revocations.added(revoked))
    return state, [Event(EventKind.ATTESTED, name, now, record.policy)]


def withdraw(
    state: MeshState, name: str, serial: int, before: WorkloadState, now: datetime
) -> tuple[MeshState, list[Event]]:
    """The certificate ``serial`` never reached its workload (the response was lost): revoke it
    and, if nothing happened to the workload since, return to its record ``before`` that
    issuance (a first attestation goes back to pending), so no attested state holds a key
    nobody has. The agent retries with fresh evidence."""
    w = state.workloads.get(name)
    if w is None or not w.certificates or w.certificates[-1].serial != serial:
        return state, []  # quarantined, re-attested or gone since: nothing to take back
    cert = w.certificates[-1]
    state = replace(
        _with(state, before),
        revocations=state.revocations.added((Revocation(serial, cert.not_after, now, name),)),
    )
    return state, []


def quarantine(
    state: MeshState,
    name: str,
    trigger: Trigger,
    reason: str,
    now: datetime,
    *,
    code: str = "",
    platform: bool = False,
) -> tuple[MeshState, list[Event]]:
    """Quarantine: every live certificate is revoked, status blocks further issuance.

    Idempotent: quarantining a quarantined workload changes nothing.
    """
    w = state.get(name)
    if w.status is Status.QUARANTINED:
        return state, []
    revoked = tuple(
        Revocation(c.serial, c.not_after, now, name) for c in w.certificates if c.not_after > now
    )
    new = replace(
        w,
        status=Status.QUARANTINED,
        certificates=(),
        next_attestation_due=None,
        quarantine=QuarantineRecord(trigger, reason, now, code, platform),
        tcb_deferral=None,
    )
    state = replace(_with(state, new), revocations=state.revocations.added(revoked))
    return state, [Event(EventKind.QUARANTINED, name, now, reason, trigger, code, platform)]


def release(state: MeshState, name: str, now: datetime) -> tuple[MeshState, list[Event]]:
    """Operator release: back to PENDING; certificates flow only after a fresh attestation."""
    w = state.get(name)
    if w.status is not Status.QUARANTINED:
        return state, []
    new = replace(w, status=Status.PENDING, quarantine=None, attestation=None)
    return _with(state, new), [Event(EventKind.RELEASED, name, now)]


def set_tcb_deferrals(
    state: MeshState, deferrals: Mapping[str, TcbDeferral | None]
) -> tuple[MeshState, list[str]]:
    """Record (or, with None, drop) deferred TCB quarantines; a deferral is only recorded on
    an attested workload whose evidence it names. Returns the state and the rows changed."""
    workloads: dict[str, WorkloadState] = {}  # the records that change
    changed: list[str] = []
    for name, d in deferrals.items():
        w = state.workloads.get(name)
        if w is None or w.tcb_deferral == d:
            continue
        if d is not None and (
            w.status is not Status.ATTESTED
            or w.attestation is None
            or w.attestation.evidence_sha256 != d.evidence_sha256
        ):
            continue
        workloads[name] = replace(w, tcb_deferral=d)
        changed.append(name)
    return (
        replace(state, workloads=_records(state).update(workloads)) if changed else state
    ), changed


def unregister(state: MeshState, name: str, now: datetime) -> tuple[MeshState, list[Event]]:
    """Forget a workload that is gone (e.g. its pod was deleted): its endpoint leaves every
    cluster. Its certificates are not revoked (a terminating pod may still drain); they expire.
    A quarantined workload's revocations stay in the CRL."""
    if name not in state.workloads:
        return state, []
    workloads = _records(state).delete(name)
    return replace(state, workloads=workloads), [Event(EventKind.UNREGISTERED, name, now)]


def overdue(state: MeshState, now: datetime) -> list[str]:
    """Attested workloads whose re-attestation deadline has passed."""
    return sorted(
        w.registration.name
        for w in state.workloads.values()
        if w.status is Status.ATTESTED
        and w.next_attestation_due is not None
        and w.next_attestation_due <= now
    )


def prune_revocations(state: MeshState, now: datetime) -> MeshState:
    """Drop revocations of certificates that have expired anyway (they need no CRL entry)."""
    expired = [r.serial for r in state.revocations if r.not_after <= now]
    return replace(state, revocations=state.revocations.without(expired)) if expired else state
