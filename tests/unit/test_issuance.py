from __future__ import annotations

from datetime import UTC, timedelta
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, issue
from certs.csr import CsrError
from certs.ear import verify_certificate_ear
from certs.errors import EvidenceFormatError
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier, build_report
from certs.issuance import (
    Admission,
    AttestRequest,
    EvidenceRejected,
    Verified,
    decide,
    verify_request,
)
from certs.policy import Admitted, parse_policies
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    OTHER_MEASUREMENT,
    claims,
    csr_pem,
    new_key,
    policy_doc,
    spki,
)

PLATFORM = ec.generate_private_key(ec.SECP256R1())
VERIFIERS: Any = {Tee.SIM: SimVerifier([PLATFORM.public_key()])}
NONCE = bytes(range(32))


def _request(
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    bound_key: ec.EllipticCurvePrivateKey | None = None,
    nonce: bytes = NONCE,
    bound_nonce: bytes = NONCE,
    tee: str = "sim",
    evidence: bytes | None = None,
    csr: bytes | None = None,
    measurement: bytes = MEASUREMENT,
    debug: bool = False,
) -> AttestRequest:
    key = key or new_key()
    rd = expected_report_data(bound_nonce, spki(bound_key or key))
    if evidence is None:
        evidence = build_report(PLATFORM, report_data=rd, measurement=measurement, debug=debug)
    return AttestRequest("web-1", tee, evidence, csr if csr is not None else csr_pem(key), nonce)


def _rejected(req: AttestRequest, verifiers: Any = VERIFIERS) -> EvidenceRejected:
    with pytest.raises(EvidenceRejected) as info:
        verify_request(req, verifiers, NOW)
    return info.value


def test_verify_request_returns_the_csr_and_claims() -> None:
    key = new_key()
    verified = verify_request(_request(key=key), VERIFIERS, NOW)
    assert verified.csr.public_key() == key.public_key()
    assert verified.claims.tee is Tee.SIM
    assert verified.claims.measurements == {"measurement": MEASUREMENT.hex()}


def test_bad_csr_is_a_request_error_not_a_rejection() -> None:
    with pytest.raises(CsrError) as info:
        verify_request(_request(csr=b"garbage"), VERIFIERS, NOW)
    assert info.value.reason == "csr_malformed"


def test_unknown_tee() -> None:
    exc = _rejected(_request(tee="tpm"))
    assert (exc.reason, exc.tee) == ("tee_unknown", "unknown")


def test_tee_without_verifier_is_not_supported() -> None:
    exc = _rejected(_request(), verifiers={})
    assert (exc.reason, exc.tee) == ("tee_not_supported", Tee.SIM)
    exc = _rejected(_request(tee="tdx"))
    assert (exc.reason, exc.tee) == ("tee_not_supported", Tee.TDX)


def test_verifier_errors_keep_their_reason_and_cause() -> None:
    exc = _rejected(_request(evidence=b"AMSIM1\x00"))
    assert exc.reason == "truncated" and exc.tee == Tee.SIM
    assert isinstance(exc.__cause__, EvidenceFormatError)
    assert exc.reasons == (f"truncated: {exc.detail}",)
    other = ec.generate_private_key(ec.SECP256R1())
    exc = _rejected(_request(), verifiers={Tee.SIM: SimVerifier([other.public_key()])})
    assert exc.reason == "signature_invalid"


def test_evidence_bound_to_another_key_is_binding_mismatch() -> None:
    exc = _rejected(_request(bound_key=new_key()))
    assert exc.reason == "binding_mismatch" and exc.tee == Tee.SIM


def test_evidence_bound_to_another_nonce_is_binding_mismatch() -> None:
    exc = _rejected(_request(bound_nonce=bytes(32)))
    assert exc.reason == "binding_mismatch"


def _verified(**overrides: Any) -> Verified:
    return verify_request(_request(**overrides), VERIFIERS, NOW)


def test_decide_admits_with_the_governing_ttl() -> None:
    policies = parse_policies([policy_doc(certificateTTL="10m", reattestationInterval="5m")])
    verified = _verified()
    admission = decide(verified, policies, NOW)
    assert isinstance(admission.admitted, Admitted)
    assert admission.certificate_ttl == timedelta(minutes=10)
    assert admission.policy == "default/pol"
    assert admission.claims == verified.claims
    assert (admission.csr, admission.nonce) == (verified.csr, NONCE)


def test_decide_raises_with_every_reason() -> None:
    policies = parse_policies([policy_doc()])
    with pytest.raises(EvidenceRejected) as info:
        decide(
            _verified(debug=True, measurement=OTHER_MEASUREMENT),
            policies,
            NOW,
        )
    exc = info.value
    assert exc.reason == "debug_not_allowed" and exc.tee == Tee.SIM
    assert [r.split(":")[0] for r in exc.reasons] == [
        "debug_not_allowed",
        "measurement_not_allowed",
    ]


def test_decide_without_policy_is_no_policy() -> None:
    with pytest.raises(EvidenceRejected) as info:
        decide(_verified(), (), NOW)
    assert info.value.reason == "no_policy"


def test_decide_refuses_an_identity_governed_only_by_audit_policies() -> None:
    policies = parse_policies([policy_doc(mode="audit")])
    with pytest.raises(EvidenceRejected) as info:
        decide(_verified(), policies, NOW)  # evidence the audit policy itself would admit
    assert (info.value.reason, info.value.appraisal) == ("no_enforcing_policy", True)
    assert "default/pol" in info.value.detail


def test_only_verification_and_appraisal_make_verified_and_admission() -> None:
    """The CA's leaf path takes an Admission; neither it nor the Verified it comes from can be
    made from claims and a CSR that did not pass verify_request and decide."""
    verified = _verified()
    admission = decide(verified, parse_policies([policy_doc()]), NOW)
    with pytest.raises(TypeError, match="verify_request only"):
        Verified(object(), verified.csr, claims(), NONCE)
    with pytest.raises(TypeError, match="decide only"):
        Admission(object(), verified, admission.admitted)
    with pytest.raises(AttributeError):
        verified.claims = claims(debug=True)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        admission.csr = verified.csr  # type: ignore[misc]


def test_issue_signs_the_admitted_key_with_the_admitted_ttl(tmp_path: Any) -> None:
    key = new_key()
    verified = verify_request(_request(key=key), VERIFIERS, NOW)
    policies = parse_policies([policy_doc(certificateTTL="10m", reattestationInterval="5m")])
    admission = decide(verified, policies, NOW)
    ca = CertificateAuthority.load_or_create(tmp_path, "spiffe://td.test", NOW)
    leaf = issue(admission, ca, spiffe_id="spiffe://td.test/ns/a/sa/b", serial=77, now=NOW)
    assert leaf.cert.public_key() == key.public_key()
    assert (leaf.serial, leaf.not_after) == (77, NOW + timedelta(minutes=10))
    leaf.cert.verify_directly_issued_by(ca.intermediate.cert)
    assert leaf.chain_pem.endswith(ca.intermediate_pem)


@pytest.fixture(scope="module")
def module_ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(
        tmp_path_factory.mktemp("ca") / "ca", "spiffe://td.test", NOW
    )


@given(st.integers(min_value=0, max_value=10**6 - 1), st.integers(min_value=60, max_value=86_400))
@settings(max_examples=25, deadline=None)
def test_the_leaf_answer_is_what_its_certificate_says(
    module_ca: CertificateAuthority, microsecond: int, ttl_s: int
) -> None:
    """The issuance path reads nothing back from the DER it signed: the serial, notAfter
    (whole seconds, UTC) and chain it answers with are the certificate's own."""
    now = NOW.replace(microsecond=microsecond)
    spiffe = "spiffe://td.test/ns/a/sa/b"
    verified = verify_request(_request(), VERIFIERS, now)
    policies = parse_policies([policy_doc(certificateTTL=f"{ttl_s}s", reattestationInterval="1m")])
    leaf = issue(decide(verified, policies, now), module_ca, spiffe_id=spiffe, serial=99, now=now)
    cert = leaf.cert
    assert (leaf.serial, leaf.not_after) == (cert.serial_number, cert.not_valid_after_utc)
    assert leaf.not_after.tzinfo is UTC and leaf.not_after.microsecond == 0
    chain = cert.public_bytes(serialization.Encoding.PEM) + module_ca.intermediate_pem
    assert leaf.chain_pem == chain
    verify_certificate_ear(cert, module_ca.intermediate.cert, spiffe)
