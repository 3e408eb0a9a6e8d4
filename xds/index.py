"""Indexes over the mesh, kept up to date per changed workload, so that a change costs what it
touches and never a scan of the mesh. Pure (no I/O): a data structure with O(1) updates.

- ``members[(namespace, service)]``: workloads registered as that mesh service;
- ``callers[(namespace, service)]``: workloads whose outbound configuration names it;
- ``principals[(namespace, service_account)]``: workloads holding that SPIFFE identity.

:func:`affected_by` says, for one workload's old and new record, which services' shared
resources and which destination principals' authorization rules depend on what changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from xds.pmap import PMap
from xds.state import (
    MeshState,
    Registration,
    ServiceKey,
    Status,
    WorkloadState,
    resolve_service,
    service_key,
)

Identity = tuple[str, str]  # (namespace, service account)


def principal_of(reg: Registration) -> Identity:
    return (reg.namespace, reg.service_account)


def parse_spiffe_principal(trust_domain: str, identity: str) -> Identity | None:
    """``spiffe://<td>/ns/<ns>/sa/<sa>`` -> (ns, sa); anything else names no workload."""
    prefix = f"spiffe://{trust_domain}/ns/"
    if not identity.startswith(prefix):
        return None
    ns, sep, sa = identity[len(prefix) :].partition("/sa/")
    if not sep or not ns or not sa or "/" in ns or "/" in sa:
        return None
    return (ns, sa)


def _add(index: dict[tuple[str, str], set[str]], key: tuple[str, str] | None, name: str) -> None:
    if key is not None:
        index.setdefault(key, set()).add(name)


def _discard(
    index: dict[tuple[str, str], set[str]], key: tuple[str, str] | None, name: str
) -> None:
    names = None if key is None else index.get(key)
    if names is not None and key is not None:
        names.discard(name)
        if not names:
            del index[key]


def calls(reg: Registration) -> set[ServiceKey]:
    """The services ``reg``'s outbound entries mean."""
    return {resolve_service(reg.namespace, s) for s in reg.outbound}


class MeshIndex:
    """The workloads of a mesh and three reverse indexes over them."""

    def __init__(self, trust_domain: str) -> None:
        self.trust_domain = trust_domain
        self.workloads: dict[str, WorkloadState] = {}
        self.members: dict[ServiceKey, set[str]] = {}
        self.callers: dict[ServiceKey, set[str]] = {}
        self.principals: dict[Identity, set[str]] = {}
        self.quarantined = 0

    @classmethod
    def of(cls, state: MeshState) -> MeshIndex:
        index = cls(state.trust_domain)
        for name, w in state.workloads.items():
            index.put(name, w)
        return index

    def put(self, name: str, new: WorkloadState | None) -> WorkloadState | None:
        """Record ``name``'s new record (None: gone); returns the previous one."""
        old = self.workloads.get(name)
        if old is new:
            return old
        if (
            old is not None
            and new is not None
            and old.registration is new.registration
            and old.status is new.status
        ):  # a renewal: the reverse indexes (registration and status) are as they were
            self.workloads[name] = new
            return old
        if old is not None:
            reg = old.registration
            _discard(self.members, service_key(reg), name)
            for service in calls(reg):
                _discard(self.callers, service, name)
            _discard(self.principals, principal_of(reg), name)
            self.quarantined -= old.status is Status.QUARANTINED
            del self.workloads[name]
        if new is not None:
            reg = new.registration
            _add(self.members, service_key(reg), name)
            for service in calls(reg):
                _add(self.callers, service, name)
            _add(self.principals, principal_of(reg), name)
            self.quarantined += new.status is Status.QUARANTINED
            self.workloads[name] = new
        return old

    def get(self, name: str) -> WorkloadState | None:
        return self.workloads.get(name)

    def peers(self, service: ServiceKey) -> list[Registration]:
        """Attested workloads serving ``service``."""
        out = []
        for name in self.members.get(service, ()):
            w = self.workloads[name]
            if w.status is Status.ATTESTED:
                out.append(w.registration)
        return out

    def attested_with(self, principal: Identity) -> Iterator[WorkloadState]:
        for name in self.principals.get(principal, ()):
            w = self.workloads[name]
            if w.status is Status.ATTESTED:
                yield w

    def callers_of(self, services: Iterable[ServiceKey]) -> set[str]:
        out: set[str] = set()
        for service in services:
            out |= self.callers.get(service, set())
        return out

    def holders_of(self, principals: Iterable[Identity]) -> set[str]:
        out: set[str] = set()
        for p in principals:
            out |= self.principals.get(p, set())
        return out


@dataclass(frozen=True, slots=True)
class Affected:
    """What one workload's change touches: its own configuration, the shared resources of
    services it serves (callers' clusters and endpoints), and the authorization rules of
    destinations whose policies name its identity."""

    own: bool
    services: frozenset[ServiceKey]
    principals: frozenset[Identity]  # callers' identities whose rules must be recompiled
    # Something the old record was granted is taken back (its endpoint or identity leaves the
    # services it served; its identity or claims no longer what destinations admitted): the
    # nodes that depend on it must hear first, before changes that only grant.
    withdraws: bool = False


def _serving(w: WorkloadState | None, td: str) -> tuple[object, ...] | None:
    if w is None or w.status is not Status.ATTESTED:
        return None
    r = w.registration
    return (service_key(r), r.spiffe_id(td), r.inbound, r.ready)


def _calling(w: WorkloadState | None) -> tuple[object, ...] | None:
    if w is None or w.status is not Status.ATTESTED:
        return None
    a = w.attestation
    claims = None if a is None else (a.tee, tuple(sorted(a.measurements.items())))
    return (principal_of(w.registration), claims)


_NOTHING = Affected(False, frozenset(), frozenset())


def _same_claims(old: WorkloadState, new: WorkloadState) -> bool:
    """``_calling``'s claims of both are equal (without sorting the measurements)."""
    a, b = old.attestation, new.attestation
    if a is None or b is None:
        return a is b
    return a.tee == b.tee and a.measurements == b.measurements


def affected_by(
    old: WorkloadState | None, new: WorkloadState | None, trust_domain: str
) -> Affected:
    """Pure: what depends on the difference between ``old`` and ``new`` (a renewal: nothing)."""
    if (
        old is not None
        and new is not None
        and old.registration is new.registration
        and old.status is Status.ATTESTED
        and new.status is Status.ATTESTED
        and _same_claims(old, new)
    ):  # a renewal: the fast path of what follows (same registration, still attested)
        return _NOTHING
    old_reg = None if old is None else old.registration
    new_reg = None if new is None else new.registration
    old_att = old is not None and old.status is Status.ATTESTED
    new_att = new is not None and new.status is Status.ATTESTED
    own = new is not None and (old_reg != new_reg or old_att != new_att)
    services: set[ServiceKey] = set()
    withdraws = False
    if (serving := _serving(old, trust_domain)) != _serving(new, trust_domain):
        services |= {k for r in (old_reg, new_reg) if r is not None and (k := service_key(r))}
        withdraws = serving is not None
    principals: set[Identity] = set()
    if (calling := _calling(old)) != _calling(new):
        principals |= {principal_of(r) for r in (old_reg, new_reg) if r is not None}
        withdraws = withdraws or calling is not None
    return Affected(own, frozenset(services), frozenset(principals), withdraws)


def changed_names(old: Mapping[str, WorkloadState], new: Mapping[str, WorkloadState]) -> set[str]:
    """Names whose record differs (identity first, so unchanged records cost a pointer compare;
    between persistent maps, the buckets they share are skipped)."""
    if isinstance(old, PMap):
        return old.changed_keys(new)
    out = {n for n, w in new.items() if old.get(n) is not w}
    out |= {n for n in old if n not in new}
    return out


__all__ = [
    "Affected",
    "Identity",
    "MeshIndex",
    "affected_by",
    "calls",
    "changed_names",
    "parse_spiffe_principal",
    "principal_of",
]
