"""The CA's state directory: durable private writes and the intermediate slots.

Directory 0700, files 0600, each written to a temporary file, fsynced and renamed (the rename
made durable by syncing the directory). ``root.pem``/``root.key`` (never rewritten),
``intermediate.pem``/``intermediate.key`` (the signing intermediate), ``intermediate-next.json``
(the prepared slot) and ``intermediate-previous.json`` (the previous slot with its activation
time). Keys are dumped and loaded through a ``KeyStore`` (files, or PKCS#11 references).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.ca.templates import Issuer
from certs.errors import AttestmeshError
from certs.keystore import FILE_KEYS, KeyStore

NEXT_SLOT = "intermediate-next.json"
PREVIOUS_SLOT = "intermediate-previous.json"
SLOT_MAX_BYTES = 64 * 1024


def write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    commit(tmp, path)


def commit(tmp: Path, path: Path) -> None:
    """The one step that makes a write visible: rename, then make the rename durable."""
    tmp.replace(path)
    sync_directory(path.parent)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_key(path: Path, key_store: KeyStore = FILE_KEYS) -> ec.EllipticCurvePrivateKey:
    """The key (file store) or the token's key the file refers to (PKCS#11 store)."""
    return key_store.load(path.read_bytes(), str(path))


def slot_json(
    issuer: Issuer, activated_at: datetime | None, key_store: KeyStore = FILE_KEYS
) -> bytes:
    doc: dict[str, str] = {
        "certificate": issuer.cert.public_bytes(serialization.Encoding.PEM).decode(),
        "key": key_store.dump(issuer.key).decode(),
    }
    if activated_at is not None:
        doc["activated_at"] = activated_at.isoformat()
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def read_slot(path: Path, key_store: KeyStore = FILE_KEYS) -> tuple[Issuer, datetime | None]:
    """A slot file as written by ``slot_json`` (written atomically: anything else is damage)."""
    try:
        raw = path.read_bytes()
        if len(raw) > SLOT_MAX_BYTES:
            raise ValueError("slot file too large")
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        cert = x509.load_pem_x509_certificate(str(doc["certificate"]).encode())
        key = key_store.load(str(doc["key"]).encode(), str(path))
        at = doc.get("activated_at")
        activated_at = None if at is None else datetime.fromisoformat(str(at))
        if activated_at is not None and activated_at.utcoffset() is None:
            raise ValueError("activated_at without a time zone")
    except (ValueError, TypeError, KeyError, UnsupportedAlgorithm) as exc:
        raise AttestmeshError("ca_inconsistent", f"{path}: unreadable CA slot: {exc}") from None
    return Issuer(cert, key), activated_at


def finish_activation(
    directory: Path,
    new: Issuer,
    on_disk: Issuer | None = None,
    key_store: KeyStore = FILE_KEYS,
) -> None:
    """Make ``new`` the signing pair on disk (key, then certificate), then empty ``next``.
    Each write is skipped when it is already done, so finishing again is a no-op."""
    if on_disk is None or on_disk.key.public_key() != new.cert.public_key():
        write_private(directory / "intermediate.key", key_store.dump(new.key))
    if on_disk is None or on_disk.cert != new.cert:
        write_private(
            directory / "intermediate.pem", new.cert.public_bytes(serialization.Encoding.PEM)
        )
    remove(directory / NEXT_SLOT)
