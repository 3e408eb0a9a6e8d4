"""The agent's side of secret release: ask with the attested certificate, open, hand over.

``SecretFetcher`` is a ``CertSink``: the agent hands it every new certificate and key (the key
made inside the TEE and bound in the evidence). With them it asks the control plane's secret
port over mutual TLS for each wanted secret, then every ``poll_s`` seconds again with the
version it holds (an unchanged secret is answered ``unchanged``; a rotated one, a new KV
version, arrives sealed and replaces the old). The envelope is opened with the private key and
its authenticated context must name this workload's SPIFFE ID, the secret asked for and the
version announced.

Delivery: a directory on a memory-backed volume (the webhook mounts an emptyDir with medium
Memory), ``<dir>/<secret>/<key>`` one file per KV key like a Kubernetes secret volume, written
atomically with mode 0400; and/or a local Unix socket (mode 0600) answering
``GET /v1/secrets/<secret>`` with the JSON map. A refusal (quarantine, policy change) deletes
what was delivered of that secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import AttestmeshError
from certs.sealing import SealingError, open_sealed

log = logging.getLogger(__name__)
_NAME = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}")
# refusals that mean "not yours any more" (a renewal race, an outage: keep it and retry)
DROP_ON = frozenset({"not_allowed", "quarantined", "not_attested", "secret_unavailable"})
_SPIFFE_NS = re.compile(r"spiffe://[^/]+/ns/([a-z0-9-]+)/sa/[a-z0-9-]+")


class SecretFetchError(AttestmeshError):
    """A secret could not be fetched or opened (reason: refused code, or envelope_*)."""

    def __init__(self, reason: str, detail: str = "", status: int = 0) -> None:
        super().__init__(reason, detail)
        self.status = status


@dataclass(frozen=True, slots=True)
class Held:
    ref: str
    version: int
    data: Mapping[str, str]

    def __repr__(self) -> str:  # never the values
        return f"Held({self.ref}, v{self.version}, keys={sorted(self.data)})"


@dataclass(frozen=True, slots=True)
class _Identity:
    key: ec.EllipticCurvePrivateKey
    spiffe_id: str
    namespace: str
    ssl: ssl.SSLContext


def parse_secret_data(plaintext: bytes) -> dict[str, str]:
    """The released plaintext: a JSON object of file-name keys to string values."""
    try:
        doc = json.loads(plaintext)
    except (ValueError, UnicodeDecodeError):
        raise SecretFetchError("secret_malformed", "the secret is not a JSON object") from None
    if (
        not isinstance(doc, dict)
        or not doc
        or not all(isinstance(k, str) and _KEY.fullmatch(k) for k in doc)
        or not all(isinstance(v, str) for v in doc.values())
        or any(k in (".", "..") for k in doc)
    ):
        raise SecretFetchError("secret_malformed", "the secret maps file names to strings")
    return dict(doc)


def expected_ref(spelled: str, namespace: str) -> str:
    return spelled if "/" in spelled else f"{namespace}/{spelled}"


class SecretFetcher:
    def __init__(
        self,
        *,
        url: str,
        workload: str,
        secrets: Sequence[str],
        bundle_pem: bytes,
        directory: Path | None,
        tls_dir: Path,
        poll_s: float = 30.0,
        timeout_s: float = 5.0,
        jitter: Callable[[], float] = random.random,
        file_mode: int = 0o400,
    ) -> None:
        bad = [s for s in secrets if not _NAME.fullmatch(s)]
        if bad or not secrets:
            raise SecretFetchError("usage", f"secrets are name or namespace/name: {bad}")
        self._url = url.rstrip("/")
        self._workload = workload
        self._wanted = tuple(dict.fromkeys(secrets))
        self._bundle = bundle_pem
        self._dir = directory
        self._tls_dir = tls_dir
        self._poll_s = poll_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._jitter = jitter
        self._file_mode = file_mode
        self._identity: _Identity | None = None
        self._new_cert = asyncio.Event()
        self.held: dict[str, Held] = {}
        self.last_error: dict[str, SecretFetchError] = {}
        self.changed = asyncio.Event()

    # -- CertSink ---------------------------------------------------------------------------
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise SecretFetchError("key_not_supported", "the mesh key is EC P-256")
        leaf = x509.load_pem_x509_certificates(cert_chain_pem)[0]
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
        m = _SPIFFE_NS.fullmatch(uris[0]) if uris else None
        if m is None:
            raise SecretFetchError("identity_malformed", "the certificate names no SPIFFE ID")
        self._identity = _Identity(
            key, uris[0], m.group(1), self._client_tls(cert_chain_pem, key_pem)
        )
        self._new_cert.set()

    def _client_tls(self, chain_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
        """A client context presenting this certificate. ``ssl`` loads keys from paths only:
        anonymous memory files (``memfd_create``, read through ``/proc/self/fd``) where the
        kernel has them, so the key touches no file system at all (the secrets volume is
        shared with the application); else files for the call, mode 0600, in ``tls_dir``."""
        ctx = ssl.create_default_context(cadata=self._bundle.decode())
        if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
            fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("chain", "key")]
            try:
                for fd, data in zip(fds, (chain_pem, key_pem), strict=True):
                    os.write(fd, data)
                ctx.load_cert_chain(f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}")
            finally:
                for fd in fds:
                    os.close(fd)
            return ctx
        self._tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        chain, key = self._tls_dir / "client.pem", self._tls_dir / "client.key"
        try:
            for path, data in ((chain, chain_pem), (key, key_pem)):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            ctx.load_cert_chain(chain, key)
        finally:
            for path in (chain, key):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return ctx

    # -- one round ------------------------------------------------------------------------
    async def _post(
        self,
        session: aiohttp.ClientSession,
        ident: _Identity,
        body: Mapping[str, Any],
        op: str = "release",
    ) -> dict[str, Any]:
        try:
            async with session.post(
                f"{self._url}/v1/secrets/{op}", json=body, ssl=ident.ssl, timeout=self._timeout
            ) as resp:
                data = await resp.json(content_type=None)
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise SecretFetchError("control_plane_unreachable", type(exc).__name__) from None
        if not isinstance(data, dict):
            raise SecretFetchError("response_malformed", "not a JSON object", status)
        if status != 200:
            raise SecretFetchError(
                str(data.get("error", "http_error")), str(data.get("detail", "")), status
            )
        return data

    async def fetch(self, session: aiohttp.ClientSession, spelled: str) -> Held:
        """Ask for one secret; the new ``Held`` (or the one held when unchanged)."""
        ident = self._identity
        if ident is None:
            raise SecretFetchError("no_certificate", "not attested yet")
        ref = expected_ref(spelled, ident.namespace)
        held = self.held.get(spelled)
        body: dict[str, Any] = {"workload": self._workload, "secret": spelled}
        if held is not None:
            body["have_version"] = held.version
        data = await self._post(session, ident, body)
        version = data.get("version")
        if data.get("secret") != ref or not isinstance(version, int):
            raise SecretFetchError("response_malformed", "the answer names another secret")
        if data.get("unchanged") is True:
            if held is None or held.version != version:
                raise SecretFetchError("response_malformed", "unchanged, but not what is held")
            return held
        envelope = data.get("envelope")
        if not isinstance(envelope, dict):
            raise SecretFetchError("response_malformed", "no envelope")
        try:
            context, plaintext = open_sealed(ident.key, envelope)
        except SealingError as exc:
            raise SecretFetchError(exc.reason, exc.detail) from None
        if (context.spiffe_id, context.secret, context.version) != (ident.spiffe_id, ref, version):
            raise SecretFetchError("envelope_context", "sealed for another identity or secret")
        return Held(ref, version, parse_secret_data(plaintext))

    async def unwrap(self, session: aiohttp.ClientSession, spelled: str, ciphertext: str) -> bytes:
        """A transit ciphertext decrypted by the control plane, sealed to this workload's key:
        the plaintext (e.g. a model decryption key), opened here and never written."""
        ident = self._identity
        if ident is None:
            raise SecretFetchError("no_certificate", "not attested yet")
        body = {"workload": self._workload, "secret": spelled, "ciphertext": ciphertext}
        data = await self._post(session, ident, body, "unwrap")
        envelope, version = data.get("envelope"), data.get("version")
        if not isinstance(envelope, dict) or not isinstance(version, int):
            raise SecretFetchError("response_malformed", "no envelope")
        try:
            context, plaintext = open_sealed(ident.key, envelope)
        except SealingError as exc:
            raise SecretFetchError(exc.reason, exc.detail) from None
        want = (ident.spiffe_id, expected_ref(spelled, ident.namespace), version)
        if (context.spiffe_id, context.secret, context.version) != want:
            raise SecretFetchError("envelope_context", "sealed for another identity or secret")
        return plaintext

    async def fetch_all(self, session: aiohttp.ClientSession) -> None:
        for spelled in self._wanted:
            try:
                new = await self.fetch(session, spelled)
            except SecretFetchError as exc:
                self.last_error[spelled] = exc
                log.warning("secret %s: %s (%s)", spelled, exc.reason, exc.detail)
                if exc.reason in DROP_ON:  # no longer released: drop what was delivered
                    self._drop(spelled)
                continue
            self.last_error.pop(spelled, None)
            if self.held.get(spelled) != new:
                self._deliver(spelled, new)
                log.info("secret %s: version %d delivered", new.ref, new.version)

    # -- delivery -------------------------------------------------------------------------
    def _deliver(self, spelled: str, held: Held) -> None:
        if self._dir is not None:
            write_secret_dir(self._dir / spelled.replace("/", "."), held.data, self._file_mode)
        self.held[spelled] = held
        self.changed.set()

    def _drop(self, spelled: str) -> None:
        if self.held.pop(spelled, None) is not None:
            self.changed.set()
        if self._dir is not None:
            remove_secret_dir(self._dir / spelled.replace("/", "."))

    # -- loop -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                if self._identity is not None:
                    await self.fetch_all(session)
                wait = self._poll_s * (0.75 + 0.5 * self._jitter())
                self._new_cert.clear()
                waiters = [asyncio.ensure_future(e.wait()) for e in (stop, self._new_cert)]
                try:
                    await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for t in waiters:
                        t.cancel()


class FanOut:
    """A CertSink handing every new certificate to several sinks (SDS, secret fetcher)."""

    def __init__(self, *sinks: Any) -> None:
        self._sinks = sinks

    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        for sink in self._sinks:
            sink.update(cert_chain_pem, key_pem)


def write_secret_dir(directory: Path, data: Mapping[str, str], mode: int = 0o400) -> None:
    """``directory/<key>`` per key, each replaced atomically (``mode``); keys no longer in
    ``data`` are removed. The directory is private unless ``mode`` shares the files."""
    directory.mkdir(mode=0o700 if mode & 0o077 == 0 else 0o755, parents=True, exist_ok=True)
    for key, value in data.items():
        tmp = directory / f".{key}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(value)
            os.fchmod(f.fileno(), mode)  # exactly ``mode``, whatever the umask
        tmp.replace(directory / key)
    for path in directory.iterdir():
        if path.name not in data:
            path.unlink()


def remove_secret_dir(directory: Path) -> None:
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def build_socket_app(fetcher: SecretFetcher) -> web.Application:
    """``GET /v1/secrets/{name}`` on the local socket: the held JSON map, 404 when none."""

    async def get(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        held = fetcher.held.get(name) or fetcher.held.get(name.replace(".", "/", 1))
        if held is None:
            return web.json_response({"error": "not_held"}, status=404)
        return web.json_response(
            {"secret": held.ref, "version": held.version, "data": dict(held.data)}
        )

    app = web.Application()
    app.router.add_get("/v1/secrets/{name}", get)
    return app


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


async def start_socket(fetcher: SecretFetcher, path: Path) -> web.AppRunner:
    runner = web.AppRunner(build_socket_app(fetcher), access_log=None)
    await runner.setup()
    _remove(path)
    old = os.umask(0o177)
    try:
        await web.UnixSite(runner, str(path)).start()
    finally:
        os.umask(old)
    return runner


__all__ = [
    "FanOut",
    "Held",
    "SecretFetchError",
    "SecretFetcher",
    "build_socket_app",
    "expected_ref",
    "parse_secret_data",
    "remove_secret_dir",
    "start_socket",
    "write_secret_dir",
]
