"""Verifier conformance: one checklist, run over every registered verifier.

The per-TEE test files go deep into each format; this file proves the *uniform* behaviour in one
place. Every case (``conformance_cases``) is a real vector at its README pin time (sim: a report
built here) and every check is parametrized by TEE:

1. the vector verifies through ``build_verifiers(bundled_roots(), sim_keys=...)`` and
   ``detect_tee`` names its TEE;
2. a flipped byte in each listed signed region fails with the exact error and reason (a
   signature-class reason, or the exact format reason where the flip breaks parsing);
3. a flipped byte in the signature fails with the signature reason; a flipped byte the format
   reserves outside the signed bytes (SEV-SNP's signature field after R and S) is a format error;
   a flipped byte in a certificate the evidence carries is a project error, exactly as listed;
4. truncation (0, 1, half, end of the signed structure - 1) is an EvidenceFormatError only;
5. a wrong root fails with the exact reason the verifier's design gives;
6. a time outside the validity window fails with the exact expiry reason;
7. a debug TEE is rejected by a policy with ``allowDebug: false`` (debug_not_allowed);
8. a TCB below the policy's minimum is rejected (tcb_below_minimum / tcb_status_not_accepted);
9. the vector's report data does not bind a fresh nonce and key (sim: it binds the one it was
   built with);
10. the reasons of 2/3/5/6 are distinct from each other where the TEE can tell them apart.

A check that does not apply to a TEE is an ``Absence`` with a proof, never a skip. Behaviour
that differs from the uniform contract is a strict xfail naming the verifier's file and line.
"""

from __future__ import annotations

import dataclasses
import secrets
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import binding_matches
from certs.collateral.roots import bundled_roots
from certs.errors import AttestmeshError, EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Tee, Verifier, evidence_digest
from certs.evidence.registry import build_verifiers, detect_tee
from certs.policy import Admitted, AttestationPolicy, Rejected, appraise, parse_policies
from tests.unit.evidence.conformance_cases import (
    SIGNATURE_CLASS,
    Case,
    Flip,
    OutOfWindow,
    Subject,
    all_cases,
    sim_keys,
)
from tests.unit.fixtures_core import policy_doc

CASES = all_cases()

_verifiers: dict[int, Mapping[Tee, Verifier]] = {}


def _registry(subject: Subject) -> Mapping[Tee, Verifier]:
    """The registry anchored at the subject's roots (built once per subject)."""
    key = id(subject)
    if key not in _verifiers:
        _verifiers[key] = build_verifiers(subject.roots, sim_keys=subject.sim_keys or None)
    return _verifiers[key]


def _verify(case: Case, subject: Subject, evidence: bytes | None = None, **kw: Any) -> Claims:
    verifier = _registry(subject)[case.tee]
    return verifier.verify(
        subject.evidence if evidence is None else evidence,
        now=kw.get("now", subject.now),
        collateral=kw.get("collateral", subject.collateral),
    )


def _flipped(evidence: bytes, flip: Flip) -> bytes:
    out = bytearray(evidence)
    out[flip.offset] ^= flip.mask
    return bytes(out)


def _policy(
    case: Case, refs: Mapping[str, object], *, allow_debug: bool | None = None
) -> AttestationPolicy:
    doc = policy_doc(tees=[case.tee.value], refs={case.section: dict(refs)})
    if allow_debug is not None:
        doc["spec"]["allowDebug"] = allow_debug
    return parse_policies([doc])[0]


def _codes(decision: Admitted | Rejected) -> tuple[str, ...]:
    assert isinstance(decision, Rejected), decision
    return tuple(r.split(":", 1)[0] for r in decision.reasons)


def _same_facts(a: Claims, b: Claims) -> bool:
    """Equal claims apart from the evidence digest and the count of tolerated trailing bytes."""

    def strip(c: Claims) -> Claims:
        details = {k: v for k, v in c.details.items() if k != "trailing_bytes"}
        return dataclasses.replace(c, evidence_sha256="", details=details)

    return strip(a) == strip(b)


def _ids(case: Case) -> str:
    return case.tee.value


def _params(attr: str) -> Iterator[Any]:
    """One pytest.param per (case, item of ``case.<attr>``), strict xfail where documented."""
    for case in CASES:
        for item in getattr(case, attr):
            if isinstance(item, OutOfWindow):
                name = f"{item.reason}@{item.now:%Y-%m-%dT%H:%M:%SZ}"
            else:
                name = str(getattr(item, "region", "") or getattr(item, "name", "") or item.check)
            marks: list[pytest.MarkDecorator] = []
            if isinstance(item, Flip) and item.escapes is not None:
                marks.append(
                    pytest.mark.xfail(
                        strict=True,
                        raises=item.escapes,
                        reason=f"{item.escapes.__name__} escapes at {item.site}",
                    )
                )
            if isinstance(item, Flip) and item.accepted:
                marks.append(
                    pytest.mark.xfail(
                        strict=True, raises=pytest.fail.Exception, reason=item.accepted
                    )
                )
            yield pytest.param(case, item, id=f"{case.tee.value}-{name}", marks=marks)


def _expect(
    case: Case,
    subject: Subject,
    evidence: bytes,
    error: type[AttestmeshError],
    reason: str,
    **kw: Any,
) -> None:
    with pytest.raises(AttestmeshError) as info:
        _verify(case, subject, evidence, **kw)
    assert (type(info.value), info.value.reason) == (error, reason), info.value.detail


# ---------------------------------------------------------------------------------------------
# the table covers the registry


def test_one_case_per_registered_tee() -> None:
    registered = build_verifiers(bundled_roots(), sim_keys=sim_keys())
    assert [c.tee for c in CASES] == [
        Tee.NITRO,
        Tee.NVIDIA_GPU,
        Tee.SEV_SNP,
        Tee.TDX,
        Tee.SGX,
        Tee.SIM,
    ]
    assert set(registered) == {c.tee for c in CASES} == set(Tee)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_check_is_covered_or_documented_absent(case: Case) -> None:
    absent = {a.check for a in case.absences}
    assert case.debug is not None or "debug" in absent
    assert case.tcb is not None or "tcb" in absent
    assert case.out_of_window or "window" in absent
    assert any(o.reason.endswith("_expired") for o in case.out_of_window) or (
        absent & {"window", "expiry"}
    )
    assert case.refs is not None or "policy_refs" in absent
    assert case.signed_flips and case.signature_flips and case.wrong_roots
    assert {n for n, _ in case.truncations} >= {0, 1, len(case.subject.evidence) // 2}


@pytest.mark.parametrize(("case", "absence"), list(_params("absences")))
def test_documented_absence_is_real(case: Case, absence: Any) -> None:
    absence.proof()


# ---------------------------------------------------------------------------------------------
# 1. the real vector verifies at its pin time and is detected


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_vector_verifies_at_pin_and_is_detected(case: Case) -> None:
    evidence = case.subject.evidence
    assert detect_tee(evidence) is case.tee
    registry = build_verifiers(bundled_roots(), sim_keys=list(sim_keys()))
    verifier = registry[detect_tee(evidence)]
    assert verifier.tee is case.tee
    claims = verifier.verify(evidence, now=case.subject.now, collateral=case.subject.collateral)
    assert claims.tee is case.tee
    assert claims.evidence_sha256 == evidence_digest(evidence)
    for form in case.other_forms:
        assert detect_tee(form) is case.tee
        again = verifier.verify(form, now=case.subject.now, collateral=case.subject.collateral)
        assert again == dataclasses.replace(claims, evidence_sha256=evidence_digest(form))
    if case.refs is not None:  # the README's reference values admit it
        decision = appraise(claims, _policy(case, case.refs), case.subject.now)
        assert isinstance(decision, Admitted), decision


# ---------------------------------------------------------------------------------------------
# 2. / 3. flipped bytes


@pytest.mark.parametrize(("case", "flip"), list(_params("signed_flips")))
def test_flipped_signed_byte_is_refused(case: Case, flip: Flip) -> None:
    if flip.error is EvidenceVerificationError:
        assert flip.reason in SIGNATURE_CLASS
    _expect(case, case.subject, _flipped(case.subject.evidence, flip), flip.error, flip.reason)


@pytest.mark.parametrize(("case", "flip"), list(_params("signature_flips")))
def test_flipped_signature_byte_is_signature_invalid(case: Case, flip: Flip) -> None:
    assert (flip.error, flip.reason) == (EvidenceVerificationError, "signature_invalid")
    _expect(case, case.subject, _flipped(case.subject.evidence, flip), flip.error, flip.reason)


@pytest.mark.parametrize(("case", "flip"), list(_params("embedded_flips")))
def test_flipped_byte_in_an_embedded_certificate(case: Case, flip: Flip) -> None:
    """Certificates carried inside the evidence (Nitro cabundle, DCAP PCK chain): a flip must
    end in the exact project error; no foreign exception and no warning (made an error here
    whatever the test config says) may escape."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _expect(case, case.subject, _flipped(case.subject.evidence, flip), flip.error, flip.reason)


@pytest.mark.parametrize(("case", "flip"), list(_params("reserved_flips")))
def test_flipped_reserved_byte_is_a_format_error(case: Case, flip: Flip) -> None:
    """Bytes the format reserves (must be zero) outside any signature: a non-zero value is a
    format error, never accepted (SEV-SNP: the signature field after R and S)."""
    assert flip.error is EvidenceFormatError
    _expect(case, case.subject, _flipped(case.subject.evidence, flip), flip.error, flip.reason)


# ---------------------------------------------------------------------------------------------
# 4. truncation; the documented unsigned tails


@pytest.mark.parametrize(
    ("case", "length", "reason"),
    [pytest.param(c, n, r, id=f"{c.tee.value}-{n}") for c in CASES for n, r in c.truncations],
)
def test_truncation_is_a_format_error_only(case: Case, length: int, reason: str) -> None:
    evidence = case.subject.evidence
    assert length < len(evidence) - case.unsigned_trailer
    with pytest.raises(EvidenceFormatError) as info:
        _verify(case, case.subject, evidence[:length])
    assert info.value.reason == reason


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_appended_byte_and_unsigned_trailer(case: Case) -> None:
    """Nitro, SEV-SNP and sim refuse any extra byte; Intel DCAP (up to 4096) and NVIDIA (up to
    16) tolerate unsigned bytes after the signature by documented design, and a TDX vector ships
    70 of them: cutting into them still verifies, to the same claims."""
    evidence = case.subject.evidence
    claims = _verify(case, case.subject)
    if case.appended_byte is None:
        assert _same_facts(_verify(case, case.subject, evidence + b"\x00"), claims)
    else:
        with pytest.raises(EvidenceFormatError) as info:
            _verify(case, case.subject, evidence + b"\x00")
        assert info.value.reason == case.appended_byte
    if case.unsigned_trailer:
        for cut in (len(evidence) - case.unsigned_trailer, len(evidence) - 1):
            assert _same_facts(_verify(case, case.subject, evidence[:cut]), claims)


# ---------------------------------------------------------------------------------------------
# 5. wrong root; 6. outside the window


@pytest.mark.parametrize(("case", "wrong"), list(_params("wrong_roots")))
def test_wrong_root(case: Case, wrong: Any) -> None:
    verifier = build_verifiers(
        wrong.roots, sim_keys=list(wrong.sim_keys or case.subject.sim_keys) or None
    )[case.tee]
    with pytest.raises(AttestmeshError) as info:
        verifier.verify(
            case.subject.evidence, now=case.subject.now, collateral=case.subject.collateral
        )
    assert (type(info.value), info.value.reason) == (EvidenceVerificationError, wrong.reason)


@pytest.mark.parametrize(("case", "outside"), list(_params("out_of_window")))
def test_time_outside_the_window(case: Case, outside: Any) -> None:
    _expect(
        case,
        case.subject,
        case.subject.evidence,
        EvidenceVerificationError,
        outside.reason,
        now=outside.now,
    )


# ---------------------------------------------------------------------------------------------
# 7. debug; 8. TCB


@pytest.mark.parametrize("case", [c for c in CASES if c.debug is not None], ids=_ids)
def test_debug_is_rejected_where_policy_forbids_it(case: Case) -> None:
    assert case.debug is not None
    assert _verify(case, case.subject).debug is False  # the main vector is production
    claims = _verify(case, case.debug.subject)
    assert claims.debug is True, case.debug.origin
    now = case.debug.subject.now
    strict = _policy(case, case.debug.refs, allow_debug=False)
    assert _codes(appraise(claims, strict, now)) == ("debug_not_allowed",)
    lenient = _policy(case, case.debug.refs, allow_debug=True)
    assert isinstance(appraise(claims, lenient, now), Admitted)


@pytest.mark.parametrize("case", [c for c in CASES if c.tcb is not None], ids=_ids)
def test_tcb_below_the_policy_minimum_is_rejected(case: Case) -> None:
    assert case.tcb is not None and case.refs is not None
    claims = _verify(case, case.subject)
    now = case.subject.now
    assert isinstance(appraise(claims, _policy(case, case.refs), now), Admitted)
    below = _policy(case, {**case.refs, **case.tcb.refs})
    assert _codes(appraise(claims, below, now)) == (case.tcb.reason,)


@pytest.mark.parametrize("case", [c for c in CASES if c.tcb_verifier is not None], ids=_ids)
def test_tcb_the_verifier_itself_refuses(case: Case) -> None:
    assert case.tcb_verifier is not None
    subject, reason = case.tcb_verifier
    _expect(case, subject, subject.evidence, EvidenceVerificationError, reason)


# ---------------------------------------------------------------------------------------------
# 9. binding


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_report_data_does_not_bind_a_fresh_challenge(case: Case) -> None:
    claims = _verify(case, case.subject)
    spki = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    assert not binding_matches(claims.report_data, secrets.token_bytes(32), spki)
    if case.binding is not None:
        nonce, bound_spki = case.binding
        assert binding_matches(claims.report_data, nonce, bound_spki)
        assert not binding_matches(claims.report_data, secrets.token_bytes(32), bound_spki)
        assert not binding_matches(claims.report_data, nonce, spki)


# ---------------------------------------------------------------------------------------------
# 10. distinct reasons


def _reason(case: Case, verifier: Verifier, evidence: bytes, **kw: Any) -> str:
    try:
        verifier.verify(
            evidence,
            now=kw.get("now", case.subject.now),
            collateral=case.subject.collateral,
        )
    except EvidenceVerificationError as exc:
        return exc.reason
    raise AssertionError("verified")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_failure_families_have_distinct_reasons(case: Case) -> None:
    verifier = _registry(case.subject)[case.tee]
    flips = [
        f
        for f in (*case.signed_flips, *case.signature_flips)
        if f.error is EvidenceVerificationError and not f.accepted and f.escapes is None
    ]
    signature = {_reason(case, verifier, _flipped(case.subject.evidence, f)) for f in flips}
    root = set()
    for wrong in case.wrong_roots:
        other = build_verifiers(
            wrong.roots, sim_keys=list(wrong.sim_keys or case.subject.sim_keys) or None
        )[case.tee]
        root.add(_reason(case, other, case.subject.evidence))
    time = {_reason(case, verifier, case.subject.evidence, now=o.now) for o in case.out_of_window}
    assert signature <= SIGNATURE_CLASS
    assert len(signature | root | time) == case.distinct, (signature, root, time)
    for a, b in ((signature, root), (signature, time), (root, time)):
        assert a & b <= case.shared, (a, b)
