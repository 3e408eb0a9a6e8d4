"""Attestation policy: the model, its strict parser, and ``appraise``.

The local policy file and the Kubernetes ``AttestationPolicy`` custom resource have the same
shape and are parsed by this one module. Parsing collects every problem before failing.
``appraise(claims, policy, now)`` is pure and returns ``Admitted`` or ``Rejected``; only an
``Admitted`` value reaches the CA.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from certs.errors import PolicyError
from certs.evidence.claims import Claims, TcbStatus, Tee

API_GROUP = "attestmesh.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND_ATTESTATION_POLICY = "AttestationPolicy"

_HEX = re.compile(r"[0-9a-fA-F]*")
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

MIN_TTL = timedelta(minutes=1)
MAX_TTL = timedelta(hours=24)
DEFAULT_TTL = timedelta(hours=1)
DEFAULT_REATTESTATION = timedelta(minutes=30)


class Mode(enum.StrEnum):
    ENFORCE = "enforce"
    AUDIT = "audit"


class OnFailure(enum.StrEnum):
    QUARANTINE = "quarantine"
    QUARANTINE_AND_EVICT = "quarantineAndEvict"


class OnTcbChange(enum.StrEnum):
    """What re-appraisal does when changed vendor collateral (or a raised minimum TCB) makes
    claims on record fail: ``audit`` records an event and a metric only (the workload keeps
    its certificate until its next attestation is appraised); ``quarantine`` quarantines it
    after ``tcbChangeGracePeriod``."""

    AUDIT = "audit"
    QUARANTINE = "quarantine"


MAX_TCB_GRACE = timedelta(days=30)
# Rejection codes a TCB change produces (collateral moving a platform's status or naming new
# advisories, a policy raising its minimum TCB): only these follow ``onTcbChange``.
TCB_CHANGE_REASONS = frozenset(
    {"tcb_status_not_accepted", "tcb_below_minimum", "advisories_not_allowed"}
)


# Reference-value key in the policy (camelCase, as in the CRD) -> claims.measurements key.
MEASUREMENT_KEYS: Mapping[Tee, Mapping[str, str]] = {
    Tee.SIM: {"measurement": "measurement"},
    Tee.NITRO: {f"pcr{i}": f"pcr{i}" for i in (0, 1, 2, 3, 4, 8)},
    Tee.SEV_SNP: {
        "measurement": "measurement",
        "hostData": "host_data",
        "idKeyDigest": "id_key_digest",
        "authorKeyDigest": "author_key_digest",
    },
    Tee.TDX: {
        "mrtd": "mrtd",
        "rtmr0": "rtmr0",
        "rtmr1": "rtmr1",
        "rtmr2": "rtmr2",
        "rtmr3": "rtmr3",
        "mrseam": "mrseam",
        "mrconfigid": "mrconfigid",
    },
    Tee.SGX: {"mrenclave": "mrenclave", "mrsigner": "mrsigner"},
    Tee.NVIDIA_GPU: {},
}

# Policy section name (camelCase) per TEE.
SECTION: Mapping[Tee, str] = {
    Tee.SIM: "sim",
    Tee.NITRO: "nitro",
    Tee.SEV_SNP: "sevSnp",
    Tee.TDX: "tdx",
    Tee.SGX: "sgx",
    Tee.NVIDIA_GPU: "nvidiaGpu",
}
SNP_TCB_COMPONENTS = ("bootloader", "tee", "snp", "microcode")


@dataclass(frozen=True, slots=True)
class ReferenceValues:
    """Allowed values for one TEE. Each measurement key maps to its allowed hex values; a key
    not listed is unconstrained. At least one measurement key is required per allowed TEE."""

    measurements: Mapping[str, frozenset[str]] = field(default_factory=dict)
    minimum_tcb: Mapping[str, int] = field(default_factory=dict)
    platform_ids: frozenset[str] = frozenset()
    minimum_svn: int | None = None
    product_id: int | None = None
    accepted_tcb_statuses: frozenset[str] = frozenset({TcbStatus.UP_TO_DATE.value})
    allowed_advisories: frozenset[str] = frozenset()
    allow_migration_agent: bool = False
    allow_smt: bool = True


@dataclass(frozen=True, slots=True)
class Selector:
    namespace: str
    service_accounts: frozenset[str] = frozenset()
    match_labels: Mapping[str, str] = field(default_factory=dict)

    def matches(self, namespace: str, service_account: str, labels: Mapping[str, str]) -> bool:
        if namespace != self.namespace:
            return False
        if self.service_accounts and service_account not in self.service_accounts:
            return False
        return all(labels.get(k) == v for k, v in self.match_labels.items())


@dataclass(frozen=True, slots=True)
class AttestationPolicy:
    name: str
    selector: Selector
    allowed_tees: frozenset[Tee]
    reference_values: Mapping[Tee, ReferenceValues]
    allow_debug: bool = False
    mode: Mode = Mode.ENFORCE
    on_failure: OnFailure = OnFailure.QUARANTINE
    certificate_ttl: timedelta = DEFAULT_TTL
    reattestation_interval: timedelta = DEFAULT_REATTESTATION
    generation: int = 0
    on_tcb_change: OnTcbChange = OnTcbChange.AUDIT
    tcb_change_grace_period: timedelta = timedelta(0)
    requires: frozenset[Tee] = frozenset()
    """TEEs whose evidence must all be present (e.g. sev-snp and nvidia-gpu: a composite)."""


@dataclass(frozen=True, slots=True)
class Admitted:
    claims: Claims
    policy: str
    at: datetime
    certificate_ttl: timedelta


@dataclass(frozen=True, slots=True)
class Rejected:
    reasons: tuple[str, ...]
    policy: str
    at: datetime

    @property
    def reason(self) -> str:
        """The first reason's code (bounded vocabulary, usable as a metric label)."""
        return self.reasons[0].split(":", 1)[0]


Decision = Admitted | Rejected


# ---------------------------------------------------------------------------------------------
# appraise


def appraise(claims: Claims, policy: AttestationPolicy, now: datetime) -> Decision:
    """Decide whether verified claims satisfy the policy. Pure; collects every reason."""
    reasons: list[str] = []
    attached = attached_tees(claims)
    for tee in (claims.tee, *attached):
        if tee not in policy.allowed_tees:
            reasons.append(f"tee_not_allowed: {tee} not in {sorted(policy.allowed_tees)}")
    missing = sorted(policy.requires - {claims.tee, *attached})
    if missing:
        reasons.append(f"tee_required: evidence lacks {', '.join(missing)}")
    if reasons:
        return Rejected(tuple(reasons), policy.name, now)
    if Tee.NVIDIA_GPU in attached:
        reasons += _appraise_gpus(claims, policy.reference_values.get(Tee.NVIDIA_GPU))
    if claims.debug and not policy.allow_debug:
        reasons.append("debug_not_allowed: evidence comes from a debug-enabled TEE")
    ref = policy.reference_values.get(claims.tee, ReferenceValues())
    for key, allowed in sorted(ref.measurements.items()):
        actual = claims.measurements.get(key)
        if actual is None:
            reasons.append(f"measurement_missing: {key}")
        elif actual.lower() not in allowed:
            reasons.append(f"measurement_not_allowed: {key}={actual}")
    for component, minimum in sorted(ref.minimum_tcb.items()):
        have = claims.tcb.get(component)
        if have is None or have < minimum:
            reasons.append(f"tcb_below_minimum: {component}={have} < {minimum}")
    if ref.platform_ids and (claims.platform_id or "").lower() not in ref.platform_ids:
        reasons.append(f"platform_not_allowed: {claims.platform_id}")
    if ref.minimum_svn is not None and (claims.svn is None or claims.svn < ref.minimum_svn):
        reasons.append(f"svn_below_minimum: {claims.svn} < {ref.minimum_svn}")
    if ref.product_id is not None and claims.product_id != ref.product_id:
        reasons.append(f"product_id_mismatch: {claims.product_id} != {ref.product_id}")
    if claims.tcb_status is not None and claims.tcb_status not in ref.accepted_tcb_statuses:
        reasons.append(f"tcb_status_not_accepted: {claims.tcb_status}")
    unknown = sorted(set(claims.advisories) - ref.allowed_advisories)
    if unknown:
        reasons.append(f"advisories_not_allowed: {','.join(unknown)}")
    if claims.tee is Tee.SEV_SNP:
        if claims.details.get("migration_agent_allowed") and not ref.allow_migration_agent:
            reasons.append("migration_agent_not_allowed: guest policy allows a migration agent")
        if claims.details.get("smt_allowed") and not ref.allow_smt:
            reasons.append("smt_not_allowed: guest policy allows SMT")
    if reasons:
        return Rejected(tuple(reasons), policy.name, now)
    return Admitted(claims, policy.name, now, policy.certificate_ttl)


def attached_tees(claims: Claims) -> tuple[Tee, ...]:
    """TEEs whose evidence came attached to the CPU's (composite evidence, see
    ``certs.evidence.composite``): their claims are the ``<prefix><index>.`` keys."""
    raw = claims.details.get("attached_tees")
    if not isinstance(raw, str) or not raw:
        return ()
    out = []
    for name in raw.split(","):
        try:
            out.append(Tee(name))
        except ValueError:
            continue
    return tuple(out)


def _appraise_gpus(claims: Claims, ref: ReferenceValues | None) -> list[str]:
    """Every attached GPU (``gpu<i>.`` claims) against the policy's ``nvidiaGpu`` values."""
    count = claims.details.get("gpu_count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        return ["measurement_missing: gpu_count"]
    reasons = []
    for i in range(count):
        for key, allowed in sorted((ref or ReferenceValues()).measurements.items()):
            actual = claims.measurements.get(f"gpu{i}.{key}")
            if actual is None:
                reasons.append(f"measurement_missing: gpu{i}.{key}")
            elif actual.lower() not in allowed:
                reasons.append(f"measurement_not_allowed: gpu{i}.{key}={actual}")
    return reasons


def tcb_change_only(decision: Rejected) -> bool:
    """True when every reason is one a TCB change produces (``onTcbChange`` applies)."""
    return all(r.split(":", 1)[0] in TCB_CHANGE_REASONS for r in decision.reasons)


# ---------------------------------------------------------------------------------------------
# parsing (collect every problem)


def parse_duration(text: str) -> timedelta:
    m = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if not m or not text.strip():
        raise ValueError(f"invalid duration {text!r} (use e.g. 90s, 10m, 1h30m)")
    h, mi, s = (int(g) if g else 0 for g in m.groups())
    return timedelta(hours=h, minutes=mi, seconds=s)


def format_duration(value: timedelta) -> str:
    total = int(value.total_seconds())
    h, rem = divmod(total, 3600)
    m, s = divmod(rem, 60)
    return "".join(f"{n}{u}" for n, u in ((h, "h"), (m, "m"), (s, "s")) if n) or "0s"


class _Problems:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")


def _hex_list(value: Any, where: str, problems: _Problems) -> frozenset[str]:
    if not isinstance(value, list) or not value:
        problems.add(where, "must be a non-empty list of hex strings")
        return frozenset()
    out: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item or not _HEX.fullmatch(item) or len(item) % 2:
            problems.add(f"{where}[{i}]", f"not a hex string: {item!r}")
        else:
            out.add(item.lower())
    return frozenset(out)


def _int(value: Any, where: str, problems: _Problems, *, minimum: int = 0) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.add(where, f"must be an integer >= {minimum}")
        return None
    return value


def _bool(value: Any, where: str, problems: _Problems) -> bool:
    if not isinstance(value, bool):
        problems.add(where, "must be true or false")
        return False
    return value


def _str_list(value: Any, where: str, problems: _Problems) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        problems.add(where, "must be a list of non-empty strings")
        return frozenset()
    return frozenset(value)


def _check_keys(obj: Mapping[str, Any], allowed: set[str], where: str, p: _Problems) -> None:
    for key in sorted(set(obj) - allowed):
        p.add(f"{where}.{key}", f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _parse_reference(tee: Tee, raw: Any, where: str, p: _Problems) -> ReferenceValues:
    if not isinstance(raw, dict):
        p.add(where, "must be an object")
        return ReferenceValues()
    mkeys = MEASUREMENT_KEYS[tee]
    extra: set[str] = set()
    if tee is Tee.SEV_SNP:
        extra = {"minimumTcb", "chipIds", "minimumGuestSvn", "allowMigrationAgent", "allowSmt"}
    elif tee in (Tee.TDX, Tee.SGX):
        extra = {"acceptedTcbStatuses", "allowedAdvisories"}
        if tee is Tee.SGX:
            extra |= {"productId", "minimumSvn"}
    elif tee is Tee.NVIDIA_GPU:
        extra = {"measurements"}
    _check_keys(raw, set(mkeys) | extra, where, p)
    measurements: dict[str, frozenset[str]] = {}
    for key, claim_key in mkeys.items():
        if key in raw:
            measurements[claim_key] = _hex_list(raw[key], f"{where}.{key}", p)
    if tee is Tee.NVIDIA_GPU and "measurements" in raw:
        gpu = raw["measurements"]
        if not isinstance(gpu, dict):
            p.add(f"{where}.measurements", "must map measurement index to hex values")
        else:
            for index, values in gpu.items():
                if not str(index).isdigit():
                    p.add(f"{where}.measurements.{index}", "index must be a number")
                    continue
                measurements[f"measurement_{int(index)}"] = _hex_list(
                    values, f"{where}.measurements.{index}", p
                )
    if not measurements:
        p.add(where, "at least one reference measurement is required")
    kwargs: dict[str, Any] = {"measurements": measurements}
    if "minimumTcb" in raw:
        tcb = raw["minimumTcb"]
        if not isinstance(tcb, dict):
            p.add(f"{where}.minimumTcb", "must be an object")
        else:
            _check_keys(tcb, set(SNP_TCB_COMPONENTS), f"{where}.minimumTcb", p)
            kwargs["minimum_tcb"] = {
                k: v
                for k in SNP_TCB_COMPONENTS
                if k in tcb and (v := _int(tcb[k], f"{where}.minimumTcb.{k}", p)) is not None
            }
    if "chipIds" in raw:
        kwargs["platform_ids"] = _hex_list(raw["chipIds"], f"{where}.chipIds", p)
    for key, attr in (("minimumGuestSvn", "minimum_svn"), ("minimumSvn", "minimum_svn")):
        if key in raw:
            kwargs[attr] = _int(raw[key], f"{where}.{key}", p)
    if "productId" in raw:
        kwargs["product_id"] = _int(raw["productId"], f"{where}.productId", p)
    if "acceptedTcbStatuses" in raw:
        statuses = _str_list(raw["acceptedTcbStatuses"], f"{where}.acceptedTcbStatuses", p)
        valid = {s.value for s in TcbStatus}
        for s in sorted(statuses - valid):
            p.add(f"{where}.acceptedTcbStatuses", f"unknown TCB status {s!r}")
        kwargs["accepted_tcb_statuses"] = statuses
    if "allowedAdvisories" in raw:
        kwargs["allowed_advisories"] = _str_list(
            raw["allowedAdvisories"], f"{where}.allowedAdvisories", p
        )
    for key, attr in (("allowMigrationAgent", "allow_migration_agent"), ("allowSmt", "allow_smt")):
        if key in raw:
            kwargs[attr] = _bool(raw[key], f"{where}.{key}", p)
    return ReferenceValues(**kwargs)


def _parse_one(doc: Any, index: int, p: _Problems) -> AttestationPolicy | None:
    where = f"document[{index}]"
    if not isinstance(doc, dict):
        p.add(where, "must be an object")
        return None
    if doc.get("apiVersion") != API_VERSION:
        p.add(f"{where}.apiVersion", f"must be {API_VERSION}")
    if doc.get("kind") != KIND_ATTESTATION_POLICY:
        p.add(f"{where}.kind", f"must be {KIND_ATTESTATION_POLICY}")
    meta = doc.get("metadata")
    name, namespace, generation = "", "default", 0
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        p.add(f"{where}.metadata.name", "is required")
    else:
        name = meta["name"]
        namespace = meta.get("namespace", "default")
        generation = meta.get("generation", 0) if isinstance(meta.get("generation"), int) else 0
        if not _NAME.fullmatch(name):
            p.add(f"{where}.metadata.name", f"not a DNS-1123 label: {name!r}")
        if not isinstance(namespace, str) or not _NAME.fullmatch(namespace):
            p.add(f"{where}.metadata.namespace", f"not a DNS-1123 label: {namespace!r}")
            namespace = "default"
    where = f"{name or where}"
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        p.add(f"{where}.spec", "is required")
        return None
    _check_keys(
        spec,
        {
            "selector",
            "allowedTees",
            "allowDebug",
            "mode",
            "onFailure",
            "certificateTTL",
            "reattestationInterval",
            "referenceValues",
            "onTcbChange",
            "tcbChangeGracePeriod",
            "requires",
        },
        f"{where}.spec",
        p,
    )
    sel_raw = spec.get("selector", {})
    selector = Selector(namespace=namespace)
    if not isinstance(sel_raw, dict):
        p.add(f"{where}.spec.selector", "must be an object")
    else:
        _check_keys(sel_raw, {"serviceAccounts", "matchLabels"}, f"{where}.spec.selector", p)
        sas = (
            _str_list(sel_raw["serviceAccounts"], f"{where}.spec.selector.serviceAccounts", p)
            if "serviceAccounts" in sel_raw
            else frozenset()
        )
        labels = sel_raw.get("matchLabels", {})
        if not isinstance(labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
        ):
            p.add(f"{where}.spec.selector.matchLabels", "must map strings to strings")
            labels = {}
        if not sas and not labels:
            p.add(f"{where}.spec.selector", "needs serviceAccounts and/or matchLabels")
        selector = Selector(namespace, sas, dict(labels))
    tees: set[Tee] = set()
    raw_tees = spec.get("allowedTees")
    if not isinstance(raw_tees, list) or not raw_tees:
        p.add(f"{where}.spec.allowedTees", "must be a non-empty list")
    else:
        for t in raw_tees:
            try:
                tees.add(Tee(t))
            except ValueError:
                p.add(
                    f"{where}.spec.allowedTees",
                    f"unknown TEE {t!r} (one of {', '.join(x.value for x in Tee)})",
                )
    refs_raw = spec.get("referenceValues", {})
    refs: dict[Tee, ReferenceValues] = {}
    if not isinstance(refs_raw, dict):
        p.add(f"{where}.spec.referenceValues", "must be an object")
        refs_raw = {}
    by_section = {v: k for k, v in SECTION.items()}
    for section in sorted(set(refs_raw) - set(by_section)):
        p.add(f"{where}.spec.referenceValues.{section}", "unknown TEE section")
    for tee in sorted(tees):
        section = SECTION[tee]
        if section not in refs_raw:
            p.add(f"{where}.spec.referenceValues.{section}", f"required because {tee} is allowed")
            continue
        refs[tee] = _parse_reference(
            tee, refs_raw[section], f"{where}.spec.referenceValues.{section}", p
        )
    kwargs: dict[str, Any] = {}
    if "allowDebug" in spec:
        kwargs["allow_debug"] = _bool(spec["allowDebug"], f"{where}.spec.allowDebug", p)
    for key, enum_type, attr in (
        ("mode", Mode, "mode"),
        ("onFailure", OnFailure, "on_failure"),
        ("onTcbChange", OnTcbChange, "on_tcb_change"),
    ):
        if key in spec:
            try:
                kwargs[attr] = enum_type(spec[key])
            except ValueError:
                allowed = ", ".join(m.value for m in enum_type)
                p.add(f"{where}.spec.{key}", f"must be one of {allowed}")
    for key, attr in (
        ("certificateTTL", "certificate_ttl"),
        ("reattestationInterval", "reattestation_interval"),
    ):
        if key in spec:
            try:
                value = parse_duration(spec[key])
            except ValueError as exc:
                p.add(f"{where}.spec.{key}", str(exc))
                continue
            if key == "certificateTTL" and not MIN_TTL <= value <= MAX_TTL:
                p.add(f"{where}.spec.{key}", "must be between 1m and 24h")
            if key == "reattestationInterval" and value < timedelta(seconds=5):
                p.add(f"{where}.spec.{key}", "must be at least 5s")
            kwargs[attr] = value
    if "tcbChangeGracePeriod" in spec:
        where_grace = f"{where}.spec.tcbChangeGracePeriod"
        try:
            grace = parse_duration(spec["tcbChangeGracePeriod"])
        except ValueError as exc:
            p.add(where_grace, str(exc))
        else:
            if grace > MAX_TCB_GRACE:
                p.add(where_grace, "must not exceed 720h (30 days)")
            if kwargs.get("on_tcb_change") is not OnTcbChange.QUARANTINE:
                p.add(where_grace, "only applies with onTcbChange: quarantine")
            kwargs["tcb_change_grace_period"] = grace
    if "requires" in spec:
        raw_req = spec["requires"]
        if not isinstance(raw_req, list) or not raw_req:
            p.add(f"{where}.spec.requires", "must be a non-empty list of TEEs")
        else:
            required: set[Tee] = set()
            for t in raw_req:
                try:
                    required.add(Tee(t))
                except ValueError:
                    p.add(f"{where}.spec.requires", f"unknown TEE {t!r}")
                    continue
                if Tee(t) not in tees:
                    p.add(f"{where}.spec.requires", f"{t} is required but not in allowedTees")
            if len(raw_req) != len(required):
                p.add(f"{where}.spec.requires", "lists a TEE more than once")
            cpus = sorted(t for t in required if t is not Tee.NVIDIA_GPU)
            if len(cpus) > 1:
                p.add(f"{where}.spec.requires", f"at most one CPU TEE, got {', '.join(cpus)}")
            if required == {Tee.NVIDIA_GPU}:
                p.add(f"{where}.spec.requires", "nvidia-gpu needs a CPU TEE to attach to")
            kwargs["requires"] = frozenset(required)
    ttl = kwargs.get("certificate_ttl", DEFAULT_TTL)
    if kwargs.get("reattestation_interval", DEFAULT_REATTESTATION) > ttl:
        p.add(f"{where}.spec.reattestationInterval", "must not exceed certificateTTL")
    return AttestationPolicy(
        name=f"{namespace}/{name}",
        selector=selector,
        allowed_tees=frozenset(tees),
        reference_values=refs,
        generation=generation,
        **kwargs,
    )


def parse_policies(docs: Sequence[Any]) -> tuple[AttestationPolicy, ...]:
    """Parse AttestationPolicy documents; raise PolicyError listing every problem."""
    p = _Problems()
    out: list[AttestationPolicy] = []
    for i, doc in enumerate(docs):
        policy = _parse_one(doc, i, p)
        if policy is not None:
            out.append(policy)
    names = [x.name for x in out]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        p.add(dup, "defined more than once")
    if p.items:
        raise PolicyError(p.items)
    return tuple(out)


def policies_for(
    policies: Sequence[AttestationPolicy],
    namespace: str,
    service_account: str,
    labels: Mapping[str, str] | None = None,
) -> tuple[AttestationPolicy, ...]:
    """Every policy governing a workload; all of them must admit it."""
    return tuple(
        x for x in policies if x.selector.matches(namespace, service_account, labels or {})
    )


def appraise_all(claims: Claims, governing: Sequence[AttestationPolicy], now: datetime) -> Decision:
    """Conjunction over every governing policy in ``enforce`` mode. Only an enforcing policy
    admits: no governing policy is ``no_policy``; governing policies that are all in ``audit``
    mode are ``no_enforcing_policy``. Audit-mode policies never admit and never reject: they
    only add findings (see ``audit_findings``)."""
    if not governing:
        return Rejected(("no_policy: no attestation policy governs this identity",), "", now)
    enforced = [x for x in governing if x.mode is Mode.ENFORCE]
    if not enforced:
        audit_only = ",".join(x.name for x in governing)
        return Rejected(
            (
                "no_enforcing_policy: only audit-mode policies govern this identity "
                f"({audit_only}); audit policies add findings, they never admit",
            ),
            audit_only,
            now,
        )
    decisions = [appraise(claims, x, now) for x in enforced]
    rejected = [d for d in decisions if isinstance(d, Rejected)]
    if rejected:
        reasons = tuple(r for d in rejected for r in d.reasons)
        return Rejected(reasons, ",".join(d.policy for d in rejected), now)
    ttl = min(x.certificate_ttl for x in enforced)
    return Admitted(claims, ",".join(x.name for x in enforced), now, ttl)


def audit_findings(
    claims: Claims, governing: Sequence[AttestationPolicy], now: datetime
) -> tuple[Rejected, ...]:
    """What ``audit``-mode policies would have rejected: recorded, never acted on. This is how
    new reference values are rolled out safely."""
    return tuple(
        d
        for x in governing
        if x.mode is Mode.AUDIT and isinstance(d := appraise(claims, x, now), Rejected)
    )
