"""Single-use attestation nonces with a short expiry. Time and randomness come in as arguments."""

from __future__ import annotations

from datetime import datetime, timedelta

from certs.binding import NONCE_LEN
from certs.errors import AttestmeshError


class NonceError(AttestmeshError):
    """Unknown, expired or already used nonce."""


class NonceBook:
    """Outstanding and recently used nonces, bounded in size overall and per client.

    Nonces live in memory on purpose: after a restart every outstanding nonce is unknown and
    is refused, which is the safe direction. The per-client bound keeps one flooding client
    from exhausting the challenges everyone else needs. Pruning is O(expired): entries are
    kept in issue order, which is expiry order.
    """

    def __init__(
        self,
        ttl: timedelta = timedelta(seconds=60),
        max_outstanding: int = 100_000,
        max_per_client: int = 64,
    ) -> None:
        self._ttl = ttl
        self._max = max_outstanding
        self._max_per_client = max_per_client
        self._outstanding: dict[bytes, tuple[datetime, str]] = {}
        self._per_client: dict[str, int] = {}
        self._used: dict[bytes, datetime] = {}

    @property
    def ttl(self) -> timedelta:
        return self._ttl

    def issue(self, nonce: bytes, now: datetime, client: str = "") -> datetime:
        if len(nonce) != NONCE_LEN:
            raise ValueError("nonce must be 32 bytes")
        self._prune(now)
        if len(self._outstanding) >= self._max:
            raise NonceError("too_many_challenges", "too many outstanding challenges; retry later")
        if self._per_client.get(client, 0) >= self._max_per_client:
            raise NonceError(
                "too_many_challenges", "this client has too many outstanding challenges"
            )
        expires = now + self._ttl
        self._outstanding[nonce] = (expires, client)
        self._per_client[client] = self._per_client.get(client, 0) + 1
        return expires

    def consume(self, nonce: bytes, now: datetime) -> None:
        entry = self._outstanding.pop(nonce, None)
        if entry is None:
            if nonce in self._used:
                raise NonceError("nonce_reused", "this nonce was already used")
            raise NonceError(
                "nonce_unknown", "no such challenge (expired long ago, or never issued)"
            )
        expires, client = entry
        self._release(client)
        self._used[nonce] = expires
        if now >= expires:
            raise NonceError("nonce_expired", "the challenge expired; request a new one")

    def _release(self, client: str) -> None:
        left = self._per_client[client] - 1
        if left:
            self._per_client[client] = left
        else:
            del self._per_client[client]

    def _prune(self, now: datetime) -> None:
        # Expired challenges are kept one more TTL so a late attempt is told "expired".
        cutoff = now - self._ttl
        while self._outstanding:
            nonce, (expires, client) = next(iter(self._outstanding.items()))
            if expires > cutoff:
                break
            del self._outstanding[nonce]
            self._release(client)
        while self._used:
            nonce, expires = next(iter(self._used.items()))
            if expires > cutoff:
                break
            del self._used[nonce]
