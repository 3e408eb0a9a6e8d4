"""One flooding client cannot exhaust the challenges every other workload needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from certs.nonces import NonceBook, NonceError

NOW = datetime(2030, 1, 1, tzinfo=UTC)


def nonce(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_per_client_cap_leaves_room_for_others() -> None:
    book = NonceBook(max_per_client=3)
    for i in range(3):
        book.issue(nonce(i), NOW, "10.0.0.9")
    with pytest.raises(NonceError) as exc:
        book.issue(nonce(3), NOW, "10.0.0.9")
    assert exc.value.reason == "too_many_challenges"
    book.issue(nonce(4), NOW, "10.0.0.7")  # another client is unaffected
    book.consume(nonce(0), NOW)  # answering a challenge frees a slot
    book.issue(nonce(5), NOW, "10.0.0.9")


def test_expired_challenges_free_their_slots() -> None:
    book = NonceBook(ttl=timedelta(seconds=60), max_per_client=2)
    book.issue(nonce(1), NOW, "c")
    book.issue(nonce(2), NOW, "c")
    later = NOW + timedelta(seconds=121)  # expired, and kept one more TTL for a precise answer
    book.issue(nonce(3), later, "c")
    with pytest.raises(NonceError) as exc:
        book.consume(nonce(1), later)
    assert exc.value.reason == "nonce_unknown"


def test_expired_but_recent_challenge_is_reported_as_expired() -> None:
    book = NonceBook(ttl=timedelta(seconds=60))
    book.issue(nonce(1), NOW, "c")
    with pytest.raises(NonceError) as exc:
        book.consume(nonce(1), NOW + timedelta(seconds=90))
    assert exc.value.reason == "nonce_expired"


def test_flood_is_cheap() -> None:
    """Pruning is O(expired): 50k challenges issued across time stay fast."""
    book = NonceBook(ttl=timedelta(seconds=1), max_per_client=1_000_000)
    for i in range(50_000):
        book.issue(nonce(i), NOW + timedelta(milliseconds=i), "flood")
    assert len(book._outstanding) < 2_100  # only the last ~2 s worth are kept
