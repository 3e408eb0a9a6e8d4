from __future__ import annotations

from datetime import timedelta

import pytest

from certs.nonces import NonceBook, NonceError
from tests.unit.fixtures_core import NOW

TTL = timedelta(seconds=60)


def _nonce(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _reason(book: NonceBook, nonce: bytes, at: object) -> str:
    with pytest.raises(NonceError) as info:
        book.consume(nonce, at)  # type: ignore[arg-type]
    return info.value.reason


def test_issue_returns_the_expiry_and_consume_accepts_once() -> None:
    book = NonceBook(ttl=TTL)
    assert book.ttl == TTL
    assert book.issue(_nonce(1), NOW) == NOW + TTL
    book.consume(_nonce(1), NOW + timedelta(seconds=59))
    assert _reason(book, _nonce(1), NOW + timedelta(seconds=59)) == "nonce_reused"


def test_expired_nonce_is_refused_and_then_counts_as_used() -> None:
    book = NonceBook(ttl=TTL)
    book.issue(_nonce(1), NOW)
    assert _reason(book, _nonce(1), NOW + TTL) == "nonce_expired"  # the expiry is exclusive
    assert _reason(book, _nonce(1), NOW + TTL) == "nonce_reused"


def test_unknown_nonce() -> None:
    book = NonceBook(ttl=TTL)
    book.issue(_nonce(1), NOW)
    assert _reason(book, _nonce(2), NOW) == "nonce_unknown"
    book.consume(_nonce(1), NOW)  # the unknown one did not disturb the real one


def test_wrong_length_is_refused_at_issue() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        NonceBook().issue(bytes(16), NOW)


def test_outstanding_challenges_are_bounded() -> None:
    book = NonceBook(ttl=TTL, max_outstanding=3)
    for i in range(3):
        book.issue(_nonce(i), NOW)
    with pytest.raises(NonceError) as info:
        book.issue(_nonce(3), NOW)
    assert info.value.reason == "too_many_challenges"
    book.consume(_nonce(0), NOW)  # consuming frees a slot
    book.issue(_nonce(3), NOW)
    with pytest.raises(NonceError):
        book.issue(_nonce(4), NOW)


def test_long_expired_nonces_are_pruned_and_free_their_slots() -> None:
    book = NonceBook(ttl=TTL, max_outstanding=2)
    book.issue(_nonce(0), NOW)
    book.issue(_nonce(1), NOW)
    book.consume(_nonce(1), NOW)
    later = NOW + 2 * TTL
    book.issue(_nonce(2), later)  # pruning dropped nonce 0 (outstanding) and 1 (used)
    book.issue(_nonce(3), later)
    assert _reason(book, _nonce(0), later) == "nonce_unknown"
    assert _reason(book, _nonce(1), later) == "nonce_unknown"
    book.consume(_nonce(2), later)


def test_recently_expired_nonce_is_not_yet_pruned() -> None:
    book = NonceBook(ttl=TTL)
    book.issue(_nonce(0), NOW)
    book.issue(_nonce(1), NOW + TTL + timedelta(seconds=1))  # prunes only after 2 x TTL
    assert _reason(book, _nonce(0), NOW + TTL + timedelta(seconds=1)) == "nonce_expired"
