"""Verify, bind, appraise: the path from raw evidence to an ``Admission``. Pure.

The CA never sees raw evidence: its one leaf path (``certs.ca.issue``) takes an ``Admission``,
and only this module makes one. ``verify_request`` returns a ``Verified`` (the CSR whose key the
evidence binds, with this request's nonce, and the verified claims); ``decide`` appraises it and
returns an ``Admission`` (that CSR and nonce with the policy's ``Admitted`` decision) or raises.
Neither type has a public constructor: each takes a module-private seal, so a leaf cannot be
signed for a key or claims that did not come this way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import ClassVar, NoReturn, Self, SupportsIndex, final

from cryptography import x509

from certs.binding import binding_matches
from certs.csr import csr_key, parse_csr_with_key, spki_der
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


_SEAL = object()  # only this module constructs Verified and Admission


class _Sealed:
    """Made only with the seal, never changed. The ordinary ways around ``__init__`` are
    closed: ``cls.__new__`` (what pickle and copy reconstruct with) needs the seal, slots
    cannot be set or deleted, a copy is the value itself (it is immutable), pickling is
    refused. (``object.__new__`` with ``object.__setattr__`` is deliberate circumvention no
    Python class stops; the seal guards the leaf path against mistakes, not in-process code,
    which could read the CA key anyway.)"""

    __slots__ = ()
    _made_by: ClassVar[str] = ""

    def __init_subclass__(cls) -> None:  # Verified and Admission only: a subclass could
        super().__init_subclass__()  # override __new__ and the properties
        if cls.__module__ != __name__ or _Sealed not in cls.__bases__:
            raise TypeError(f"{cls.__name__}: the sealed types of certs.issuance are final")

    def __new__(cls, seal: object, *args: object) -> Self:
        if seal is not _SEAL:
            raise TypeError(f"{cls.__name__} comes from certs.issuance.{cls._made_by} only")
        return super().__new__(cls)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is not pickled: verify again")


@final
class Verified(_Sealed):
    """Evidence that verified to its vendor root and binds ``nonce`` and the CSR's key."""

    __slots__ = ("_claims", "_csr", "_nonce", "_spki")
    _made_by: ClassVar[str] = "verify_request"
    _csr: x509.CertificateSigningRequest
    _claims: Claims
    _nonce: bytes
    _spki: bytes

    def __init__(
        self,
        seal: object,
        csr: x509.CertificateSigningRequest,
        claims: Claims,
        nonce: bytes,
        spki: bytes | None = None,
    ) -> None:
        object.__setattr__(self, "_csr", csr)
        object.__setattr__(self, "_claims", claims)
        object.__setattr__(self, "_nonce", nonce)
        object.__setattr__(self, "_spki", spki if spki is not None else spki_der(csr_key(csr)))

    @property
    def csr(self) -> x509.CertificateSigningRequest:
        return self._csr

    @property
    def spki(self) -> bytes:
        """The CSR's key as a DER SubjectPublicKeyInfo (what the evidence binds)."""
        return self._spki

    @property
    def claims(self) -> Claims:
        return self._claims

    @property
    def nonce(self) -> bytes:
        return self._nonce


@final
class Admission(_Sealed):
    """The issuance decision: the verified CSR and nonce, and the policy's ``Admitted`` for its
    claims. What the CA's ``issue`` takes; made by ``decide`` only."""

    __slots__ = ("_admitted", "_verified")
    _made_by: ClassVar[str] = "decide"
    _verified: Verified
    _admitted: Admitted

    def __init__(self, seal: object, verified: Verified, admitted: Admitted) -> None:
        object.__setattr__(self, "_verified", verified)
        object.__setattr__(self, "_admitted", admitted)

    @property
    def admitted(self) -> Admitted:
        return self._admitted

    @property
    def csr(self) -> x509.CertificateSigningRequest:
        return self._verified.csr

    @property
    def spki(self) -> bytes:
        return self._verified.spki

    @property
    def nonce(self) -> bytes:
        return self._verified.nonce

    @property
    def claims(self) -> Claims:
        return self.admitted.claims

    @property
    def policy(self) -> str:
        return self.admitted.policy

    @property
    def certificate_ttl(self) -> timedelta:
        return self.admitted.certificate_ttl


def verify_request(
    req: AttestRequest, verifiers: Mapping[Tee, Verifier], now: datetime
) -> Verified:
    """CSR, evidence authenticity, and the key binding. Raises CsrError or EvidenceRejected."""
    csr, key = parse_csr_with_key(req.csr_pem)
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
    spki = spki_der(key)
    if not binding_matches(claims.report_data, req.nonce, spki):
        raise EvidenceRejected(
            "binding_mismatch",
            "report data does not bind this nonce and the CSR's public key",
            tee,
        )
    return Verified(_SEAL, csr, read_only_claims(claims), req.nonce, spki)


def read_only_claims(claims: Claims) -> Claims:
    """The claims with read-only mappings: a sealed value's claims cannot be changed between
    verification, appraisal and the leaf either (``claims.measurements[k] = v``)."""
    return replace(
        claims,
        measurements=MappingProxyType(dict(claims.measurements)),
        tcb=MappingProxyType(dict(claims.tcb)),
        details=MappingProxyType(dict(claims.details)),
    )


def decide(verified: Verified, governing: Sequence[AttestationPolicy], now: datetime) -> Admission:
    """Appraise; only an Admission comes out, a rejection raises EvidenceRejected."""
    decision = appraise_all(verified.claims, governing, now)
    if isinstance(decision, Rejected):
        raise EvidenceRejected(
            decision.reason,
            "; ".join(decision.reasons),
            verified.claims.tee,
            decision.reasons,
            appraisal=True,
        )
    return Admission(_SEAL, verified, decision)
