"""SecretPolicy: which OpenBao entries are released to which attested workloads. Pure.

The local ``--secret-policy`` file and the Kubernetes ``SecretPolicy`` custom resource share this
shape (``manifests/crds/secretpolicies.attestmesh.dev.yaml``; its CEL rules and this parser
reject the same mistakes)::

    apiVersion: attestmesh.dev/v1alpha1
    kind: SecretPolicy
    metadata: {name: payments, namespace: payments}
    spec:
      secrets:
        - name: db                      # a DNS label, unique in the policy
          kv: {mount: secret, path: payments/db}          # KV v2 (latest, or pin: version: 3)
          kbsResource: payments/key/db  # optional: also served to CoCo pods over KBS
        - name: model-key
          transit: {mount: transit, key: model, operations: [unwrap]}
      rules:
        - from: [{serviceAccount: api}]  # or {identity: spiffe://...}; namespace defaults here
          secrets: [db, model-key]
          whenClaims: {tees: [sev-snp], measurements: {measurement: [..hex..]},
                       tcbStatuses: [UpToDate]}

A secret is named ``<policy namespace>/<name>``; a workload may spell one in its own namespace
by ``name`` alone. A request is granted when some rule of the secret's policy names the caller
(by SPIFFE ID or service account) and the caller's attested claims satisfy its ``whenClaims``.

``live_holder`` decides who is asking: the workload whose *newest* certificate the client
presented (its claims are the ones on record); a quarantined workload holds no live
certificate, so quarantine stops release at once.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from certs.errors import AttestmeshError, PolicyError
from certs.evidence.claims import TcbStatus, Tee
from certs.policy import API_VERSION
from xds.meshpolicy import Source, _parse_source
from xds.state import MeshState, Status, WorkloadState

KIND_SECRET_POLICY = "SecretPolicy"  # noqa: S105 (a kind, not a secret)
MAX_SECRETS = 64
MAX_RULES = 64
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_HEX = re.compile(r"([0-9a-fA-F]{2})+")
_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}"
_MOUNT = re.compile(_SEGMENT)
# Up to 16 segments, 2,063 characters in all. The segments are unbounded one by one inside that:
# the CRD's pattern is RE2 (the API server's), which refuses a bounded repeat nested in
# another ({0,127} inside {0,15} expands past its limit of 1,000), so the parser says the same.
_KV_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*"
_KV_PATH = re.compile(rf"{_KV_SEGMENT}(/{_KV_SEGMENT}){{0,15}}")
MAX_KV_PATH = 2063
_KBS_RESOURCE = re.compile(rf"{_SEGMENT}/{_SEGMENT}/{_SEGMENT}")


class Operation(enum.StrEnum):
    READ = "read"  # a KV v2 entry
    WRAP = "wrap"  # transit encrypt
    UNWRAP = "unwrap"  # transit decrypt (the plaintext is sealed to the caller's key)


class SecretRefused(AttestmeshError):
    """A release refused; ``reason`` is a bounded code (a metric label), never the value."""


@dataclass(frozen=True, slots=True)
class KvSource:
    mount: str
    path: str
    version: int | None = None  # None: the latest version


@dataclass(frozen=True, slots=True)
class TransitSource:
    mount: str
    key: str
    operations: frozenset[Operation] = frozenset({Operation.UNWRAP})


@dataclass(frozen=True, slots=True)
class SecretSpec:
    name: str
    source: KvSource | TransitSource
    kbs_resource: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimsRequirement:
    tees: frozenset[str] = frozenset()
    measurements: tuple[tuple[str, frozenset[str]], ...] = ()
    tcb_statuses: frozenset[str] = frozenset()

    def matches(self, facts: Facts) -> bool:
        if self.tees and facts.tee not in self.tees:
            return False
        if self.tcb_statuses and facts.tcb_status not in self.tcb_statuses:
            return False
        return all(facts.measurements.get(k, "").lower() in v for k, v in self.measurements)


@dataclass(frozen=True, slots=True)
class SecretRule:
    sources: tuple[Source, ...]
    secrets: frozenset[str]
    when_claims: ClaimsRequirement | None = None


@dataclass(frozen=True, slots=True)
class SecretPolicy:
    name: str
    namespace: str
    secrets: Mapping[str, SecretSpec]
    rules: tuple[SecretRule, ...]


@dataclass(frozen=True, slots=True)
class Facts:
    """Who asks, and what its evidence showed (verified and appraised)."""

    spiffe_id: str
    namespace: str
    service_account: str
    tee: str
    measurements: Mapping[str, str]
    tcb_status: str | None = None


@dataclass(frozen=True, slots=True)
class Granted:
    ref: str  # namespace/name
    secret: SecretSpec
    policy: str


def secret_ref(spelled: str, caller_namespace: str) -> str:
    """``name`` (the caller's namespace) or ``namespace/name`` -> ``namespace/name``."""
    ns, sep, name = spelled.partition("/")
    if not sep:
        ns, name = caller_namespace, spelled
    if not _NAME.fullmatch(ns) or not _NAME.fullmatch(name):
        raise SecretRefused("request_malformed", "a secret is name or namespace/name")
    return f"{ns}/{name}"


def _names(source: Source, facts: Facts) -> bool:
    if source.identity is not None:
        return source.identity == facts.spiffe_id
    return (source.namespace, source.service_account) == (facts.namespace, facts.service_account)


def authorize(
    policies: Sequence[SecretPolicy], facts: Facts, ref: str, operation: Operation
) -> Granted:
    """May ``facts``' holder have ``ref`` (``namespace/name``) for ``operation``? Raises
    SecretRefused: ``unknown_secret``, ``not_allowed`` (no rule names the caller),
    ``claims_not_allowed`` (a rule names it, its claims do not satisfy one),
    ``operation_not_allowed``. The API answers the first three alike."""
    ns, _, name = ref.partition("/")
    found = [(p, p.secrets[name]) for p in policies if p.namespace == ns and name in p.secrets]
    if not found:
        raise SecretRefused("unknown_secret", f"no secret {ref}")
    named = False
    for policy, spec in found:
        if not _operation_allowed(spec, operation):
            continue
        for rule in policy.rules:
            if name not in rule.secrets or not any(_names(s, facts) for s in rule.sources):
                continue
            named = True
            if rule.when_claims is None or rule.when_claims.matches(facts):
                return Granted(ref, spec, policy.name)
    if not any(_operation_allowed(spec, operation) for _, spec in found):
        raise SecretRefused("operation_not_allowed", f"{ref} does not allow {operation}")
    if named:
        raise SecretRefused("claims_not_allowed", f"the caller's claims do not satisfy {ref}")
    raise SecretRefused("not_allowed", f"no rule releases {ref} to {facts.spiffe_id}")


def _operation_allowed(spec: SecretSpec, operation: Operation) -> bool:
    if isinstance(spec.source, KvSource):
        return operation is Operation.READ
    return operation in spec.source.operations


def kbs_resource(policies: Sequence[SecretPolicy], resource: str) -> str | None:
    """The secret (``namespace/name``) served at KBS resource ``repo/type/tag``, if any."""
    for p in policies:
        for spec in p.secrets.values():
            if spec.kbs_resource == resource:
                return f"{p.namespace}/{spec.name}"
    return None


def live_holder(
    state: MeshState, workload: str, uris: Sequence[str], serial: int | None
) -> WorkloadState:
    """The workload asking with a client certificate (URI SANs ``uris``, ``serial``): it must be
    attested, the certificate its own (SPIFFE ID) and its newest live one, whose claims are on
    record. Raises SecretRefused ``unknown_workload``, ``quarantined``, ``not_attested``,
    ``identity_mismatch``, ``certificate_not_live`` (revoked, superseded, withdrawn)."""
    w = state.workloads.get(workload)
    if w is None:
        raise SecretRefused("unknown_workload", "unknown workload or certificate")
    if w.status is Status.QUARANTINED:
        raise SecretRefused("quarantined", f"{workload} is quarantined")
    if w.status is not Status.ATTESTED or w.attestation is None:
        raise SecretRefused("not_attested", f"{workload} is not attested")
    if w.registration.spiffe_id(state.trust_domain) not in uris:
        raise SecretRefused("identity_mismatch", "the certificate names another identity")
    if not w.certificates or w.certificates[-1].serial != serial:
        raise SecretRefused("certificate_not_live", "present the workload's newest certificate")
    return w


def facts_of(state: MeshState, w: WorkloadState) -> Facts:
    """The facts on record for an attested workload (the claims its newest certificate has)."""
    rec = w.attestation
    assert rec is not None  # live_holder checked it
    reg = w.registration
    return Facts(
        spiffe_id=reg.spiffe_id(state.trust_domain),
        namespace=reg.namespace,
        service_account=reg.service_account,
        tee=rec.tee,
        measurements=dict(rec.measurements),
        tcb_status=rec.claims.tcb_status if rec.claims is not None else None,
    )


# ---------------------------------------------------------------------------------------------
# parsing


def _str(
    raw: Any, pattern: re.Pattern[str], where: str, problems: list[str], max_len: int = 0
) -> str:
    if max_len and isinstance(raw, str) and len(raw) > max_len:
        problems.append(f"{where}: at most {max_len} characters")
        return ""
    if not isinstance(raw, str) or not pattern.fullmatch(raw):
        problems.append(f"{where}: must match {pattern.pattern}")
        return ""
    return raw


def _parse_secret(raw: Any, where: str, problems: list[str]) -> SecretSpec | None:
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be an object")
        return None
    for key in sorted(set(raw) - {"name", "kv", "transit", "kbsResource"}):
        problems.append(f"{where}.{key}: unknown field")
    name = _str(raw.get("name"), _NAME, f"{where}.name", problems)
    if ("kv" in raw) == ("transit" in raw):
        problems.append(f"{where}: exactly one of kv, transit")
        return None
    source: KvSource | TransitSource
    if "kv" in raw:
        kv = raw["kv"]
        if not isinstance(kv, dict) or set(kv) - {"mount", "path", "version"}:
            problems.append(f"{where}.kv: allowed fields: mount, path, version")
            return None
        version = kv.get("version")
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 1
        ):
            problems.append(f"{where}.kv.version: must be an integer >= 1")
            version = None
        source = KvSource(
            _str(kv.get("mount"), _MOUNT, f"{where}.kv.mount", problems),
            _str(kv.get("path"), _KV_PATH, f"{where}.kv.path", problems, MAX_KV_PATH),
            version,
        )
    else:
        tr = raw["transit"]
        if not isinstance(tr, dict) or set(tr) - {"mount", "key", "operations"}:
            problems.append(f"{where}.transit: allowed fields: mount, key, operations")
            return None
        ops_raw = tr.get("operations", ["unwrap"])
        valid = {Operation.WRAP.value, Operation.UNWRAP.value}
        if (
            not isinstance(ops_raw, list)
            or not ops_raw
            or not all(isinstance(o, str) and o in valid for o in ops_raw)
            or len(set(ops_raw)) != len(ops_raw)
        ):
            problems.append(f"{where}.transit.operations: a non-empty set of wrap, unwrap")
            ops_raw = ["unwrap"]
        source = TransitSource(
            _str(tr.get("mount"), _MOUNT, f"{where}.transit.mount", problems),
            _str(tr.get("key"), _MOUNT, f"{where}.transit.key", problems),
            frozenset(Operation(o) for o in ops_raw),
        )
    kbs = raw.get("kbsResource")
    if kbs is not None:
        kbs = _str(kbs, _KBS_RESOURCE, f"{where}.kbsResource", problems) or None
        if isinstance(source, TransitSource):
            problems.append(f"{where}.kbsResource: only a kv secret can be a KBS resource")
    return SecretSpec(name, source, kbs)


def _shown(value: Any) -> str:
    """A bounded rendering of a bad value for a problem message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_claims(raw: Any, where: str, problems: list[str]) -> ClaimsRequirement | None:
    if not isinstance(raw, dict) or not raw or set(raw) - {"tees", "measurements", "tcbStatuses"}:
        problems.append(f"{where}: an object with tees, measurements and/or tcbStatuses")
        return None
    tees, statuses = raw.get("tees", []), raw.get("tcbStatuses", [])
    valid_tees, valid_status = {t.value for t in Tee}, {s.value for s in TcbStatus}
    if (
        not isinstance(tees, list)
        or (not tees and "tees" in raw)
        or not all(isinstance(t, str) and t in valid_tees for t in tees)
    ):
        problems.append(
            f"{where}.tees: a non-empty list of {sorted(valid_tees)}, not {_shown(tees)}"
        )
        tees = []
    if (
        not isinstance(statuses, list)
        or (not statuses and "tcbStatuses" in raw)
        or not all(isinstance(s, str) and s in valid_status for s in statuses)
    ):
        valid = sorted(valid_status)
        problems.append(f"{where}.tcbStatuses: a non-empty list of {valid}, not {_shown(statuses)}")
        statuses = []
    ms: list[tuple[str, frozenset[str]]] = []
    raw_ms = raw.get("measurements", {})
    if not isinstance(raw_ms, dict) or (not raw_ms and "measurements" in raw):
        problems.append(f"{where}.measurements: must map a claims key to hex values")
        raw_ms = {}
    for key, values in sorted(raw_ms.items()):
        if (
            not isinstance(values, list)
            or not values
            or len(values) > 64
            or not all(isinstance(v, str) and _HEX.fullmatch(v) and len(v) <= 256 for v in values)
        ):
            problems.append(f"{where}.measurements.{key}: a non-empty list of hex values")
            continue
        ms.append((str(key), frozenset(v.lower() for v in values)))
    return ClaimsRequirement(frozenset(tees), tuple(ms), frozenset(statuses))


def _parse_one(doc: Any, index: int, problems: list[str]) -> SecretPolicy | None:
    where = f"document[{index}]"
    if not isinstance(doc, dict):
        problems.append(f"{where}: must be an object")
        return None
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND_SECRET_POLICY:
        problems.append(f"{where}: must be apiVersion {API_VERSION}, kind {KIND_SECRET_POLICY}")
    meta_raw = doc.get("metadata")
    meta: dict[str, Any] = meta_raw if isinstance(meta_raw, dict) else {}
    name = _str(meta.get("name"), _NAME, f"{where}.metadata.name", problems)
    ns = meta.get("namespace", "default")
    if not isinstance(ns, str) or not _NAME.fullmatch(ns):
        problems.append(f"{where}.metadata.namespace: not a DNS-1123 label")
        ns = "default"
    where = name or where
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        problems.append(f"{where}.spec: is required")
        return None
    for key in sorted(set(spec) - {"secrets", "rules"}):
        problems.append(f"{where}.spec.{key}: unknown field")
    secrets_raw, rules_raw = spec.get("secrets"), spec.get("rules")
    if not isinstance(secrets_raw, list) or not 1 <= len(secrets_raw) <= MAX_SECRETS:
        problems.append(f"{where}.spec.secrets: a list of 1..{MAX_SECRETS} secrets")
        secrets_raw = []
    if not isinstance(rules_raw, list) or not 1 <= len(rules_raw) <= MAX_RULES:
        problems.append(f"{where}.spec.rules: a list of 1..{MAX_RULES} rules")
        rules_raw = []
    secrets: dict[str, SecretSpec] = {}
    for i, raw in enumerate(secrets_raw):
        s = _parse_secret(raw, f"{where}.spec.secrets[{i}]", problems)
        if s is None:
            continue
        if s.name in secrets:
            problems.append(f"{where}.spec.secrets[{i}].name: {s.name} is named twice")
        secrets[s.name] = s
    rules: list[SecretRule] = []
    for i, r in enumerate(rules_raw):
        w = f"{where}.spec.rules[{i}]"
        if not isinstance(r, dict) or set(r) - {"from", "secrets", "whenClaims"}:
            problems.append(f"{w}: allowed fields: from, secrets, whenClaims")
            continue
        froms, names = r.get("from"), r.get("secrets")
        if not isinstance(froms, list) or not 1 <= len(froms) <= 256:
            problems.append(f"{w}.from: a non-empty list")
            froms = []
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            problems.append(f"{w}.secrets: a non-empty list of secret names")
            names = []
        for n in names:
            if n not in secrets:
                problems.append(f"{w}.secrets: {n} is not a secret of this policy")
        sources = [_parse_source(s, f"{w}.from[{j}]", ns, problems) for j, s in enumerate(froms)]
        claims = (
            _parse_claims(r["whenClaims"], f"{w}.whenClaims", problems)
            if "whenClaims" in r
            else None
        )
        rules.append(
            SecretRule(tuple(s for s in sources if s is not None), frozenset(names), claims)
        )
    return SecretPolicy(name, ns, secrets, tuple(rules))


def parse_secret_policies(docs: Sequence[Any]) -> tuple[SecretPolicy, ...]:
    """Parse SecretPolicy documents; raise PolicyError listing every problem. Across documents:
    a (namespace, name) once, a KBS resource served by one secret only."""
    problems: list[str] = []
    out = [p for i, d in enumerate(docs) if (p := _parse_one(d, i, problems)) is not None]
    seen: set[tuple[str, str]] = set()
    kbs: dict[str, str] = {}
    refs: dict[str, str] = {}
    for p in out:
        if (p.namespace, p.name) in seen:
            problems.append(f"{p.namespace}/{p.name}: defined twice")
        seen.add((p.namespace, p.name))
        for s in p.secrets.values():
            ref = f"{p.namespace}/{s.name}"
            holder = refs.setdefault(ref, p.name)
            if holder != p.name:
                # one name, one source: a sealed envelope names the secret, never the policy
                problems.append(f"secret {ref}: defined by policy {holder} already")
            if s.kbs_resource is None:
                continue
            owner = kbs.setdefault(s.kbs_resource, ref)
            if owner != ref:
                problems.append(f"kbsResource {s.kbs_resource}: served by {owner} already")
    if problems:
        raise PolicyError(problems)
    return tuple(out)


__all__ = [
    "ClaimsRequirement",
    "Facts",
    "Granted",
    "KvSource",
    "Operation",
    "SecretPolicy",
    "SecretRefused",
    "SecretRule",
    "SecretSpec",
    "TransitSource",
    "authorize",
    "facts_of",
    "kbs_resource",
    "live_holder",
    "parse_secret_policies",
    "secret_ref",
]
