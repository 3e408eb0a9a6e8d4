"""``attestmesh verify``: verify one piece of evidence offline and optionally appraise it.

Usage::

    attestmesh verify EVIDENCE [--tee auto|sim|nitro|sev-snp|tdx|sgx|nvidia-gpu]
        [--collateral DIR] [--policy FILE [--namespace NS --service-account SA [--label K=V]...]]
        [--at TIME] [--roots DIR] [--sim-key PEM]... [--json]

EVIDENCE is the raw evidence file. Text evidence is handled: NVIDIA reports are hex text (the
verifier reads it as is); base64 text (e.g. a Nitro document as some tools save it) is decoded
when the raw bytes are not a known format. ``--tee auto`` detects the format.

``--collateral DIR`` maps files, by name, to the verifiers' collateral names (extension ignored):
``vcek``, ``vlek``, ``cert_chain`` (AMD KDS chain, or the NVIDIA device chain),
``collateral`` / ``collateral_json`` (dcap-qvl JSON), ``tcb_info`` / ``tcb_info_response``,
``tcb_info_issuer_chain`` (also ``tcb_info_issuer_chain_2025``), ``qe_identity`` /
``qe_identity_response``, ``qe_identity_issuer_chain``, ``pck_crl`` (also ``pck_crl_platform``,
``pck_crl_processor``), ``pck_crl_issuer_chain``, ``root_ca_crl``. Other files are ignored.

``--policy FILE`` is a YAML stream of AttestationPolicy documents. With ``--namespace`` and
``--service-account`` (and optional ``--label``), the policies whose selector matches that
identity govern, as in the control plane: all must admit, and none matching is a rejection.
Without an identity, **every** policy in the file must admit the evidence.

Exit status: 0 evidence valid (and admitted, with ``--policy``); 1 valid but rejected by policy;
2 evidence invalid (format or verification error, including missing collateral); 3 usage
error (unreadable files, bad time, invalid policy file, bad arguments).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import yaml
from cryptography.hazmat.primitives.asymmetric import ec

from certs.collateral.roots import load_roots
from certs.errors import (
    AttestmeshError,
    CollateralError,
    EvidenceFormatError,
    EvidenceVerificationError,
    PolicyError,
)
from certs.evidence import registry, sim
from certs.evidence.claims import Tee
from certs.policy import Admitted, Decision, appraise_all, parse_policies, policies_for
from xds.store import claims_to_doc

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_INVALID = 2
EXIT_USAGE = 3

MAX_INPUT = 1024 * 1024

COLLATERAL_NAMES = frozenset(
    {
        "vcek",
        "vlek",
        "cert_chain",
        "collateral_json",
        "tcb_info",
        "tcb_info_issuer_chain",
        "qe_identity",
        "qe_identity_issuer_chain",
        "pck_crl",
        "pck_crl_issuer_chain",
        "root_ca_crl",
    }
)
COLLATERAL_ALIASES: Mapping[str, str] = {
    "collateral": "collateral_json",
    "tcb_info_response": "tcb_info",
    "tcb_info_issuer_chain_2025": "tcb_info_issuer_chain",
    "qe_identity_response": "qe_identity",
    "pck_crl_platform": "pck_crl",
    "pck_crl_processor": "pck_crl",
}


class UsageError(Exception):
    """A problem with the command line or an input file (exit status 3)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``verify`` on an ``argparse`` subparsers object; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="verify TEE evidence offline, optionally appraising it against policy",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    return parser


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("evidence", type=Path, help="evidence file (binary, hex or base64 text)")
    parser.add_argument(
        "--tee", choices=["auto", *(t.value for t in Tee)], default="auto", help="TEE type"
    )
    parser.add_argument("--collateral", type=Path, metavar="DIR", help="collateral directory")
    parser.add_argument("--policy", type=Path, metavar="FILE", help="AttestationPolicy YAML")
    parser.add_argument("--namespace", help="workload namespace (selects governing policies)")
    parser.add_argument("--service-account", help="workload service account")
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="workload label"
    )
    parser.add_argument("--at", metavar="TIME", help="verification time, ISO 8601 (default now)")
    parser.add_argument("--roots", type=Path, metavar="DIR", help="override vendor roots")
    parser.add_argument(
        "--sim-key",
        type=Path,
        action="append",
        default=[],
        metavar="PEM",
        help="simulated platform public key (enables --tee sim)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------
# pure helpers


def parse_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"--at: not an ISO 8601 time: {text!r}") from None
    if value.tzinfo is None:
        raise UsageError("--at: give a UTC offset (e.g. 2024-01-01T00:00:00Z)")
    return value.astimezone(UTC)


def collateral_name(filename: str) -> tuple[str, bool] | None:
    """The collateral name a file supplies, and whether it is an exact (not alias) match."""
    stem = filename.split(".", 1)[0]
    if stem in COLLATERAL_NAMES:
        return stem, True
    if stem in COLLATERAL_ALIASES:
        return COLLATERAL_ALIASES[stem], False
    return None


def map_collateral(files: Mapping[str, bytes]) -> dict[str, bytes]:
    """File name -> bytes, to collateral name -> bytes. Exact names win over aliases."""
    chosen: dict[str, tuple[bool, str, bytes]] = {}
    for filename, data in sorted(files.items()):
        mapped = collateral_name(filename)
        if mapped is None:
            continue
        name, exact = mapped
        previous = chosen.get(name)
        if previous is not None and previous[0] == exact:
            raise UsageError(f"--collateral: both {previous[1]} and {filename} supply {name!r}")
        if previous is None or exact:
            chosen[name] = (exact, filename, data)
    return {name: data for name, (_, _, data) in chosen.items()}


def _b64_text(raw: bytes) -> bytes | None:
    compact = b"".join(raw.split())
    if not compact or len(compact) % 4:
        return None
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return None


def select_evidence(raw: bytes, tee: Tee | None) -> tuple[Tee, bytes]:
    """Choose the TEE and the evidence bytes: raw first, then base64-decoded text."""
    candidates = [raw]
    decoded = _b64_text(raw)
    if decoded is not None:
        candidates.append(decoded)
    for candidate in candidates:
        if tee is None:
            try:
                return registry.detect_tee(candidate), candidate
            except EvidenceFormatError:
                continue
        if dict(registry.SNIFFERS)[tee](candidate):
            return tee, candidate
    if tee is None:
        raise EvidenceFormatError("unknown_format", "not a known evidence format (nor base64)")
    return tee, raw  # let the chosen verifier report precisely what is wrong


def decision_json(decision: Decision) -> dict[str, Any]:
    if isinstance(decision, Admitted):
        return {
            "decision": "admitted",
            "policies": decision.policy.split(",") if decision.policy else [],
            "certificate_ttl_seconds": int(decision.certificate_ttl.total_seconds()),
            "reasons": [],
        }
    return {
        "decision": "rejected",
        "policies": decision.policy.split(",") if decision.policy else [],
        "reason": decision.reason,
        "reasons": list(decision.reasons),
    }


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    report: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# I/O shell


def _read(path: Path, what: str) -> bytes:
    try:
        if path.stat().st_size > MAX_INPUT:
            raise UsageError(f"{what} {path}: larger than {MAX_INPUT} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{what} {path}: {exc.strerror or exc}") from None


def _load_collateral(directory: Path, evidence: Path) -> dict[str, bytes]:
    if not directory.is_dir():
        raise UsageError(f"--collateral {directory}: not a directory")
    files = {
        p.name: _read(p, "collateral")
        for p in sorted(directory.iterdir())
        if p.is_file() and p.resolve() != evidence.resolve() and collateral_name(p.name)
    }
    return map_collateral(files)


def _load_policies(path: Path) -> Sequence[Any]:
    try:
        docs = [d for d in yaml.safe_load_all(_read(path, "policy")) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"--policy {path}: invalid YAML: {exc}") from None
    try:
        return parse_policies(docs)
    except PolicyError as exc:
        raise UsageError(f"--policy {path}: {'; '.join(exc.problems)}") from None


def _labels(items: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label {item!r}: use KEY=VALUE")
        out[key] = value
    return out


def _sim_keys(paths: Sequence[Path]) -> list[ec.EllipticCurvePublicKey]:
    keys = []
    for path in paths:
        try:
            keys.append(sim.load_platform_public_key(_read(path, "--sim-key")))
        except (AttestmeshError, ValueError) as exc:
            raise UsageError(f"--sim-key {path}: {exc}") from None
    return keys


def evaluate(args: argparse.Namespace, now: datetime) -> Outcome:
    """Everything but printing: read inputs, verify, appraise."""
    if (args.namespace is None) != (args.service_account is None):
        raise UsageError("--namespace and --service-account go together")
    if args.namespace is not None and args.policy is None:
        raise UsageError("--namespace/--service-account need --policy")
    at = parse_time(args.at) if args.at else now
    raw = _read(args.evidence, "evidence")
    collateral = _load_collateral(args.collateral, args.evidence) if args.collateral else {}
    policies = _load_policies(args.policy) if args.policy else None
    labels = _labels(args.label)
    try:
        roots = load_roots(args.roots)
    except CollateralError as exc:
        raise UsageError(f"--roots: {exc}") from None
    verifiers = registry.build_verifiers(roots, sim_keys=_sim_keys(args.sim_key))

    report: dict[str, Any] = {
        "evidence": str(args.evidence),
        "at": at.isoformat().replace("+00:00", "Z"),
        "collateral": sorted(collateral),
    }
    requested = None if args.tee == "auto" else Tee(args.tee)
    try:
        tee, evidence = select_evidence(raw, requested)
        report["tee"] = str(tee)
        verifier = verifiers.get(tee)
        if verifier is None:
            raise EvidenceVerificationError(
                "tee_unsupported", f"no {tee} verifier (sim needs --sim-key)"
            )
        claims = verifier.verify(evidence, now=at, collateral=collateral)
    except (EvidenceFormatError, EvidenceVerificationError, CollateralError) as exc:
        kind = {
            EvidenceFormatError: "format",
            EvidenceVerificationError: "verification",
            CollateralError: "collateral",
        }[type(exc)]
        report["valid"] = False
        report["error"] = {"kind": kind, "reason": exc.reason, "detail": exc.detail}
        return Outcome(EXIT_INVALID, report)
    report["valid"] = True
    report["claims"] = claims_to_doc(claims)  # the store's encoding, field for field
    if policies is None:
        return Outcome(EXIT_OK, report)
    if args.namespace is not None:
        governing = policies_for(policies, args.namespace, args.service_account, labels)
        report["identity"] = {
            "namespace": args.namespace,
            "service_account": args.service_account,
            "labels": labels,
        }
    else:
        governing = tuple(policies)
    decision = appraise_all(claims, governing, at)
    report["policy"] = decision_json(decision)
    return Outcome(EXIT_OK if isinstance(decision, Admitted) else EXIT_REJECTED, report)


def render_text(report: Mapping[str, Any], out: TextIO) -> None:
    w = out.write
    w(f"evidence:  {report['evidence']}\n")
    w(f"tee:       {report.get('tee', 'unknown')}\n")
    w(f"at:        {report['at']}\n")
    if report["collateral"]:
        w(f"collateral: {', '.join(report['collateral'])}\n")
    if not report["valid"]:
        err = report["error"]
        w(f"result:    INVALID ({err['kind']}): {err['reason']}\n")
        if err["detail"]:
            w(f"           {err['detail']}\n")
        return
    claims = report["claims"]
    w("result:    VALID\n")
    for key in ("debug", "evidence_sha256", "platform_id", "signer", "product_id", "svn"):
        if claims[key] is not None:
            w(f"{key}: {json.dumps(claims[key])}\n")
    w(f"report_data: {claims['report_data']}\n")
    if claims["tcb_status"] is not None:
        w(f"tcb_status: {claims['tcb_status']}\n")
    if claims["advisories"]:
        w(f"advisories: {', '.join(claims['advisories'])}\n")
    for section in ("measurements", "tcb", "details"):
        if claims[section]:
            w(f"{section}:\n")
            for key, value in claims[section].items():
                w(f"  {key}: {value}\n")
    policy = report.get("policy")
    if policy is not None:
        names = ", ".join(policy["policies"]) or "(none)"
        w(f"policy:    {policy['decision'].upper()} by {names}\n")
        for reason in policy["reasons"]:
            w(f"  - {reason}\n")


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run ``attestmesh verify``; returns the exit status (see the module docstring)."""
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        outcome = evaluate(args, datetime.now(UTC))
    except UsageError as exc:
        if args.json:
            out.write(json.dumps({"error": {"kind": "usage", "detail": str(exc)}}) + "\n")
        err.write(f"attestmesh verify: {exc}\n")
        return EXIT_USAGE
    if args.json:
        out.write(json.dumps(outcome.report, indent=2, sort_keys=True) + "\n")
    else:
        render_text(outcome.report, out)
    return outcome.status


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (``python -m attestmesh.verify_cmd``)."""
    parser = argparse.ArgumentParser(prog="attestmesh verify")
    configure(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage; ours is 3
        return EXIT_USAGE if exc.code else EXIT_OK
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
