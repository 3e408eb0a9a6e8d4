"""The seal on Verified and Admission against ordinary Python: a construction that skips
``verify_request``/``decide`` (``cls.__new__``, copyreg as pickle and copy use it), a changed
copy, a pickle, ``dataclasses.replace``, setting or deleting a slot. (Code that calls
``object.__new__`` and ``object.__setattr__`` on purpose is not stopped by any Python class;
in-process code can read the CA key anyway: the seal guards the leaf path against mistakes.)"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import pickle
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, issue
from certs.evidence.claims import Tee
from certs.evidence.sim import SimVerifier, build_report
from certs.issuance import Admission, AttestRequest, Verified, decide, verify_request
from certs.policy import parse_policies
from tests.unit.fixtures_core import MEASUREMENT, NOW, claims, csr_pem, new_key, policy_doc, spki

PLATFORM = ec.generate_private_key(ec.SECP256R1())
VERIFIERS: Any = {Tee.SIM: SimVerifier([PLATFORM.public_key()])}
NONCE = bytes(range(32))


def admitted() -> tuple[Verified, Admission]:
    key = new_key()
    rd = expected_report_data(NONCE, spki(key))
    evidence = build_report(PLATFORM, report_data=rd, measurement=MEASUREMENT)
    req = AttestRequest("web-1", "sim", evidence, csr_pem(key), NONCE)
    verified = verify_request(req, VERIFIERS, NOW)
    return verified, decide(verified, parse_policies([policy_doc()]), NOW)


@pytest.mark.parametrize("cls", [Verified, Admission])
def test_no_instance_without_the_seal_through_new(cls: type[Any]) -> None:
    with pytest.raises(TypeError):
        cls.__new__(cls)
    with pytest.raises(TypeError):
        copyreg.__newobj__(cls)  # type: ignore[attr-defined]  # what pickle and copy call


def test_a_sealed_value_cannot_be_changed_or_emptied() -> None:
    verified, admission = admitted()
    forged_claims = claims(debug=True)
    for obj, slot, value in (
        (verified, "_claims", forged_claims),
        (verified, "_nonce", bytes(32)),
        (admission, "_admitted", admission.admitted),
        (admission, "_verified", verified),
    ):
        with pytest.raises(AttributeError):
            setattr(obj, slot, value)
        with pytest.raises(AttributeError):
            delattr(obj, slot)
    assert verified.claims is not forged_claims and verified.nonce == NONCE


def test_copies_are_the_same_decision_and_pickles_are_refused() -> None:
    verified, admission = admitted()
    for obj in (verified, admission):
        assert copy.copy(obj) is obj and copy.deepcopy(obj) is obj  # immutable: itself
        with pytest.raises(TypeError):
            pickle.dumps(obj)
        with pytest.raises(TypeError):
            dataclasses.replace(obj)  # type: ignore[type-var]


def test_no_subclass_and_no_look_alike_reaches_the_ca(tmp_path: Any) -> None:
    """A subclass could override __new__ and the properties; a look-alike with the same
    attributes is duck-typed Python: the CA's leaf path takes neither."""
    with pytest.raises(TypeError):

        class Forged(Admission):  # type: ignore[misc]
            pass

    with pytest.raises(TypeError):

        class AlsoForged(Verified):  # type: ignore[misc]
            pass

    _, admission = admitted()
    look_alike = type("LookAlike", (), {k: getattr(admission, k) for k in (
        "admitted", "csr", "nonce", "claims", "policy", "certificate_ttl",
    )})()  # fmt: skip
    ca = CertificateAuthority.load_or_create(tmp_path, "spiffe://td.test", NOW)
    with pytest.raises(TypeError):
        issue(look_alike, ca, spiffe_id="spiffe://td.test/ns/a/sa/b", serial=7, now=NOW)
    leaf = issue(admission, ca, spiffe_id="spiffe://td.test/ns/a/sa/b", serial=7, now=NOW)
    assert leaf.serial == 7


def test_the_sealed_claims_cannot_be_changed_through_their_mappings() -> None:
    verified, admission = admitted()
    for mapping in (admission.claims.measurements, admission.claims.tcb, verified.claims.details):
        with pytest.raises(TypeError):
            mapping["measurement"] = "00" * 32  # type: ignore[index]
    assert admission.claims.measurements == {"measurement": MEASUREMENT.hex()}
