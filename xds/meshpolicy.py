"""Mesh policy: who may call whom, by SPIFFE identity and by attested claims. Pure.

The local policy file and the Kubernetes ``MeshPolicy`` custom resource share this shape.
``compile_permissions`` resolves claims-based rules against the current mesh state into the
concrete SPIFFE principals an Envoy RBAC filter can match; quarantined or unattested callers
never appear in the result.

A SPIFFE ID names a service account, and pods of one account may run different code, so a
``whenClaims`` rule cannot be granted to the principal as a whole: it is granted to the
principal holding a certificate of a given claims class (``certs.ca.claims_class``, the Subject
``OU`` the CA writes into each leaf), one class per attested caller whose own claims satisfy
the rule. A rule without ``whenClaims`` grants the principal whatever certificate it holds.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from certs.ca import claims_class
from certs.errors import PolicyError
from certs.evidence.claims import Tee
from certs.policy import API_VERSION, attached_tees
from xds.index import parse_spiffe_principal, principal_of
from xds.state import AttestationRecord, MeshState, Status, WorkloadState, spiffe_id

KIND_MESH_POLICY = "MeshPolicy"
METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
# Used with fullmatch: "$" would let a trailing newline through.
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_HEX = re.compile(r"([0-9a-fA-F]{2})+")


@dataclass(frozen=True, slots=True)
class Source:
    identity: str | None = None
    namespace: str | None = None
    service_account: str | None = None

    def matches(self, trust_domain: str, w: WorkloadState) -> bool:
        reg = w.registration
        if self.identity is not None:
            return self.identity == reg.spiffe_id(trust_domain)
        return (reg.namespace, reg.service_account) == (self.namespace, self.service_account)


@dataclass(frozen=True, slots=True)
class ClaimsCondition:
    """``tees``: the caller was attested with evidence of at least one of them. A composite
    caller (a SEV-SNP or TDX VM with GPUs attached, ``certs.evidence.composite``) was attested
    by its CPU TEE and by every attached one: ``tees: [nvidia-gpu]`` matches an SNP or TDX VM
    whose attestation carried verified GPU evidence, ``tees: [sev-snp]`` matches it too (with
    or without GPUs). ``measurements``: every key listed has one of its values (GPU keys are
    ``gpu<i>.measurement_<n>``)."""

    tees: frozenset[str] = frozenset()
    measurements: tuple[tuple[str, frozenset[str]], ...] = ()

    def matches(self, w: WorkloadState) -> bool:
        rec = w.attestation
        if rec is None:
            return False
        if self.tees and self.tees.isdisjoint(attested_tees(rec)):
            return False
        return all(rec.measurements.get(k, "").lower() in v for k, v in self.measurements)


def attested_tees(rec: AttestationRecord) -> frozenset[str]:
    """The TEEs whose evidence an attestation verified: its own and any attached to it."""
    if rec.claims is None:
        return frozenset({rec.tee})
    return frozenset({rec.tee, *(t.value for t in attached_tees(rec.claims))})


@dataclass(frozen=True, slots=True)
class HttpMatch:
    ports: frozenset[int] = frozenset()
    paths: tuple[str, ...] = ()
    methods: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Rule:
    sources: tuple[Source, ...]
    when_claims: ClaimsCondition | None = None
    to: tuple[HttpMatch, ...] = ()


@dataclass(frozen=True, slots=True)
class MeshPolicy:
    name: str
    namespace: str
    destination_service_account: str
    rules: tuple[Rule, ...]
    audit: bool = False


@dataclass(frozen=True, slots=True)
class Permission:
    """One caller principal and what it may reach (empty ``to`` = everything).

    ``claim_classes`` None: any certificate of the principal; otherwise only a certificate whose
    claims class (``certs.ca.claims_class``, in its Subject) is one of them (never empty)."""

    principal: str
    to: tuple[HttpMatch, ...] = field(default_factory=tuple)
    claim_classes: frozenset[str] | None = None


def source_principal(source: Source, trust_domain: str) -> tuple[str, str] | None:
    """The (namespace, service account) a source names; None if it can name no workload."""
    if source.identity is not None:
        return parse_spiffe_principal(trust_domain, source.identity)
    assert source.namespace is not None and source.service_account is not None
    return (source.namespace, source.service_account)


CallerLookup = Callable[[tuple[str, str]], Iterable[WorkloadState]]
"""Attested workloads holding a (namespace, service account) identity."""


def compile_permissions_for(
    policies: Sequence[MeshPolicy],
    destination: tuple[str, str],
    trust_domain: str,
    attested_with: CallerLookup,
) -> tuple[Permission, ...]:
    """Who may call workloads of ``destination`` (namespace, service account) now, sorted
    (principal, unconditional first, classes) and merged; callers are looked up by the
    identities the rules name, so the cost follows the rules, not the size of the mesh.
    Enforce-mode policies only; callers must be attested (not pending, not quarantined).

    A rule without ``whenClaims`` allows its principals with any certificate; a rule with it
    allows, per principal, only the claims classes of attested callers whose own claims satisfy
    it. What a (principal, class) may reach is the union of its rules' ``to`` (empty =
    everything); a class entry that adds nothing to the principal's unconditional one is
    dropped, and classes reaching the same ``to`` share one permission."""
    ns, sa = destination
    # principal -> class (None: unconditional) -> what it may reach (() = everything)
    out: dict[str, dict[str | None, tuple[HttpMatch, ...]]] = {}
    for policy in policies:
        if policy.audit or policy.namespace != ns or policy.destination_service_account != sa:
            continue
        for rule in policy.rules:
            for source in rule.sources:
                principal = source_principal(source, trust_domain)
                if principal is None:
                    continue
                for caller in attested_with(principal):
                    key: str | None = None
                    if rule.when_claims is not None:
                        rec = caller.attestation
                        if rec is None or not rule.when_claims.matches(caller):
                            continue
                        key = claims_class(rec.tee, rec.measurements)
                    per = out.setdefault(caller.registration.spiffe_id(trust_domain), {})
                    per[key] = _merge_to(per.get(key), rule.to)
                    if rule.when_claims is None:
                        break  # every holder of the identity says the same: one is enough
    return tuple(p for name in sorted(out) for p in _permissions(name, out[name]))


def _merge_to(
    current: tuple[HttpMatch, ...] | None, more: tuple[HttpMatch, ...]
) -> tuple[HttpMatch, ...]:
    if current is None:
        return more
    if not current or not more:
        return ()
    return tuple(dict.fromkeys(current + more))


def _permissions(
    principal: str, per_class: dict[str | None, tuple[HttpMatch, ...]]
) -> list[Permission]:
    anyone = per_class.get(None)
    out: list[Permission] = [] if anyone is None else [Permission(principal, anyone)]
    if anyone == ():
        return out  # unconditional and unrestricted: no class can add anything
    by_to: dict[tuple[HttpMatch, ...], set[str]] = {}
    for cls, to in per_class.items():
        if cls is None:
            continue
        if anyone is not None and to and set(to) <= set(anyone):
            continue
        by_to.setdefault(to, set()).add(cls)
    conditional = [Permission(principal, to, frozenset(c)) for to, c in by_to.items()]
    return out + sorted(conditional, key=lambda p: sorted(p.claim_classes or ()))


def compile_permissions(
    policies: Sequence[MeshPolicy], state: MeshState, destination: str
) -> tuple[Permission, ...]:
    """Principals allowed to call workload ``destination`` now (a scan of the whole state: the
    reference the indexed path is tested against)."""
    dest = state.get(destination).registration
    attested = [w for w in state.workloads.values() if w.status is Status.ATTESTED]

    def lookup(principal: tuple[str, str]) -> list[WorkloadState]:
        return [w for w in attested if principal_of(w.registration) == principal]

    return compile_permissions_for(
        policies, (dest.namespace, dest.service_account), state.trust_domain, lookup
    )


def destinations_by_source(
    policies: Sequence[MeshPolicy], trust_domain: str
) -> dict[tuple[str, str], frozenset[tuple[str, str]]]:
    """Enforce-mode rules inverted: caller identity -> destination identities whose rules name
    it (a caller's change recompiles only those destinations' authorization)."""
    out: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for policy in policies:
        if policy.audit:
            continue
        dest = (policy.namespace, policy.destination_service_account)
        for rule in policy.rules:
            for source in rule.sources:
                principal = source_principal(source, trust_domain)
                if principal is not None:
                    out.setdefault(principal, set()).add(dest)
    return {k: frozenset(v) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# parsing


def _problem(problems: list[str], where: str, what: str) -> None:
    problems.append(f"{where}: {what}")


def _parse_source(raw: Any, where: str, ns: str, problems: list[str]) -> Source | None:
    if not isinstance(raw, dict):
        _problem(problems, where, "must be an object")
        return None
    if "identity" in raw:
        ident = raw["identity"]
        if set(raw) != {"identity"} or not isinstance(ident, str):
            _problem(problems, where, "identity must stand alone as a string")
            return None
        if not ident.startswith("spiffe://"):
            _problem(problems, where, f"not a SPIFFE ID: {ident!r}")
            return None
        return Source(identity=ident)
    sa, src_ns = raw.get("serviceAccount"), raw.get("namespace", ns)
    if set(raw) - {"serviceAccount", "namespace"}:
        _problem(problems, where, "allowed fields: identity | serviceAccount, namespace")
        return None
    if not isinstance(sa, str) or not _NAME.fullmatch(sa):
        _problem(problems, f"{where}.serviceAccount", "is required (DNS-1123 label)")
        return None
    if not isinstance(src_ns, str) or not _NAME.fullmatch(src_ns):
        _problem(problems, f"{where}.namespace", "not a DNS-1123 label")
        return None
    return Source(namespace=src_ns, service_account=sa)


def _parse_claims(raw: Any, where: str, problems: list[str]) -> ClaimsCondition | None:
    if not isinstance(raw, dict) or set(raw) - {"tees", "measurements"}:
        _problem(problems, where, "must be an object with tees and/or measurements")
        return None
    tees = raw.get("tees", [])
    valid = {t.value for t in Tee}
    if not isinstance(tees, list) or not all(isinstance(t, str) and t in valid for t in tees):
        _problem(problems, f"{where}.tees", f"must list TEEs from {sorted(valid)}")
        tees = []
    ms: list[tuple[str, frozenset[str]]] = []
    raw_ms = raw.get("measurements", {})
    if not isinstance(raw_ms, dict):
        _problem(problems, f"{where}.measurements", "must map a claims key to hex values")
        raw_ms = {}
    for key, values in sorted(raw_ms.items()):
        if (
            not isinstance(values, list)
            or not values
            or not all(isinstance(v, str) and _HEX.fullmatch(v) for v in values)
        ):
            _problem(problems, f"{where}.measurements.{key}", "must be a non-empty hex list")
            continue
        ms.append((str(key), frozenset(v.lower() for v in values)))
    if not tees and not ms:
        _problem(problems, where, "needs tees and/or measurements")
    return ClaimsCondition(frozenset(tees), tuple(ms))


def _parse_to(raw: Any, where: str, problems: list[str]) -> tuple[HttpMatch, ...]:
    if not isinstance(raw, list):
        _problem(problems, where, "must be a list")
        return ()
    out: list[HttpMatch] = []
    for i, item in enumerate(raw):
        w = f"{where}[{i}]"
        if not isinstance(item, dict) or set(item) - {"ports", "paths", "methods"}:
            _problem(problems, w, "allowed fields: ports, paths, methods")
            continue
        ports = item.get("ports", [])
        paths = item.get("paths", [])
        methods = item.get("methods", [])
        if not isinstance(ports, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in ports
        ):
            _problem(problems, f"{w}.ports", "must be a list of port numbers")
            ports = []
        if not isinstance(paths, list) or not all(
            isinstance(p, str) and p.startswith("/") for p in paths
        ):
            _problem(problems, f"{w}.paths", "must be a list of path prefixes starting with /")
            paths = []
        if not isinstance(methods, list) or not all(
            isinstance(m, str) and m in METHODS for m in methods
        ):
            _problem(problems, f"{w}.methods", f"must be a subset of {sorted(METHODS)}")
            methods = []
        out.append(HttpMatch(frozenset(ports), tuple(paths), frozenset(methods)))
    return tuple(out)


def _parse_one(doc: Any, index: int, problems: list[str]) -> MeshPolicy | None:
    where = f"document[{index}]"
    if not isinstance(doc, dict):
        _problem(problems, where, "must be an object")
        return None
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND_MESH_POLICY:
        _problem(problems, where, f"must be apiVersion {API_VERSION}, kind {KIND_MESH_POLICY}")
    meta_raw = doc.get("metadata")
    meta: dict[str, Any] = meta_raw if isinstance(meta_raw, dict) else {}
    name, ns = meta.get("name"), meta.get("namespace", "default")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        _problem(problems, f"{where}.metadata.name", "is required (DNS-1123 label)")
        name = ""
    if not isinstance(ns, str) or not _NAME.fullmatch(ns):
        _problem(problems, f"{where}.metadata.namespace", "not a DNS-1123 label")
        ns = "default"
    where = name or where
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        _problem(problems, f"{where}.spec", "is required")
        return None
    for key in sorted(set(spec) - {"destination", "mode", "rules"}):
        _problem(problems, f"{where}.spec.{key}", "unknown field")
    dest = spec.get("destination")
    dest_sa = dest.get("serviceAccount") if isinstance(dest, dict) else None
    if not isinstance(dest_sa, str) or not _NAME.fullmatch(dest_sa):
        _problem(problems, f"{where}.spec.destination.serviceAccount", "is required")
        dest_sa = ""
    mode = spec.get("mode", "enforce")
    if mode not in ("enforce", "audit"):
        _problem(problems, f"{where}.spec.mode", "must be enforce or audit")
    rules_raw = spec.get("rules")
    rules: list[Rule] = []
    if not isinstance(rules_raw, list) or not rules_raw:
        _problem(problems, f"{where}.spec.rules", "must be a non-empty list")
        rules_raw = []
    for i, r in enumerate(rules_raw):
        w = f"{where}.spec.rules[{i}]"
        if not isinstance(r, dict) or set(r) - {"from", "whenClaims", "to"}:
            _problem(problems, w, "allowed fields: from, whenClaims, to")
            continue
        froms = r.get("from")
        if not isinstance(froms, list) or not froms:
            _problem(problems, f"{w}.from", "must be a non-empty list")
            continue
        sources = [_parse_source(s, f"{w}.from[{j}]", ns, problems) for j, s in enumerate(froms)]
        claims = (
            _parse_claims(r["whenClaims"], f"{w}.whenClaims", problems)
            if "whenClaims" in r
            else None
        )
        to = _parse_to(r["to"], f"{w}.to", problems) if "to" in r else ()
        rules.append(Rule(tuple(s for s in sources if s is not None), claims, to))
    return MeshPolicy(name, ns, dest_sa, tuple(rules), audit=mode == "audit")


def parse_mesh_policies(docs: Sequence[Any]) -> tuple[MeshPolicy, ...]:
    """Parse MeshPolicy documents; raise PolicyError listing every problem."""
    problems: list[str] = []
    out = [p for i, d in enumerate(docs) if (p := _parse_one(d, i, problems)) is not None]
    if problems:
        raise PolicyError(problems)
    return tuple(out)


__all__ = [
    "ClaimsCondition",
    "HttpMatch",
    "MeshPolicy",
    "Permission",
    "Rule",
    "Source",
    "compile_permissions",
    "compile_permissions_for",
    "destinations_by_source",
    "parse_mesh_policies",
    "source_principal",
    "spiffe_id",
]
