"""A workload's certificate signing request, parsed strict: PEM, self-signature, P-256 key. Pure.

Below both its users: issuance (``certs.issuance`` checks the key binding against the CSR's key)
and the CA (``certs.ca`` signs that key).
"""

from __future__ import annotations

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import AttestmeshError


class CsrError(AttestmeshError):
    """A certificate signing request is malformed, badly signed, or has the wrong key."""


def parse_csr(pem: bytes) -> x509.CertificateSigningRequest:
    """Parse and check a CSR: PEM, self-signature valid, P-256 key."""
    return parse_csr_with_key(pem)[0]


def parse_csr_with_key(
    pem: bytes,
) -> tuple[x509.CertificateSigningRequest, ec.EllipticCurvePublicKey]:
    """``parse_csr``, and the key it checked (loading it again costs as much as the parse)."""
    try:
        csr = x509.load_pem_x509_csr(pem)
        key = csr.public_key()
    except (ValueError, x509.InvalidVersion) as exc:
        raise CsrError("csr_malformed", str(exc)) from None
    except UnsupportedAlgorithm:
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    try:
        signature_valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm):
        signature_valid = False
    if not signature_valid:
        raise CsrError("csr_signature_invalid", "the CSR is not signed by its own key")
    return csr, key


def csr_key(csr: x509.CertificateSigningRequest) -> ec.EllipticCurvePublicKey:
    """The CSR's P-256 public key (``parse_csr`` guarantees the type)."""
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise CsrError("csr_key_type", "the CSR key must be ECDSA P-256")
    return key


def spki_der(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


__all__ = ["CsrError", "csr_key", "parse_csr", "parse_csr_with_key", "spki_der"]
