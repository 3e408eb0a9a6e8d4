from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence import sim
from certs.evidence.claims import Tee, evidence_digest
from certs.evidence.sim import MAGIC, SIG_LEN, SimVerifier, build_report, parse_report
from tests.unit.fixtures_core import NOW

PLATFORM_KEY = ec.generate_private_key(ec.SECP256R1())
OTHER_KEY = ec.generate_private_key(ec.SECP256R1())
REPORT_DATA = bytes(range(64))
MEASUREMENT = bytes(range(100, 148))
VALID = build_report(PLATFORM_KEY, report_data=REPORT_DATA, measurement=MEASUREMENT, svn=7)
HEADER = len(MAGIC) + 2
ERRORS = (EvidenceFormatError, EvidenceVerificationError)


def _verify(evidence: bytes, keys: list[Any] | None = None) -> Any:
    verifier = SimVerifier(keys or [PLATFORM_KEY.public_key()])
    return verifier.verify(evidence, now=NOW, collateral={})


def _frame(body: bytes, signature: bytes = bytes(SIG_LEN)) -> bytes:
    return MAGIC + struct.pack(">H", len(body)) + body + signature


def _body(**fields: Any) -> bytes:
    doc: dict[str, Any] = {
        "debug": False,
        "measurement": MEASUREMENT.hex(),
        "platform": "p",
        "report_data": REPORT_DATA.hex(),
        "svn": 1,
    }
    doc.update(fields)
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


def test_round_trip_gives_claims() -> None:
    assert sim.looks_like(VALID)
    report = parse_report(VALID)
    assert (report.measurement, report.report_data, report.svn) == (MEASUREMENT, REPORT_DATA, 7)
    assert report.debug is False and report.platform == "sim-platform"
    assert len(report.signature) == SIG_LEN and report.signed + report.signature == VALID
    claims = _verify(VALID)
    assert claims.tee is Tee.SIM
    assert claims.measurements == {"measurement": MEASUREMENT.hex()}
    assert claims.report_data == REPORT_DATA
    assert claims.debug is False
    assert claims.svn == 7 and claims.platform_id == "sim-platform"
    assert claims.evidence_sha256 == evidence_digest(VALID)
    assert SimVerifier([PLATFORM_KEY.public_key()]).tee is Tee.SIM


def test_debug_flag_and_platform_are_reported() -> None:
    evidence = build_report(
        PLATFORM_KEY, report_data=REPORT_DATA, measurement=MEASUREMENT, debug=True, platform="x"
    )
    claims = _verify(evidence)
    assert claims.debug is True and claims.platform_id == "x"


def test_any_configured_platform_key_verifies() -> None:
    assert _verify(VALID, [OTHER_KEY.public_key(), PLATFORM_KEY.public_key()]).svn == 7


def test_wrong_platform_key_is_signature_invalid() -> None:
    with pytest.raises(EvidenceVerificationError) as info:
        _verify(VALID, [OTHER_KEY.public_key()])
    assert info.value.reason == "signature_invalid"


def test_a_verifier_needs_a_key() -> None:
    with pytest.raises(ValueError, match="at least one platform key"):
        SimVerifier([])


def test_build_report_checks_lengths() -> None:
    with pytest.raises(ValueError, match="report_data must be 64 bytes"):
        build_report(PLATFORM_KEY, report_data=bytes(32), measurement=MEASUREMENT)
    with pytest.raises(ValueError, match="measurement 48 bytes"):
        build_report(PLATFORM_KEY, report_data=REPORT_DATA, measurement=bytes(32))


def test_every_flipped_byte_is_refused_precisely() -> None:
    seen: dict[str, set[str]] = {"magic": set(), "length": set(), "body": set(), "sig": set()}
    for index in range(len(VALID)):
        evidence = bytearray(VALID)
        evidence[index] ^= 0x01
        with pytest.raises(ERRORS) as info:
            _verify(bytes(evidence))
        if index < len(MAGIC):
            region = "magic"
        elif index < HEADER:
            region = "length"
        elif index < len(VALID) - SIG_LEN:
            region = "body"
        else:
            region = "sig"
        seen[region].add(info.value.reason)
    assert seen["magic"] == {"bad_magic"}
    assert seen["length"] <= {"truncated", "too_large"}
    # the JSON body may stop parsing, change a field, or stay well-formed but unsigned
    assert "signature_invalid" in seen["body"]
    assert seen["body"] <= {"body_invalid", "field_type", "field_length", "signature_invalid"}
    assert seen["sig"] == {"signature_invalid"}


def test_signature_over_the_body_only_is_checked() -> None:
    # Same body, another measurement: a replayed signature does not carry over.
    forged_body = _body(measurement=bytes(48).hex())
    forged = MAGIC + struct.pack(">H", len(forged_body)) + forged_body + VALID[-SIG_LEN:]
    with pytest.raises(EvidenceVerificationError) as info:
        _verify(forged)
    assert info.value.reason == "signature_invalid"


@pytest.mark.parametrize("cut", [1, SIG_LEN, len(VALID) - HEADER, len(VALID) - len(MAGIC) - 1])
def test_truncated_evidence(cut: int) -> None:
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(VALID[:-cut])
    assert info.value.reason == "truncated"


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(VALID + b"\x00")
    assert info.value.reason == "truncated"


def test_bad_magic_and_oversized_body() -> None:
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(b"AMSIM2" + VALID[len(MAGIC) :])
    assert info.value.reason == "bad_magic"
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(MAGIC + struct.pack(">H", sim.MAX_BODY + 1) + bytes(sim.MAX_BODY + 65))
    assert info.value.reason == "too_large"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"not json", "body_invalid"),
        (b"[1, 2]", "body_invalid"),
        (b"[" * 2040 + b"]" * 2040, "body_invalid"),  # deep nesting must not escape
        ('{"a": "\u00e9"}'.encode("latin-1"), "body_invalid"),  # not UTF-8
        (_body().decode().encode("utf-16"), "body_invalid"),  # valid JSON, but not UTF-8
        (_body(extra=1), "body_invalid"),
        (_body(svn=...), "body_invalid"),
        (_body(svn=True), "field_type"),
        (_body(svn="1"), "field_type"),
        (_body(svn=1.0), "field_type"),
        (_body(debug=0), "field_type"),
        (_body(platform=None), "field_type"),
        (_body(measurement="zz" * 48), "field_type"),
        (_body(report_data=REPORT_DATA.hex()[:-2]), "field_length"),
        (_body(measurement=bytes(49).hex()), "field_length"),
        (_body(platform="p" * 65), "field_length"),
        (_body(svn=-1), "field_range"),
        (_body(svn=2**32), "field_range"),
        (_body(svn=1).replace(b'"svn": 1', b'"svn": 1e400'), "field_type"),  # inf
        (_body(svn=1).replace(b'"svn": 1', b'"svn": NaN'), "field_type"),
    ],
)
def test_body_problems(body: bytes, reason: str) -> None:
    with pytest.raises(EvidenceFormatError) as info:
        parse_report(_frame(body))
    assert info.value.reason == reason


def test_load_platform_public_key() -> None:
    pem = PLATFORM_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    assert sim.load_platform_public_key(pem) == PLATFORM_KEY.public_key()
    from cryptography.hazmat.primitives.asymmetric import ed25519

    other = ed25519.Ed25519PrivateKey.generate().public_key()
    with pytest.raises(ValueError, match="must be an EC public key"):
        sim.load_platform_public_key(
            other.public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_raise_only_project_errors(data: bytes) -> None:
    for candidate in (data, MAGIC + data, _frame(data[:-SIG_LEN], data[-SIG_LEN:])):
        with pytest.raises(ERRORS):
            _verify(candidate)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4
    ),
    st.integers(0, len(VALID)),
)
def test_mutated_reports_raise_only_project_errors(edits: list[tuple[int, int]], keep: int) -> None:
    evidence = bytearray(VALID)
    for index, value in edits:
        evidence[index] = value
    mutated = bytes(evidence[:keep]) if keep < len(VALID) else bytes(evidence)
    if mutated == VALID:
        return
    with pytest.raises(ERRORS):
        _verify(mutated)
