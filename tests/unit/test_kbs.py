"""certs/kbs.py, pure: payload parsers (arbitrary input raises only KbsError), the binding,
the session book (stateless HMAC challenges, state only after verified evidence, expiry, bounds, one attestation per challenge)."""

from __future__ import annotations

import base64
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
    SESSION_TTL,
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


def _sessions(clock: Clock, max_entries: int = 8, per_workload: int = 4) -> KbsSessions:
    counter = itertools.count(1)
    return KbsSessions(
        clock=clock,
        random_bytes=lambda n: next(counter).to_bytes(n, "big"),
        max_entries=max_entries,
        per_workload=per_workload,
    )


def test_request_versions_and_tees() -> None:
    enabled = frozenset({Tee.SIM, Tee.SEV_SNP})
    assert (
        parse_request({"version": "0.1.0", "tee": "sample", "extra-params": ""}, enabled) is Tee.SIM
    )
    assert parse_request({"version": "0.1.0", "tee": "amd-sev-snp"}, enabled) is Tee.SEV_SNP
    bad: Any
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


def _attest(book: KbsSessions, cookie: str, workload: str = "w") -> Attested:
    attested = Attested(workload, tee_key(JWK), "sim", {}, None)
    challenge = book.open(cookie)
    book.spend(challenge)
    book.attested(challenge, attested)
    return attested


def test_challenges_are_stateless_and_authenticated() -> None:
    clock = Clock()
    book = _sessions(clock)
    cookie, challenge = book.challenge(Tee.SEV_SNP)
    assert len(book) == 0  # nothing stored for an unauthenticated request
    assert book.open(cookie) == challenge and challenge.tee is Tee.SEV_SNP
    assert base64.b64decode(challenge.nonce) == challenge.key and len(challenge.key) == 32
    assert challenge.expires == NOW + CHALLENGE_TTL
    with pytest.raises(KbsError) as e:
        book.session(cookie)
    assert (e.value.status, e.value.reason) == (401, "not_attested")
    raw = bytearray(base64.urlsafe_b64decode(cookie + "=" * (-len(cookie) % 4)))
    for i in (0, 1, 9, 40, len(raw) - 1):  # the TEE, the expiry, the nonce, the MAC
        forged = bytearray(raw)
        forged[i] ^= 1
        text = base64.urlsafe_b64encode(bytes(forged)).rstrip(b"=").decode()
        for use in (book.open, book.session):
            with pytest.raises(KbsError) as e:
                use(text)
            assert (e.value.status, e.value.reason) == (401, "session_unknown")
    for junk in (None, "", "x" * len(cookie), cookie[:-1], cookie + "A", "*" * len(cookie)):
        with pytest.raises(KbsError) as e:
            book.open(junk)
        assert e.value.status == 401
    other_key = _sessions(clock)  # another book (key) does not take this cookie
    other_key._key = b"k" * 32
    with pytest.raises(KbsError):
        other_key.open(cookie)
    clock.now += CHALLENGE_TTL
    with pytest.raises(KbsError) as e:
        book.open(cookie)  # an unanswered challenge expires
    assert e.value.reason == "session_unknown"


def test_a_challenge_is_answered_once_and_the_session_expires() -> None:
    clock = Clock()
    book = _sessions(clock)
    cookie, _ = book.challenge(Tee.SIM)
    attested = _attest(book, cookie)
    assert book.session(cookie) == attested and len(book) == 1
    for again in (book.open, lambda c: book.spend(book._parse(c))):
        with pytest.raises(KbsError) as e:
            again(cookie)  # one challenge, one attestation
        assert e.value.reason == "session_attested"
    clock.now += CHALLENGE_TTL + timedelta(seconds=1)
    assert book.session(cookie) == attested  # the session outlives its challenge
    clock.now = NOW + SESSION_TTL + timedelta(seconds=1)
    with pytest.raises(KbsError) as e:
        book.session(cookie)
    assert e.value.reason == "session_unknown" and len(book) == 0
    spent, _ = book.challenge(Tee.SIM)  # spent (evidence verified) but not admitted
    book.spend(book.open(spent))
    with pytest.raises(KbsError):
        book.open(spent)
    with pytest.raises(KbsError) as e:
        book.session(spent)
    assert e.value.reason == "session_unknown"
    clock.now += CHALLENGE_TTL
    book.open(book.challenge(Tee.SIM)[0])
    assert len(book) == 0  # remembered only until the challenge expires


def test_auth_spam_evicts_nothing_and_stores_nothing() -> None:
    clock = Clock()
    book = _sessions(clock, max_entries=64)
    attested_cookie, _ = book.challenge(Tee.SIM)
    attested = _attest(book, attested_cookie, "legit")
    in_flight, _ = book.challenge(Tee.SIM)  # challenged, evidence on its way
    held = (len(book), len(book._expiry), len(book._by_workload))
    for _ in range(10_000):
        book.challenge(Tee.SIM)
    assert (len(book), len(book._expiry), len(book._by_workload)) == held
    assert len(book) == 1
    assert book.session(attested_cookie) == attested
    assert _attest(book, in_flight, "legit") and len(book) == 2


def test_bounds_per_workload_and_in_all() -> None:
    clock = Clock()
    book = _sessions(clock, max_entries=6, per_workload=2)
    mine = [book.challenge(Tee.SIM)[0] for _ in range(3)]
    theirs, _ = book.challenge(Tee.SIM)
    _attest(book, theirs, "other")
    for cookie in mine:
        _attest(book, cookie, "loop")
    with pytest.raises(KbsError):
        book.session(mine[0])  # the looping workload's oldest session goes
    assert book.session(mine[1]).workload == book.session(mine[2]).workload == "loop"
    assert book.session(theirs).workload == "other"  # never another workload's
    with pytest.raises(KbsError) as e:
        book.open(mine[0])  # its challenge stays spent until it expires
    assert e.value.reason == "session_attested"
    assert len(book) == 4
    for _ in range(2):
        book.spend(book.open(book.challenge(Tee.SIM)[0]))
    with pytest.raises(KbsError) as e:
        book.spend(book.open(book.challenge(Tee.SIM)[0]))
    assert (e.value.status, e.value.reason) == (503, "kbs_busy")  # full: newcomers wait
    assert book.session(theirs).workload == "other"
    clock.now += CHALLENGE_TTL
    book.spend(book.open(book.challenge(Tee.SIM)[0]))  # spent challenges expired: room again
    assert len(book) == 4


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
