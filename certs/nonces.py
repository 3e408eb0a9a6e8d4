"""Stateless, authenticated, single-use attestation nonces. Time and randomness are arguments.

A nonce carries its own proof of origin and its own expiry, so issuing one keeps no state and
cannot be exhausted by anyone, however many challenges they ask for:

    nonce = random (16) || expiry (8, big-endian milliseconds since the Unix epoch)
            || HMAC-SHA256(key, random || expiry)[:8]                        32 bytes in all

``consume`` checks the MAC (constant time), then the expiry, then a replay set of nonces
already consumed. The replay set keeps each nonce only until its expiry (after it the expiry
check refuses it anyway), is pruned in O(expired) from a heap ordered by expiry, and is
bounded: when full it refuses new consumes (``nonce_capacity``) rather than grow. Only callers
that passed the identity check reach ``consume``, so filling it takes that many authenticated
attestations inside one nonce lifetime.

An *offered* nonce is issued with a certificate, for the workload's next attestation (it saves
the agent a challenge round trip). It is marked (the top bit of its first byte) and lives
longer (until the workload must re-attest), so the replay set does not take it: the control
plane keeps the one offered nonce per workload and accepts it only from that workload, once
(``check`` verifies its MAC and expiry; ``consume`` refuses it). Memory stays one nonce per
workload; another replica or a restarted one refuses it (``nonce_unknown``: its key differs),
the one that offered it refuses it once used or taken back (``nonce_not_offered``), and the
agent asks for a challenge.

The key is random per process by default: after a restart every outstanding nonce fails its
MAC and is refused, which is the safe direction. Replicas that share the key accept each
other's nonces; each keeps its own replay set (a shared one belongs in the store).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from certs.binding import NONCE_LEN
from certs.errors import AttestmeshError

RANDOM_LEN = 16
EXPIRY_LEN = 8
MAC_LEN = 8
KEY_LEN = 32
assert RANDOM_LEN + EXPIRY_LEN + MAC_LEN == NONCE_LEN
_OFFERED = 0x80  # the top bit of the first byte: an offered nonce
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MS = timedelta(milliseconds=1)


class NonceError(AttestmeshError):
    """Forged, expired or already used nonce; or no room left to remember it as used."""


def _ms(t: datetime) -> int:
    return (t - _EPOCH) // _MS


class NonceBook:
    """Issues nonces without state; remembers consumed ones until they expire (bounded)."""

    def __init__(
        self,
        ttl: timedelta = timedelta(seconds=60),
        max_consumed: int = 100_000,
        *,
        key: bytes | None = None,
    ) -> None:
        if ttl <= timedelta(0):
            raise ValueError("ttl must be positive")
        if max_consumed < 1:
            raise ValueError("max_consumed must be at least 1")
        if key is not None and len(key) < 16:
            raise ValueError("the nonce key must be at least 16 bytes")
        self._ttl = ttl
        self._max = max_consumed
        self._key = key if key is not None else secrets.token_bytes(KEY_LEN)
        self._consumed: set[bytes] = set()
        self._expiries: list[tuple[int, bytes]] = []  # heap: (expiry ms, nonce)

    @property
    def ttl(self) -> timedelta:
        return self._ttl

    @property
    def consumed(self) -> int:
        """How many consumed, unexpired nonces the replay set holds (as of the last call)."""
        return len(self._consumed)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()[:MAC_LEN]

    def issue(self, now: datetime, random: Callable[[int], bytes]) -> tuple[bytes, datetime]:
        """A fresh nonce and its expiry. Keeps no state."""
        return self._issue(now, random, self._ttl, offered=False)

    def offer(
        self, now: datetime, random: Callable[[int], bytes], expires: datetime
    ) -> tuple[bytes, datetime]:
        """A nonce to hand out with a certificate, valid until ``expires`` (after ``now``).
        Keeps no state: the caller keeps it for the one workload it offers it to."""
        if expires <= now:
            raise ValueError("an offered nonce must expire after now")
        return self._issue(now, random, expires - now, offered=True)

    def _issue(
        self, now: datetime, random: Callable[[int], bytes], ttl: timedelta, *, offered: bool
    ) -> tuple[bytes, datetime]:
        rnd = random(RANDOM_LEN)
        if len(rnd) != RANDOM_LEN:
            raise ValueError(f"random({RANDOM_LEN}) returned {len(rnd)} bytes")
        first = (rnd[0] | _OFFERED) if offered else (rnd[0] & ~_OFFERED)
        rnd = bytes([first]) + rnd[1:]
        expires_ms = _ms(now + ttl)
        body = rnd + expires_ms.to_bytes(EXPIRY_LEN, "big")
        return body + self._mac(body), _EPOCH + expires_ms * _MS

    @staticmethod
    def is_offered(nonce: bytes) -> bool:
        return len(nonce) == NONCE_LEN and bool(nonce[0] & _OFFERED)

    def check(self, nonce: bytes, now: datetime) -> None:
        """The MAC and the expiry of a nonce (single use is the caller's: an offered nonce is
        kept per workload and dropped when used)."""
        if len(nonce) != NONCE_LEN:
            raise NonceError("nonce_unknown", f"a nonce is {NONCE_LEN} bytes")
        body, mac = nonce[: RANDOM_LEN + EXPIRY_LEN], nonce[RANDOM_LEN + EXPIRY_LEN :]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise NonceError(
                "nonce_unknown", "no such challenge (not issued by this control plane)"
            )
        if _ms(now) >= int.from_bytes(body[RANDOM_LEN:], "big"):
            raise NonceError("nonce_expired", "the challenge expired; request a new one")

    def consume(self, nonce: bytes, now: datetime) -> None:
        """Accept a nonce this book (or one sharing its key) issued, once, before it expires.
        An offered nonce is not accepted here (see ``check``)."""
        self.check(nonce, now)
        if self.is_offered(nonce):
            raise NonceError(
                "nonce_unknown", "no such offered nonce (used, or offered elsewhere): challenge"
            )
        now_ms = _ms(now)
        expires_ms = int.from_bytes(nonce[RANDOM_LEN : RANDOM_LEN + EXPIRY_LEN], "big")
        self._prune(now_ms)
        if nonce in self._consumed:
            raise NonceError("nonce_reused", "this nonce was already used")
        if len(self._consumed) >= self._max:
            raise NonceError(
                "nonce_capacity",
                "too many attestations within one challenge lifetime; retry shortly",
            )
        self._consumed.add(nonce)
        heapq.heappush(self._expiries, (expires_ms, nonce))

    def _prune(self, now_ms: int) -> None:
        heap = self._expiries
        while heap and heap[0][0] <= now_ms:
            _, nonce = heapq.heappop(heap)
            self._consumed.discard(nonce)
