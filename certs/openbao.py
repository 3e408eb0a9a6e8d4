"""OpenBao (the open Vault) as the secret backend: KV v2 reads and transit wrap/unwrap. Thin.

The control plane reads with its *own* credential, never the workload's: a token from a file
(re-read when OpenBao refuses it, so an operator or agent can rotate it) or an AppRole login
(role_id + secret_id files; the token it yields is renewed by logging in again before its lease
ends). Tokens never reach a log line or a ``repr``; OpenBao's answers are translated into
``OpenBaoError`` with a bounded ``reason`` and a detail that carries no value.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp

from certs.errors import AttestmeshError

MAX_RESPONSE = 1 << 20
_KEY = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_TRANSIT_CIPHERTEXT = re.compile(r"vault:v([1-9][0-9]{0,8}):[A-Za-z0-9+/=]{1,1400000}")


class OpenBaoError(AttestmeshError):
    """OpenBao refused or could not be reached (reason: ``bao_unreachable``, ``bao_denied``,
    ``bao_not_found``, ``bao_error``, ``bao_malformed``, ``bao_credential``)."""


@dataclass(frozen=True, slots=True)
class KvSecret:
    """A KV v2 entry: string keys to string values, and the version read."""

    data: Mapping[str, str]
    version: int

    def __repr__(self) -> str:  # never the values
        return f"KvSecret(keys={sorted(self.data)}, version={self.version})"


class _Token:
    """A token that does not print."""

    __slots__ = ("value",)

    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return "<token redacted>"


class Credential(Protocol):
    async def token(self, client: OpenBaoClient) -> str: ...

    def invalidate(self) -> None:
        """OpenBao refused the token: fetch a new one next time."""
        ...


def _read_secret_file(path: Path, what: str) -> str:
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise OpenBaoError("bao_credential", f"{what} {path}: {exc.strerror}") from None
    if not value or len(value) > 4096 or not value.isprintable():
        raise OpenBaoError("bao_credential", f"{what} {path} holds no usable value")
    return value


class TokenFile:
    """A token read from a file, cached until OpenBao refuses it."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._token: _Token | None = None

    async def token(self, client: OpenBaoClient) -> str:
        if self._token is None:
            self._token = _Token(_read_secret_file(self._path, "token file"))
        return self._token.value

    def invalidate(self) -> None:
        self._token = None

    def __repr__(self) -> str:
        return f"TokenFile({self._path})"


class AppRole:
    """AppRole login (``auth/<mount>/login``) with role_id and secret_id from files; the token
    is reused until two thirds of its lease have passed. ``clock``: monotonic seconds."""

    def __init__(
        self,
        role_id_file: Path,
        secret_id_file: Path,
        *,
        mount: str = "approle",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._role_id_file = role_id_file
        self._secret_id_file = secret_id_file
        self._mount = mount
        self._clock = clock
        self._token: _Token | None = None
        self._renew_at = 0.0
        self._lock = asyncio.Lock()

    async def token(self, client: OpenBaoClient) -> str:
        async with self._lock:
            if self._token is None or self._clock() >= self._renew_at:
                body = {
                    "role_id": _read_secret_file(self._role_id_file, "AppRole role_id file"),
                    "secret_id": _read_secret_file(self._secret_id_file, "AppRole secret_id file"),
                }
                answer = await client.call("POST", f"auth/{self._mount}/login", body, token=None)
                auth = answer.get("auth")
                token = auth.get("client_token") if isinstance(auth, dict) else None
                lease = auth.get("lease_duration", 0) if isinstance(auth, dict) else 0
                if not isinstance(token, str) or not token or not isinstance(lease, int):
                    raise OpenBaoError("bao_malformed", "AppRole login returned no token")
                self._token = _Token(token)
                self._renew_at = self._clock() + (lease * 2 / 3 if lease > 0 else 3600)
            return self._token.value

    def invalidate(self) -> None:
        self._token = None

    def __repr__(self) -> str:
        return f"AppRole({self._role_id_file}, {self._secret_id_file})"


def _path(*segments: str) -> str:
    return "/".join(quote(s, safe="") for seg in segments for s in seg.split("/"))


class OpenBaoClient:
    """KV v2 and transit against one OpenBao address. ``ssl_context``: None for plain HTTP
    (loopback dev servers only; the CLI refuses it elsewhere)."""

    def __init__(
        self,
        url: str,
        credential: Credential,
        session: aiohttp.ClientSession,
        *,
        ssl_context: ssl.SSLContext | None = None,
        namespace: str | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self._url = url.rstrip("/")
        self._credential = credential
        self._session = session
        self._ssl: ssl.SSLContext | bool = ssl_context if ssl_context is not None else False
        self._namespace = namespace
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def __repr__(self) -> str:
        return f"OpenBaoClient({self._url}, {self._credential!r})"

    async def call(
        self, method: str, path: str, body: Mapping[str, Any] | None, *, token: str | None
    ) -> dict[str, Any]:
        headers = {"X-Vault-Request": "true"}
        if token is not None:
            headers["X-Vault-Token"] = token
        if self._namespace:
            headers["X-Vault-Namespace"] = self._namespace
        try:
            async with self._session.request(
                method,
                f"{self._url}/v1/{path}",
                json=body,
                headers=headers,
                ssl=self._ssl,
                timeout=self._timeout,
                allow_redirects=False,
            ) as resp:
                raw = await resp.content.read(MAX_RESPONSE + 1)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise OpenBaoError("bao_unreachable", f"OpenBao: {type(exc).__name__}") from None
        if len(raw) > MAX_RESPONSE:
            raise OpenBaoError("bao_malformed", "OpenBao's answer is too large")
        if status in (401, 403):
            raise OpenBaoError("bao_denied", f"OpenBao refused {method} {path} ({status})")
        if status == 404:
            raise OpenBaoError("bao_not_found", f"OpenBao has nothing at {path}")
        if status >= 400:
            raise OpenBaoError("bao_error", f"OpenBao answered {status} to {method} {path}")
        if status == 204 or not raw:
            return {}
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise OpenBaoError("bao_malformed", "OpenBao's answer is not JSON") from None
        if not isinstance(doc, dict):
            raise OpenBaoError("bao_malformed", "OpenBao's answer is not an object")
        return doc

    async def _authed(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        token = await self._credential.token(self)
        try:
            return await self.call(method, path, body, token=token)
        except OpenBaoError as exc:
            if exc.reason != "bao_denied":
                raise
            self._credential.invalidate()  # expired or rotated: one retry with a fresh token
            return await self.call(method, path, body, token=await self._credential.token(self))

    async def kv_read(self, mount: str, path: str, version: int | None = None) -> KvSecret:
        """``GET <mount>/data/<path>[?version=N]``; a deleted or destroyed version is
        ``bao_not_found``."""
        query = f"?version={version}" if version is not None else ""
        doc = await self._authed("GET", f"{_path(mount)}/data/{_path(path)}{query}")
        outer = doc.get("data")
        data = outer.get("data") if isinstance(outer, dict) else None
        meta = outer.get("metadata") if isinstance(outer, dict) else None
        if data is None and isinstance(meta, dict):
            raise OpenBaoError("bao_not_found", f"{mount}/{path}: version deleted or destroyed")
        if not isinstance(data, dict) or not isinstance(meta, dict):
            raise OpenBaoError("bao_malformed", f"{mount}/{path}: not a KV v2 entry")
        got = meta.get("version")
        if not isinstance(got, int) or isinstance(got, bool) or got < 1:
            raise OpenBaoError("bao_malformed", f"{mount}/{path}: no version in metadata")
        if not data or not all(
            isinstance(k, str) and _KEY.fullmatch(k) and isinstance(v, str) for k, v in data.items()
        ):
            raise OpenBaoError(
                "bao_malformed",
                f"{mount}/{path}: a released entry maps file-name keys to string values",
            )
        return KvSecret(dict(data), got)

    async def transit_encrypt(self, mount: str, key: str, plaintext: bytes) -> str:
        doc = await self._authed(
            "POST",
            f"{_path(mount)}/encrypt/{_path(key)}",
            {"plaintext": base64.b64encode(plaintext).decode()},
        )
        data = doc.get("data")
        ct = data.get("ciphertext") if isinstance(data, dict) else None
        if not isinstance(ct, str) or not _TRANSIT_CIPHERTEXT.fullmatch(ct):
            raise OpenBaoError("bao_malformed", "transit encrypt returned no ciphertext")
        return ct

    async def transit_decrypt(self, mount: str, key: str, ciphertext: str) -> tuple[bytes, int]:
        """The plaintext and the key version that had encrypted it."""
        version = transit_version(ciphertext)
        doc = await self._authed(
            "POST", f"{_path(mount)}/decrypt/{_path(key)}", {"ciphertext": ciphertext}
        )
        data = doc.get("data")
        pt = data.get("plaintext") if isinstance(data, dict) else None
        if not isinstance(pt, str):
            raise OpenBaoError("bao_malformed", "transit decrypt returned no plaintext")
        try:
            return base64.b64decode(pt, validate=True), version
        except (binascii.Error, ValueError):
            raise OpenBaoError("bao_malformed", "transit plaintext is not base64") from None


def transit_version(ciphertext: str) -> int:
    """The key version of a transit ciphertext ``vault:v<N>:<base64>``; OpenBaoError
    ``request_malformed`` otherwise (checked before anything reaches OpenBao)."""
    m = _TRANSIT_CIPHERTEXT.fullmatch(ciphertext)
    if m is None:
        raise OpenBaoError("request_malformed", "not a transit ciphertext (vault:v<N>:...)")
    return int(m.group(1))


__all__ = [
    "AppRole",
    "Credential",
    "KvSecret",
    "OpenBaoClient",
    "OpenBaoError",
    "TokenFile",
    "transit_version",
]
