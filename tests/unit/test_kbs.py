"""certs/kbs.py, pure: payload parsers (arbitrary input raises only KbsError), the binding,
the session book (expiry, bound, one attestation per challenge)."""

from __future__ import annotations

import contextlib
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from certs.evidence.claims import Tee
from certs.kbs import (
    CHALLENGE_TTL,
    Attested,
    KbsError,
    KbsSessions,
    check_binding,
    kbs_report_data,
    parse_attestation,
    parse_request,
    tee_key,
)

NOW = datetime(2026, 12, 1, tzinfo=UTC)
JWK = {"kty": "EC", "crv": "P-256", "alg": "ECDH-ES+A256KW",
       "x": "f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU",
       "y": "x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


def _sessions(clock: Clock, max_sessions: int = 8) -> KbsSessions:
    counter = itertools.count()
    return KbsSessions(
        clock=clock,
        random_bytes=lambda n: next(counter).to_bytes(n, "big"),
        max_sessions=max_sessions,
    )


def test_request_versions_and_tees() -> None:
    enabled = frozenset({Tee.SIM, Tee.SEV_SNP})
    assert (
        parse_request({"version": "0.1.0", "tee": "sample", "extra-params": ""}, enabled) is Tee.SIM
    )
    assert parse_request({"version": "0.1.0", "tee": "amd-sev-snp"}, enabled) is Tee.SEV_SNP
    for bad in (
        {"version": "0.2.0", "tee": "sample"},
        {"version": "0.1.0", "tee": "intel-tdx"},  # not enabled here
        {"version": "0.1.0", "tee": "sev"},
        {"version": "0.1.0"},
        {"version": "0.1.0", "tee": "sample", "more": 1},
        [],
    ):
        with pytest.raises(KbsError) as e:
            parse_request(bad, enabled)
        assert e.value.status == 400


def test_binding_is_sha512_of_the_canonical_runtime_data() -> None:
    import hashlib
    import json

    data = kbs_report_data("bm9uY2U=", JWK)
    runtime = json.dumps({"nonce": "bm9uY2U=", "tee-pubkey": JWK}, sort_keys=True,
                         separators=(",", ":")).encode()  # fmt: skip
    assert data == hashlib.sha512(runtime).digest() and len(data) == 64
    check_binding(data, "bm9uY2U=", JWK)
    for nonce, jwk in (("b3RoZXI=", JWK), ("bm9uY2U=", {**JWK, "x": JWK["y"]})):
        with pytest.raises(KbsError) as e:
            check_binding(data, nonce, jwk)
        assert e.value.status == 401


def test_sessions_expire_are_bounded_and_attest_once() -> None:
    clock = Clock()
    book = _sessions(clock, max_sessions=4)
    sid, session = book.challenge(Tee.SIM)
    assert book.get(sid) == session and session.nonce
    attested = Attested("w", tee_key(JWK), "sim", {}, None)
    book.attested(sid, attested)
    assert book.get(sid).attested == attested and book.get(sid).nonce == ""
    with pytest.raises(KbsError):
        book.attested(sid, attested)  # one challenge, one attestation
    clock.now += timedelta(minutes=6)
    with pytest.raises(KbsError) as e:
        book.get(sid)
    assert e.value.status == 401
    other, _ = book.challenge(Tee.SIM)
    clock.now += CHALLENGE_TTL
    with pytest.raises(KbsError):
        book.get(other)  # an unanswered challenge expires sooner
    ids = [book.challenge(Tee.SIM)[0] for _ in range(10)]
    assert len(book) == 4 and all(book.get(i) for i in ids[-4:])
    with pytest.raises(KbsError):
        book.get(ids[0])
    with pytest.raises(KbsError):
        book.get(None)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=10),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=4)))  # fmt: skip
def test_arbitrary_payloads_raise_only_kbs_error(doc: Any) -> None:
    for parse in (lambda d: parse_request(d, frozenset({Tee.SIM})), parse_attestation):
        with contextlib.suppress(KbsError):
            parse(doc)
    with contextlib.suppress(KbsError):
        tee_key(doc if isinstance(doc, dict) else {})


def test_attestation_shape() -> None:
    jwk, ev = parse_attestation(
        {"tee-pubkey": JWK, "tee-evidence": {"workload": "ns/pod", "evidence": "AAEC"}}
    )
    assert jwk == JWK and ev.workload == "ns/pod" and ev.evidence == b"\x00\x01\x02"
    for bad in (
        {"tee-pubkey": JWK},
        {"tee-pubkey": JWK, "tee-evidence": {"workload": "w", "evidence": "***"}},
        {"tee-pubkey": JWK, "tee-evidence": {"evidence": "AAEC"}},
        {"tee-pubkey": JWK, "tee-evidence": {"workload": "w", "evidence": "AAEC", "x": 1}},
    ):
        with pytest.raises(KbsError):
            parse_attestation(bad)
