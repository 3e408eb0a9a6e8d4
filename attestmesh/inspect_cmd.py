"""``attestmesh inspect CERT``: read a mesh certificate: its SPIFFE ID, the attestmesh claims
extension, and the attestation result in standard form (an EAR in a CMW extension), whose
signature is verified with the key of the CA certificate that issued the leaf.

CERT is a PEM file (a leaf, optionally followed by its chain, as the agent and the attestation
API hand it out) or one DER certificate. The issuing CA certificate is looked for in CERT's
chain and in ``--trust BUNDLE`` (PEM); it must have signed the leaf. With ``--trust``, the
issuer must also be in the bundle or be signed by a certificate in it ("anchored").

Exit status: 0 the EAR verified (and is anchored, with ``--trust``); 1 it is missing, invalid,
not about this certificate, or its issuer is unknown or not anchored; 2 bad input (unreadable
file, not a certificate).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes

from certs.ca import CLAIMS_OID, decode_claims_extension
from certs.ear import (
    CMW_OID,
    EAR_MEDIA_TYPE,
    EarError,
    ear_token_of,
    parse_jws,
    verify_certificate_ear,
)

EXIT_OK = 0
EXIT_UNVERIFIED = 1
EXIT_USAGE = 2
MAX_INPUT = 1024 * 1024


class InspectInputError(Exception):
    """CERT or the bundle cannot be read as certificates."""


@dataclass(frozen=True, slots=True)
class Inspection:
    report: dict[str, Any]
    verified: bool


def load_certificates(data: bytes, what: str) -> list[x509.Certificate]:
    """PEM (one or more certificates) or a single DER certificate."""
    if len(data) > MAX_INPUT:
        raise InspectInputError(f"{what} is larger than {MAX_INPUT} bytes")
    try:
        if b"-----BEGIN" in data:
            certs = x509.load_pem_x509_certificates(data)
        else:
            certs = [x509.load_der_x509_certificate(data)]
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise InspectInputError(f"{what} holds no readable X.509 certificate ({exc})") from None
    if not certs:
        raise InspectInputError(f"{what} holds no certificate")
    return certs


def _signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def _spiffe_ids(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith("spiffe://")]  # fmt: skip


def inspect_certificate(
    chain: list[x509.Certificate], trust: list[x509.Certificate] | None, now: datetime
) -> Inspection:
    """Decode the leaf (``chain[0]``) and verify its EAR. Pure: ``now`` only marks expiry."""
    leaf = chain[0]
    spiffe = _spiffe_ids(leaf)
    report: dict[str, Any] = {
        "serial": format(leaf.serial_number, "x"),
        "subject": leaf.subject.rfc4514_string(),
        "issuer": leaf.issuer.rfc4514_string(),
        "spiffe_id": spiffe[0] if len(spiffe) == 1 else spiffe or None,
        "not_before": leaf.not_valid_before_utc.isoformat(),
        "not_after": leaf.not_valid_after_utc.isoformat(),
        "expired": now >= leaf.not_valid_after_utc,
        "claims": None,
        "ear": None,
    }
    try:
        ext = leaf.extensions.get_extension_for_oid(CLAIMS_OID).value
        if isinstance(ext, x509.UnrecognizedExtension):
            report["claims"] = decode_claims_extension(ext.value)
    except x509.ExtensionNotFound:
        pass
    except (ValueError, IndexError):
        report["claims"] = {"error": "the claims extension does not decode"}

    candidates = [*chain[1:], *(trust or [])]
    issuer = next((c for c in candidates if _signed_by(leaf, c)), None)
    ear: dict[str, Any] = {
        "oid": CMW_OID.dotted_string,
        "media_type": EAR_MEDIA_TYPE,
        "verified": False,
        "signed_by": None if issuer is None else issuer.subject.rfc4514_string(),
        "anchored": None,
        "error": None,
        "header": None,
        "claims": None,
    }
    report["ear"] = ear
    try:
        ext_present = leaf.extensions.get_extension_for_oid(CMW_OID)
    except x509.ExtensionNotFound:
        ext_present = None
    if ext_present is None:
        ear["error"] = {"reason": "cmw_missing", "detail": "the certificate carries no EAR"}
        return Inspection(report, False)
    if issuer is None:
        ear["error"] = {
            "reason": "issuer_unknown",
            "detail": "no certificate in CERT's chain or --trust signed this leaf",
        }
        _show_unverified(leaf, ear)
        return Inspection(report, False)
    try:
        verified = verify_certificate_ear(leaf, issuer, spiffe[0] if len(spiffe) == 1 else None)
    except EarError as exc:
        ear["error"] = {"reason": exc.reason, "detail": exc.detail}
        _show_unverified(leaf, ear)
        return Inspection(report, False)
    ear["verified"] = True
    ear["header"] = dict(verified.header)
    ear["claims"] = dict(verified.claims)
    ear["status"] = verified.status.value
    x5t = verified.header.get("x5t#S256")
    ear["signer_matches_header"] = x5t is None or x5t == _x5t(issuer)
    ok = True
    if trust is not None:
        anchored = any(issuer == t or _signed_by(issuer, t) for t in trust)
        ear["anchored"] = anchored
        if not anchored:
            ear["error"] = {
                "reason": "issuer_not_anchored",
                "detail": "the issuing CA is neither in --trust nor signed by a certificate in it",
            }
            ok = False
    return Inspection(report, ok)


def _x5t(cert: x509.Certificate) -> str:
    return base64.urlsafe_b64encode(cert.fingerprint(hashes.SHA256())).rstrip(b"=").decode()


def _show_unverified(leaf: x509.Certificate, ear: dict[str, Any]) -> None:
    """Decode what can be decoded, marked unverified (for the operator, never trusted)."""
    try:
        header, claims, _, _ = parse_jws(ear_token_of(leaf))
    except (EarError, binascii.Error):
        return
    ear["unverified_header"] = header
    ear["unverified_claims"] = claims


def render_text(inspection: Inspection, out: TextIO) -> None:
    r = inspection.report
    w = out.write
    w(f"certificate  serial {r['serial']}{'  (EXPIRED)' if r['expired'] else ''}\n")
    w(f"  SPIFFE ID  {r['spiffe_id']}\n")
    w(f"  subject    {r['subject'] or '(empty)'}\n")
    w(f"  issuer     {r['issuer']}\n")
    w(f"  valid      {r['not_before']} .. {r['not_after']}\n")
    claims = r["claims"]
    w(f"claims extension ({CLAIMS_OID.dotted_string})\n")
    if claims is None:
        w("  (absent)\n")
    else:
        for k in sorted(claims):
            w(f"  {k:<16} {_short(claims[k])}\n")
    ear = r["ear"]
    w(f"attestation result (EAR in CMW extension {ear['oid']})\n")
    if ear["verified"]:
        w(f"  signature  verified with {ear['signed_by']}")
        if ear["anchored"] is not None:
            w("; anchored in --trust" if ear["anchored"] else "; NOT anchored in --trust")
        w("\n")
    else:
        err = ear["error"] or {}
        w(f"  signature  NOT VERIFIED: {err.get('reason')}: {err.get('detail')}\n")
    body = ear.get("claims") or ear.get("unverified_claims")
    if body is None:
        return
    if not ear["verified"]:
        w("  (claims below are unverified)\n")
    iat = body.get("iat")
    when = datetime.fromtimestamp(iat, UTC).isoformat() if isinstance(iat, int) else iat
    vid = body.get("ear.verifier-id") or {}
    w(f"  profile    {body.get('eat_profile')}\n")
    w(f"  issued at  {when}\n")
    w(f"  subject    {body.get('sub')}\n")
    if isinstance(vid, dict):
        w(f"  verifier   {vid.get('build')} ({vid.get('developer')})\n")
    w(f"  nonce      {body.get('eat_nonce')}\n")
    submods = body.get("submods")
    for label, appraisal in submods.items() if isinstance(submods, dict) else []:
        if not isinstance(appraisal, dict):
            continue
        w(f"  submod {label}\n")
        for k in sorted(appraisal):
            w(f"    {k:<34} {_short(appraisal[k])}\n")


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``inspect``; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "inspect",
        help="decode a mesh certificate and verify its attestation result (EAR)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("cert", type=Path, help="certificate file (PEM, chain allowed, or DER)")
    parser.add_argument("--trust", type=Path, metavar="BUNDLE", help="trust bundle (PEM)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        chain = load_certificates(_read(args.cert), str(args.cert))
        trust = None if args.trust is None else load_certificates(_read(args.trust), "--trust")
    except InspectInputError as exc:
        err.write(f"attestmesh inspect: {exc}\n")
        return EXIT_USAGE
    inspection = inspect_certificate(chain, trust, datetime.now(UTC))
    if args.json:
        out.write(json.dumps(inspection.report, indent=2, sort_keys=True) + "\n")
    else:
        render_text(inspection, out)
    return EXIT_OK if inspection.verified else EXIT_UNVERIFIED


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            return f.read(MAX_INPUT + 1)
    except OSError as exc:
        raise InspectInputError(f"cannot read {path}: {exc.strerror or exc}") from None
