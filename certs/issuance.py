"""Verify, bind, appraise: the path from raw evidence to an ``Admitted`` value. Pure.

The CA never sees raw evidence: it receives the CSR and an ``Admitted`` decision only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import binding_matches
from certs.ca import parse_csr, spki_der
from certs.errors import AttestmeshError
from certs.evidence.claims import Claims, Tee, Verifier
from certs.policy import Admitted, AttestationPolicy, Rejected, appraise_all


class IdentityError(AttestmeshError):
    """The caller could not prove it is the workload it claims to be."""


class EvidenceRejected(AttestmeshError):
    """The workload's own evidence failed: verification, key binding or policy.

    Unlike request errors (CSR, nonce, identity), this failure counts against the workload:
    a failed re-attestation of an attested workload quarantines it. ``appraisal`` tells a
    policy rejection (authentic evidence the policy does not admit) from a failed verification.
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        tee: str,
        reasons: tuple[str, ...] = (),
        *,
        appraisal: bool = False,
    ) -> None:
        super().__init__(reason, detail)
        self.tee = tee
        self.reasons = reasons or (f"{reason}: {detail}",)
        self.appraisal = appraisal


@dataclass(frozen=True, slots=True)
class AttestRequest:
    workload: str
    tee: str
    evidence: bytes
    csr_pem: bytes
    nonce: bytes
    collateral: Mapping[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Verified:
    csr: x509.CertificateSigningRequest
    claims: Claims


def verify_request(
    req: AttestRequest, verifiers: Mapping[Tee, Verifier], now: datetime
) -> Verified:
    """CSR, evidence authenticity, and the key binding. Raises CsrError or EvidenceRejected."""
    csr = parse_csr(req.csr_pem)
    try:
        tee = Tee(req.tee)
    except ValueError:
        raise EvidenceRejected("tee_unknown", f"unknown TEE {req.tee!r}", "unknown") from None
    verifier = verifiers.get(tee)
    if verifier is None:
        raise EvidenceRejected("tee_not_supported", f"no verifier configured for {tee}", tee)
    try:
        claims = verifier.verify(req.evidence, now=now, collateral=req.collateral)
    except AttestmeshError as exc:
        raise EvidenceRejected(exc.reason, exc.detail, tee) from exc
    key = csr.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)  # parse_csr guarantees it
    if not binding_matches(claims.report_data, req.nonce, spki_der(key)):
        raise EvidenceRejected(
            "binding_mismatch",
            "report data does not bind this nonce and the CSR's public key",
            tee,
        )
    return Verified(csr, claims)


def decide(verified: Verified, governing: Sequence[AttestationPolicy], now: datetime) -> Admitted:
    """Appraise; only an Admitted value comes out, a rejection raises EvidenceRejected."""
    decision = appraise_all(verified.claims, governing, now)
    if isinstance(decision, Rejected):
        raise EvidenceRejected(
            decision.reason,
            "; ".join(decision.reasons),
            verified.claims.tee,
            decision.reasons,
            appraisal=True,
        )
    return decision
