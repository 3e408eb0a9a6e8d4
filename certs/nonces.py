"""Single-use attestation nonces with a short expiry. Time and randomness come in as arguments."""

from __future__ import annotations

from datetime import datetime, timedelta

from certs.binding import NONCE_LEN
from certs.errors import AttestmeshError


class NonceError(AttestmeshError):
    """Unknown, expired or already used nonce."""


class NonceBook:
    """Outstanding and recently used nonces, bounded in size.

    Nonces live in memory on purpose: after a restart every outstanding nonce is unknown and
    is refused, which is the safe direction.
    """

    def __init__(self, ttl: timedelta = timedelta(seconds=60), max_outstanding: int = 100_000):
        self._ttl = ttl
        self._max = max_outstanding
        self._outstanding: dict[bytes, datetime] = {}
        self._used: dict[bytes, datetime] = {}

    @property
    def ttl(self) -> timedelta:
        return self._ttl

    def issue(self, nonce: bytes, now: datetime) -> datetime:
        if len(nonce) != NONCE_LEN:
            raise ValueError("nonce must be 32 bytes")
        self._prune(now)
        if len(self._outstanding) >= self._max:
            raise NonceError("too_many_challenges", "too many outstanding challenges; retry later")
        expires = now + self._ttl
        self._outstanding[nonce] = expires
        return expires

    def consume(self, nonce: bytes, now: datetime) -> None:
        expires = self._outstanding.pop(nonce, None)
        if expires is None:
            if nonce in self._used:
                raise NonceError("nonce_reused", "this nonce was already used")
            raise NonceError(
                "nonce_unknown", "no such challenge (expired long ago, or never issued)"
            )
        self._used[nonce] = expires
        if now >= expires:
            raise NonceError("nonce_expired", "the challenge expired; request a new one")

    def _prune(self, now: datetime) -> None:
        for book in (self._outstanding, self._used):
            for n in [n for n, e in book.items() if e <= now - self._ttl]:
                del book[n]
