"""Stateless authenticated nonces: random || expiry || MAC, single use through a bounded replay
set of consumed nonces kept only until they expire."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from certs.binding import NONCE_LEN
from certs.nonces import NonceBook, NonceError
from tests.unit.fixtures_core import NOW

TTL = timedelta(seconds=60)
KEY = bytes(range(32))


def counter() -> Callable[[int], bytes]:
    """Deterministic randomness: each call returns the next distinct bytes."""
    state = {"i": 0}

    def take(n: int) -> bytes:
        state["i"] += 1
        return state["i"].to_bytes(n, "big")

    return take


def _reason(book: NonceBook, nonce: bytes, at: datetime) -> str:
    with pytest.raises(NonceError) as info:
        book.consume(nonce, at)
    return info.value.reason


def test_issue_returns_a_32_byte_nonce_carrying_its_expiry() -> None:
    book = NonceBook(ttl=TTL, key=KEY)
    assert book.ttl == TTL
    nonce, expires = book.issue(NOW, lambda n: b"\x07" * n)
    assert len(nonce) == NONCE_LEN == 32
    assert expires == NOW + TTL
    assert nonce[:16] == b"\x07" * 16  # the randomness comes from the argument
    assert int.from_bytes(nonce[16:24], "big") == int((NOW + TTL).timestamp() * 1000)
    # deterministic given key, time and randomness; a new key gives another MAC
    assert NonceBook(ttl=TTL, key=KEY).issue(NOW, lambda n: b"\x07" * n)[0] == nonce
    other = NonceBook(ttl=TTL, key=bytes(32)).issue(NOW, lambda n: b"\x07" * n)[0]
    assert other[:24] == nonce[:24] and other[24:] != nonce[24:]


def test_consume_accepts_once_until_the_expiry() -> None:
    book = NonceBook(ttl=TTL)
    nonce, _ = book.issue(NOW, counter())
    book.consume(nonce, NOW + timedelta(seconds=59))
    assert _reason(book, nonce, NOW + timedelta(seconds=59)) == "nonce_reused"
    assert book.consumed == 1


def test_expired_nonce_is_refused_the_expiry_is_exclusive() -> None:
    book = NonceBook(ttl=TTL)
    nonce, expires = book.issue(NOW, counter())
    assert _reason(book, nonce, expires) == "nonce_expired"
    assert _reason(book, nonce, expires + timedelta(days=1)) == "nonce_expired"
    assert book.consumed == 0  # a refused nonce is not remembered


def test_a_consumed_nonce_stays_refused_after_it_leaves_the_replay_set() -> None:
    book = NonceBook(ttl=TTL)
    nonce, expires = book.issue(NOW, counter())
    book.consume(nonce, NOW)
    assert _reason(book, nonce, expires) == "nonce_expired"
    later, _ = book.issue(expires, counter())
    book.consume(later, expires)  # pruning ran: the first one left the replay set
    assert book.consumed == 1
    assert _reason(book, nonce, expires) == "nonce_expired"


@pytest.mark.parametrize("position", [0, 15, 16, 23, 24, 31])
def test_any_altered_byte_is_a_forgery(position: int) -> None:
    book = NonceBook(ttl=TTL)
    nonce, _ = book.issue(NOW, counter())
    forged = bytearray(nonce)
    forged[position] ^= 0x01
    assert _reason(book, bytes(forged), NOW) == "nonce_unknown"
    book.consume(nonce, NOW)  # the forgery did not disturb the real one


def test_extending_the_expiry_is_a_forgery() -> None:
    book = NonceBook(ttl=TTL)
    nonce, expires = book.issue(NOW, counter())
    far = int((expires + timedelta(days=365)).timestamp() * 1000).to_bytes(8, "big")
    assert _reason(book, nonce[:16] + far + nonce[24:], expires) == "nonce_unknown"


def test_a_nonce_of_another_key_is_unknown_one_sharing_the_key_is_accepted() -> None:
    # a restart (new random key) refuses every outstanding nonce: the safe direction
    nonce, _ = NonceBook(ttl=TTL).issue(NOW, counter())
    assert _reason(NonceBook(ttl=TTL), nonce, NOW) == "nonce_unknown"
    # replicas given one key accept each other's nonces
    shared, _ = NonceBook(ttl=TTL, key=KEY).issue(NOW, counter())
    NonceBook(ttl=TTL, key=KEY).consume(shared, NOW)


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_wrong_length_is_unknown(length: int) -> None:
    assert _reason(NonceBook(), bytes(length), NOW) == "nonce_unknown"


@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_only_nonce_error(data: bytes) -> None:
    with pytest.raises(NonceError):
        NonceBook(key=KEY).consume(data, NOW)


def test_constructor_and_randomness_are_checked() -> None:
    with pytest.raises(ValueError, match="ttl"):
        NonceBook(ttl=timedelta(0))
    with pytest.raises(ValueError, match="max_consumed"):
        NonceBook(max_consumed=0)
    with pytest.raises(ValueError, match="16 bytes"):
        NonceBook(key=b"short")
    with pytest.raises(ValueError, match="returned 8 bytes"):
        NonceBook().issue(NOW, lambda n: bytes(8))


# ---------------------------------------------------------------------------------------------
# nobody can exhaust challenges; the replay set is bounded


def test_issuing_keeps_no_state_a_flood_exhausts_nothing() -> None:
    book = NonceBook(ttl=TTL, max_consumed=1)
    rnd = counter()
    flood = [book.issue(NOW, rnd)[0] for _ in range(100_000)]
    assert len(set(flood)) == len(flood)
    assert book.consumed == 0
    nonce, _ = book.issue(NOW, rnd)  # a legitimate client after the flood
    book.consume(nonce, NOW + timedelta(seconds=1))
    # every flooded nonce is still individually valid (single use, bounded by expiry)
    assert _reason(book, flood[0], NOW + TTL) == "nonce_expired"


def test_a_full_replay_set_refuses_new_consumes_rather_than_grow() -> None:
    book = NonceBook(ttl=TTL, max_consumed=3)
    rnd = counter()
    early = [book.issue(NOW, rnd)[0] for _ in range(3)]
    late, late_expiry = book.issue(NOW + timedelta(seconds=30), rnd)
    for n in early:
        book.consume(n, NOW + timedelta(seconds=31))
    with pytest.raises(NonceError) as info:
        book.consume(late, NOW + timedelta(seconds=31))
    assert info.value.reason == "nonce_capacity" and "retry" in info.value.detail
    assert book.consumed == 3
    assert _reason(book, early[0], NOW + timedelta(seconds=31)) == "nonce_reused"  # checked first
    # once the early ones expire they leave the set; the refused nonce was not consumed
    book.consume(late, NOW + TTL)
    assert book.consumed == 1
    assert _reason(book, late, late_expiry - timedelta(milliseconds=1)) == "nonce_reused"


def test_pruning_follows_expiry_order_not_consume_order() -> None:
    book = NonceBook(ttl=TTL, max_consumed=4)
    rnd = counter()
    issued = [book.issue(NOW + timedelta(seconds=s), rnd) for s in (0, 10, 20, 30)]
    for i in (3, 0, 2, 1):  # consumed out of expiry order
        book.consume(issued[i][0], NOW + timedelta(seconds=31))
    for _, expires in issued:
        # at each expiry exactly one slot frees: one newcomer fits, the next does not
        book.consume(book.issue(expires, rnd)[0], expires)
        assert _reason(book, book.issue(expires, rnd)[0], expires) == "nonce_capacity"
        assert book.consumed == 4


def test_many_consumes_across_time_stay_bounded_and_fast() -> None:
    """Pruning is O(expired): 50k attestations spread over time keep ~2 TTLs' worth at most."""
    book = NonceBook(ttl=timedelta(seconds=1), max_consumed=1_000_000)
    rnd = counter()
    shuffled = random.Random(7)
    sizes = []
    for i in range(50_000):
        t = NOW + timedelta(milliseconds=i)
        nonce, _ = book.issue(t - timedelta(milliseconds=shuffled.randrange(500)), rnd)
        book.consume(nonce, t)
        sizes.append(book.consumed)
    assert max(sizes) <= 1_001


def test_offered_nonces_are_marked_checked_by_mac_and_expiry_and_never_consumed() -> None:
    book = NonceBook(key=bytes(32))
    rand = lambda n: b"\xff" * n  # noqa: E731  (the mark bit set in the randomness)
    plain, _ = book.issue(NOW, rand)
    assert not NonceBook.is_offered(plain)  # a challenge's nonce never carries the mark
    offered, expires = book.offer(NOW, rand, NOW + timedelta(hours=2))
    assert NonceBook.is_offered(offered) and len(offered) == NONCE_LEN
    assert expires == NOW + timedelta(hours=2)
    book.check(offered, NOW + timedelta(hours=1))
    book.check(
        offered, NOW + timedelta(hours=1)
    )  # check keeps no state: single use is the caller's
    assert _reason_check(book, offered, expires) == "nonce_expired"
    forged = bytes([offered[0] ^ 0x01]) + offered[1:]
    assert _reason_check(book, forged, NOW) == "nonce_unknown"
    assert _reason(book, offered, NOW) == "nonce_unknown"  # the replay set never takes one
    assert book.consumed == 0
    with pytest.raises(ValueError):
        book.offer(NOW, rand, NOW)


def _reason_check(book: NonceBook, nonce: bytes, at: datetime) -> str:
    with pytest.raises(NonceError) as info:
        book.check(nonce, at)
    return info.value.reason
