"""On-disk collateral cache honouring expiry, serving stale with a warning when a vendor is down.

Pure policy (``is_fresh``) is separate from I/O; writes are atomic (tmp + rename) so a crash
never leaves a torn entry behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiohttp

from certs.errors import CollateralError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    body: bytes
    fetched_at: datetime
    expires_at: datetime | None

    def is_fresh(self, now: datetime) -> bool:
        return self.expires_at is None or now < self.expires_at


class DiskCache:
    def __init__(self, root: Path) -> None:
        self._root = root

    def _paths(self, key: str) -> tuple[Path, Path]:
        name = hashlib.sha256(key.encode()).hexdigest()
        return self._root / f"{name}.bin", self._root / f"{name}.json"

    def get(self, key: str) -> CacheEntry | None:
        body_path, meta_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text())
            body = body_path.read_bytes()
        except (OSError, ValueError):
            return None
        if hashlib.sha256(body).hexdigest() != meta.get("sha256"):
            return None
        expires = meta.get("expires_at")
        return CacheEntry(
            body=body,
            fetched_at=datetime.fromisoformat(meta["fetched_at"]),
            expires_at=datetime.fromisoformat(expires) if expires else None,
        )

    def put(self, key: str, entry: CacheEntry) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        body_path, meta_path = self._paths(key)
        meta = {
            "key": key,
            "sha256": hashlib.sha256(entry.body).hexdigest(),
            "fetched_at": entry.fetched_at.isoformat(),
            "expires_at": entry.expires_at.isoformat() if entry.expires_at else None,
        }
        for path, data in ((body_path, entry.body), (meta_path, json.dumps(meta).encode())):
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)


Fetch = Callable[[str], Awaitable[bytes]]
"""Fetch a URL's body; raises CollateralError when the vendor is unreachable or answers badly."""


def http_fetcher(session: aiohttp.ClientSession, timeout_s: float = 10.0) -> Fetch:
    """An aiohttp adapter: foreign errors become CollateralError at this boundary."""

    async def fetch(url: str) -> bytes:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                if resp.status != 200:
                    raise CollateralError("collateral_http_status", f"{url}: HTTP {resp.status}")
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise CollateralError("collateral_unreachable", f"{url}: {exc!r}") from exc

    return fetch


async def fetch_cached(
    cache: DiskCache,
    key: str,
    url: str,
    fetch: Fetch,
    now: datetime,
    expiry_of: Callable[[bytes], datetime | None],
) -> bytes:
    """Return a fresh cached body, else fetch and cache it, else serve stale with a warning.

    ``expiry_of`` parses the body's own expiry (nextUpdate, certificate notAfter); a body it
    rejects (raises CollateralError) is not cached.
    """
    entry = cache.get(key)
    if entry is not None and entry.is_fresh(now):
        return entry.body
    try:
        body = await fetch(url)
        expires_at = expiry_of(body)
    except CollateralError as exc:
        if entry is None:
            raise
        log.warning("serving stale collateral %s (fetched %s): %s", key, entry.fetched_at, exc)
        return entry.body
    cache.put(key, CacheEntry(body=body, fetched_at=now, expires_at=expires_at))
    return body
