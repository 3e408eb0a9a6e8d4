"""The one way to a mesh leaf: ``issue(admission, ca, ...)``.

An ``Admission`` (``certs.issuance``) is made only by appraisal of verified evidence that binds
the CSR's key; ``issue`` fills the leaf template from it (SPIFFE ID, claims extension, claims
class, the attestation result as a CMW) and the CA's signing intermediate signs. Pure: serial
and time are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from cryptography import x509

from certs.ca.authority import CertificateAuthority
from certs.ca.claims import claims_class, encode_claims_extension
from certs.ca.templates import build_leaf
from certs.ear import build_ear_extension
from certs.issuance import Admission


@dataclass(frozen=True, slots=True)
class Leaf:
    """A signed mesh leaf and the chain a workload presents (leaf, then its intermediate)."""

    cert: x509.Certificate
    chain_pem: bytes

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    @property
    def not_after(self) -> datetime:
        return self.cert.not_valid_after_utc


def issue(
    admission: Admission, ca: CertificateAuthority, *, spiffe_id: str, serial: int, now: datetime
) -> Leaf:
    """Sign the admitted CSR's key for ``spiffe_id`` with the CA's signing intermediate, for the
    admitting policy's certificate TTL (capped at the intermediate's notAfter)."""
    if not isinstance(admission, Admission):  # a look-alike passes duck typing, not this
        raise TypeError(f"issue takes an Admission (certs.issuance.decide), not {admission!r}")
    claims = admission.claims
    issuer = ca.intermediate
    cert = build_leaf(
        admission.csr,
        spiffe_id=spiffe_id,
        claims_extension=encode_claims_extension(claims, admission.policy, now),
        issuer=issuer,
        serial=serial,
        now=now,
        ttl=admission.certificate_ttl,
        claims_class=claims_class(claims.tee.value, claims.measurements),
        cmw_extension=build_ear_extension(
            claims,
            policy=admission.policy,
            spiffe_id=spiffe_id,
            subject_key=admission.csr.public_key(),
            nonce=admission.nonce,
            issuer=issuer,
            now=now,
        ),
    )
    return Leaf(cert, ca.chain_pem(cert, issuer))  # it signed the leaf just now


__all__ = ["Leaf", "issue"]
