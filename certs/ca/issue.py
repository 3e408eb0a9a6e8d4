"""The one way to a mesh leaf: ``issue(admission, ca, ...)``.

An ``Admission`` (``certs.issuance``) is made only by appraisal of verified evidence that binds
the CSR's key; ``issue`` fills the leaf template from it (SPIFFE ID, claims extension, claims
class, the attestation result as a CMW) and the CA's signing intermediate signs. Pure: serial
and time are arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509

from certs.ca.authority import CertificateAuthority
from certs.ca.claims import claims_class, encode_claims_extension
from certs.ca.der import certificate_pem
from certs.ca.templates import leaf_validity, sign_leaf
from certs.ear import VERIFIER_BUILD, build_ear, encode_cmw_extension, sign_ear
from certs.issuance import Admission


@dataclass(frozen=True, slots=True)
class Leaf:
    """A signed mesh leaf (its DER, serial number and notAfter) and the chain a workload
    presents (leaf, then its intermediate)."""

    der: bytes
    serial: int
    not_after: datetime
    chain_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        """The leaf parsed (the issuance path itself needs only the fields above)."""
        return x509.load_der_x509_certificate(self.der)


def issue(
    admission: Admission, ca: CertificateAuthority, *, spiffe_id: str, serial: int, now: datetime
) -> Leaf:
    """Sign the admitted CSR's key for ``spiffe_id`` with the CA's signing intermediate, for the
    admitting policy's certificate TTL (capped at the intermediate's notAfter)."""
    if not isinstance(admission, Admission):  # a look-alike passes duck typing, not this
        raise TypeError(f"issue takes an Admission (certs.issuance.decide), not {admission!r}")
    claims = admission.claims
    issuer = ca.intermediate
    ttl = admission.certificate_ttl
    _, not_after = leaf_validity(now, ttl, issuer.cert.not_valid_after_utc)
    spki = admission.spki
    ear = build_ear(
        claims,
        policy=admission.policy,
        spiffe_id=spiffe_id,
        subject_spki_der=spki,
        nonce=admission.nonce,
        now=now,
        verifier_build=VERIFIER_BUILD,
    )
    der = sign_leaf(
        spki,
        spiffe_id=spiffe_id,
        claims_extension=encode_claims_extension(claims, admission.policy, now),
        issuer=issuer,
        serial=serial,
        now=now,
        ttl=ttl,
        claims_class=claims_class(claims.tee.value, claims.measurements),
        # the attestation result, signed by the intermediate that signs the leaf
        cmw_extension=encode_cmw_extension(sign_ear(ear, issuer.key, issuer.cert)),
    )
    # (whole seconds: the certificate's notAfter is what the record and the answer carry)
    not_after = not_after.astimezone(UTC).replace(microsecond=0)
    return Leaf(der, serial, not_after, certificate_pem(der) + issuer.pem)


__all__ = ["Leaf", "issue"]
