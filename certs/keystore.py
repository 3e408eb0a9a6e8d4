"""Where the CA's private keys live: files (the default) or a PKCS#11 token (an HSM).

The CA (``certs.ca``) asks a ``KeyStore`` to ``generate`` a key for a role (root, intermediate),
to ``dump`` it to the bytes it persists in its state directory, and to ``load`` those bytes
back. The file store persists the key itself (PKCS#8 PEM, files 0600). The PKCS#11 store
generates the key pair *in the token* (CKA_TOKEN, CKA_SENSITIVE, not CKA_EXTRACTABLE) and
persists only a reference to it (an RFC 7512 object URI: ``pkcs11:id=...;object=...;type=
private``); the private key never leaves the token, every signature (leaves, CRLs, rotated
intermediates) is made by it.

``Pkcs11PrivateKey`` is an ``ec.EllipticCurvePrivateKey`` whose ``sign`` goes to the token, so
the x509 builders of ``cryptography`` sign with it unchanged. SoftHSM 2.6 has no
CKM_ECDSA_SHA256: the digest is computed here and signed with CKM_ECDSA, and the token's raw
``r || s`` is encoded as the DER ECDSA-Sig-Value X.509 wants.

Selecting the token: ``--ca-key-store 'pkcs11:token=<label>?module-path=<lib.so>&pin-source=
file:<path>'`` (RFC 7512; ``pin-value`` works but puts the PIN on the command line).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol
from urllib.parse import quote, unquote, unquote_to_bytes

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, utils
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed
from cryptography.utils import Buffer

from certs.errors import AttestmeshError

_ROLE = re.compile(r"[a-z][a-z0-9-]{0,31}")
_PATH_ATTRS = frozenset(
    {
        "token", "manufacturer", "serial", "model", "library-manufacturer",
        "library-description", "library-version", "slot-id", "slot-description",
        "slot-manufacturer", "object", "type", "id",
    }
)  # fmt: skip
_QUERY_ATTRS = frozenset(  # x-: vendor attributes (RFC 7512 3.3)
    {"pin-source", "pin-value", "module-name", "module-path", "x-sign-gil", "x-sign-key"}
)
# RFC 7512 pk11-pchar (path values) and pk11-qchar (query values: "/" and "?", not "&")
_PCHAR = re.compile(r"(?:[A-Za-z0-9\-._~:\[\]@!$'()*+,=&]|%[0-9A-Fa-f]{2})*")
_QCHAR = re.compile(r"(?:[A-Za-z0-9\-._~:\[\]@!$'()*+,=/?|]|%[0-9A-Fa-f]{2})*")
_HASHES: Mapping[str, Callable[[Buffer], Any]] = {
    "sha256": hashlib.sha256,
    "sha384": hashlib.sha384,
    "sha512": hashlib.sha512,
}


class KeyStoreError(AttestmeshError):
    """A key store that cannot be used: bad URI, no token, wrong PIN, missing key object."""


class KeyStore(Protocol):
    name: str
    # what ``open_key_store`` opens again as this store (in another process: a worker that
    # signs with the same key); may hold a PIN: never logged
    spec: str

    def generate(self, role: str) -> ec.EllipticCurvePrivateKey: ...

    def dump(self, key: ec.EllipticCurvePrivateKey) -> bytes: ...

    def load(self, data: bytes, where: str) -> ec.EllipticCurvePrivateKey: ...


# ---------------------------------------------------------------------------------------------
# files


class FileKeyStore:
    """The keys themselves, PKCS#8 PEM, in the CA's state directory (mode 0600)."""

    name = "file"
    spec = "file"

    def generate(self, role: str) -> ec.EllipticCurvePrivateKey:
        return ec.generate_private_key(ec.SECP256R1())

    def dump(self, key: ec.EllipticCurvePrivateKey) -> bytes:
        if isinstance(key, Pkcs11PrivateKey):
            raise KeyStoreError("ca_key_store_mismatch", "a token's key cannot be written out")
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def load(self, data: bytes, where: str) -> ec.EllipticCurvePrivateKey:
        if data.lstrip().startswith(b"pkcs11:"):
            raise KeyStoreError(
                "ca_key_store_mismatch",
                f"{where} refers to a key in a PKCS#11 token: start with --ca-key-store pkcs11:...",
            )
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as exc:
            raise KeyStoreError("ca_key_invalid", f"{where}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise KeyStoreError("ca_key_invalid", f"{where} is not an EC private key")
        return key


FILE_KEYS = FileKeyStore()


# ---------------------------------------------------------------------------------------------
# RFC 7512 URIs


@dataclass(frozen=True, slots=True)
class Pkcs11Uri:
    """A parsed ``pkcs11:`` URI: path attributes (token selection, object) and query
    attributes (module, PIN). ``__repr__`` never shows a PIN."""

    path: Mapping[str, str]
    query: Mapping[str, str]

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.query.items() if k != "pin-value"}
        return f"Pkcs11Uri(path={dict(self.path)}, query={shown})"

    @property
    def id_bytes(self) -> bytes | None:
        raw = self.path.get("id")
        return None if raw is None else unquote_to_bytes(raw)

    @property
    def module_path(self) -> str:
        module = self.query.get("module-path")
        if not module:
            raise KeyStoreError("keystore_uri_invalid", "the pkcs11: URI needs module-path")
        return module

    def pin(self) -> str:
        if "pin-value" in self.query:
            return self.query["pin-value"]
        source = self.query.get("pin-source")
        if source is None:
            raise KeyStoreError("keystore_uri_invalid", "the pkcs11: URI needs pin-source")
        path = Path(source[5:] if source.startswith("file:") else source)
        try:
            pin = path.read_text().strip()
        except OSError as exc:
            raise KeyStoreError("keystore_pin", f"pin-source {path}: {exc.strerror}") from None
        if not pin:
            raise KeyStoreError("keystore_pin", f"pin-source {path} is empty")
        return pin


def _unpct(value: str, what: str, chars: re.Pattern[str]) -> str:
    if not chars.fullmatch(value):
        raise KeyStoreError("keystore_uri_invalid", f"{what}: not a valid URI component")
    return unquote(value, errors="strict")


def _attrs(
    part: str, sep: str, allowed: frozenset[str], what: str, chars: re.Pattern[str]
) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in part.split(sep) if part else []:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise KeyStoreError("keystore_uri_invalid", f"{what}: {item!r} is not name=value")
        if name not in allowed:
            raise KeyStoreError("keystore_uri_invalid", f"{what}: unknown attribute {name!r}")
        if name in out:
            raise KeyStoreError("keystore_uri_invalid", f"{what}: {name} given twice")
        try:  # id is binary: kept percent-encoded (Pkcs11Uri.id_bytes)
            out[name] = value if name == "id" else _unpct(value, f"{what} {name}", chars)
            if name == "id" and not _PCHAR.fullmatch(value):
                raise KeyStoreError("keystore_uri_invalid", f"{what} id: not a URI component")
        except UnicodeDecodeError:
            raise KeyStoreError("keystore_uri_invalid", f"{name}: not UTF-8") from None
    return out


def parse_pkcs11_uri(text: str) -> Pkcs11Uri:
    """RFC 7512: ``pkcs11:`` path attributes separated by ``;``, then ``?`` and query
    attributes separated by ``&``; values percent-encoded. Unknown attributes are refused."""
    if not isinstance(text, str) or not text.startswith("pkcs11:") or len(text) > 4096:
        raise KeyStoreError("keystore_uri_invalid", "a PKCS#11 URI starts with pkcs11:")
    body = text[len("pkcs11:") :]
    path_part, _, query_part = body.partition("?")
    path = _attrs(path_part, ";", _PATH_ATTRS, "pkcs11 path", _PCHAR)
    query = _attrs(query_part, "&", _QUERY_ATTRS, "pkcs11 query", _QCHAR)
    if "pin-value" in query and "pin-source" in query:
        raise KeyStoreError("keystore_uri_invalid", "pin-value and pin-source exclude each other")
    return Pkcs11Uri(path, query)


def object_uri(key_id: bytes, label: str) -> str:
    """The reference persisted for a key in the token (no key material)."""
    pct_id = "".join(f"%{b:02x}" for b in key_id)
    return f"pkcs11:id={pct_id};object={quote(label, safe='')};type=private"


# ---------------------------------------------------------------------------------------------
# PKCS#11


def _raise(exc: Exception, what: str) -> NoReturn:
    raise KeyStoreError("keystore_unavailable", f"PKCS#11 {what}: {type(exc).__name__}") from None


class Pkcs11PrivateKey(ec.EllipticCurvePrivateKey):
    """A P-256 private key held by the token; only signing is possible."""

    def __init__(self, store: Pkcs11KeyStore, handle: Any, public: ec.EllipticCurvePublicKey,
                 key_id: bytes, label: str) -> None:  # fmt: skip
        self._store = store
        self._handle = handle  # the token object
        self._signer = store.signing_handle(handle)  # what signs: its in-token session copy
        self._public = public
        self.key_id = key_id
        self.label = label

    def sign(self, data: Buffer, signature_algorithm: ec.EllipticCurveSignatureAlgorithm) -> bytes:
        if not isinstance(signature_algorithm, ec.ECDSA):
            raise KeyStoreError("keystore_unsupported", "the token signs ECDSA only")
        algorithm = signature_algorithm.algorithm
        if isinstance(algorithm, Prehashed):
            digest = bytes(data)
        else:
            hasher = _HASHES.get(algorithm.name)
            if hasher is None:
                raise KeyStoreError("keystore_unsupported", f"no {algorithm.name} signatures")
            digest = hasher(data).digest()
        raw = self._store.sign_digest(self._signer, digest)
        half = len(raw) // 2
        if len(raw) != 64:
            raise KeyStoreError("keystore_unavailable", "the token's ECDSA signature is not r||s")
        return utils.encode_dss_signature(
            int.from_bytes(raw[:half], "big"), int.from_bytes(raw[half:], "big")
        )

    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self._public

    @property
    def curve(self) -> ec.EllipticCurve:
        return self._public.curve

    @property
    def key_size(self) -> int:
        return self._public.key_size

    def exchange(self, algorithm: ec.ECDH, peer_public_key: ec.EllipticCurvePublicKey) -> bytes:
        raise KeyStoreError("keystore_unsupported", "a CA key in the token only signs")

    def private_numbers(self) -> ec.EllipticCurvePrivateNumbers:
        raise KeyStoreError("keystore_unsupported", "the token's key does not leave it")

    def private_bytes(
        self,
        encoding: serialization.Encoding,
        format: serialization.PrivateFormat,
        encryption_algorithm: serialization.KeySerializationEncryption,
    ) -> bytes:
        raise KeyStoreError("keystore_unsupported", "the token's key does not leave it")

    def __copy__(self) -> Pkcs11PrivateKey:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> Pkcs11PrivateKey:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pkcs11PrivateKey) and (
            (self._store, self.key_id) == (other._store, other.key_id)
        )

    def __hash__(self) -> int:
        return hash(self.key_id)

    def __repr__(self) -> str:
        return f"Pkcs11PrivateKey({self.label})"


class _Mechanism(ctypes.Structure):
    _fields_ = (
        ("mechanism", ctypes.c_ulong),
        ("parameter", ctypes.c_void_p),
        ("parameter_len", ctypes.c_ulong),
    )


CKM_ECDSA = 0x1041
CKR_OK = 0


class _DirectSign:
    """C_SignInit + C_Sign (CKM_ECDSA, one call with a 64-byte buffer) called through
    ``ctypes.PyDLL``: the GIL stays held for the ~50 us a local token takes. The module is the
    one python-pkcs11 loaded and initialised (dlopen returns the same handle): the session and
    key handles are shared."""

    def __init__(self, dll: ctypes.PyDLL) -> None:
        self._init = dll.C_SignInit
        self._init.argtypes = (ctypes.c_ulong, ctypes.POINTER(_Mechanism), ctypes.c_ulong)
        self._init.restype = ctypes.c_ulong
        self._sign = dll.C_Sign
        self._sign.argtypes = (
            ctypes.c_ulong,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_ulong),
        )
        self._sign.restype = ctypes.c_ulong
        self._mech = _Mechanism(CKM_ECDSA, None, 0)

    @classmethod
    def load(cls, module_path: str) -> _DirectSign | None:
        try:
            return cls(ctypes.PyDLL(module_path))
        except (OSError, AttributeError):
            return None  # no exported C_Sign: python-pkcs11's function list it is

    def sign(self, session: int, key: int, digest: bytes) -> bytes:
        rv = self._init(session, ctypes.byref(self._mech), key)
        if rv != CKR_OK:
            raise KeyStoreError("keystore_unavailable", f"PKCS#11 C_SignInit: 0x{rv:x}")
        out = ctypes.create_string_buffer(132)
        length = ctypes.c_ulong(len(out))
        rv = self._sign(session, digest, len(digest), out, ctypes.byref(length))
        if rv != CKR_OK:
            raise KeyStoreError("keystore_unavailable", f"PKCS#11 C_Sign: 0x{rv:x}")
        return out.raw[: length.value]


class Pkcs11KeyStore:
    """Keys in one PKCS#11 token (python-pkcs11). One logged-in read/write session for key
    management, serialised by a lock (a session is not for concurrent use); signatures use a
    session per thread, so concurrent issuance does not queue on one session.

    Signatures are made with a *session copy* of each key (C_CopyObject, CKA_TOKEN false,
    inside the token, still sensitive and not extractable, gone when this store's session
    closes): a token object is read through the token's object store on every use (SoftHSM's
    file store opens, locks and reads the object's files on each attribute access: ~12
    syscalls per signature, made holding the GIL), a session object is in the token's
    memory. A token that refuses the copy (CKA_COPYABLE false) signs with the token object.
    ``x-sign-key=token`` in the URI turns the copy off."""

    name = "pkcs11"

    def __init__(self, uri: Pkcs11Uri, spec: str = "") -> None:
        import pkcs11
        from pkcs11 import exceptions as p11e

        self._uri = uri
        self.spec = spec  # the URI as given (open_key_store): a worker process opens it again
        self._lock = threading.Lock()
        selection = {
            k: v
            for k, v in (
                ("token_label", uri.path.get("token")),
                ("token_serial", uri.path.get("serial", "").encode() or None),
            )
            if v
        }
        if not selection:
            raise KeyStoreError("keystore_uri_invalid", "the pkcs11: URI needs token= (or serial=)")
        try:
            lib = pkcs11.lib(uri.module_path)
        except (RuntimeError, OSError, p11e.PKCS11Error) as exc:
            _raise(exc, f"module {uri.module_path}")
        try:
            token = lib.get_token(**selection)
        except p11e.NoSuchToken:
            lib.reinitialize()  # a token created since the module was loaded
            try:
                token = lib.get_token(**selection)
            except p11e.NoSuchToken:
                raise KeyStoreError(
                    "keystore_unavailable", f"no PKCS#11 token {selection}"
                ) from None
        except p11e.PKCS11Error as exc:
            _raise(exc, "token")
        try:
            self._session = token.open(rw=True, user_pin=uri.pin())
        except p11e.UserAlreadyLoggedIn:
            # login state is per process and token: another store here logged in already
            # (a CA reloaded in the same process); its sessions share it
            try:
                self._session = token.open(rw=True)
            except p11e.PKCS11Error as exc:
                _raise(exc, "session")
        except p11e.PinIncorrect:
            raise KeyStoreError("keystore_pin", "the token refused the PIN") from None
        except p11e.PKCS11Error as exc:
            _raise(exc, "login")
        self._p11 = pkcs11
        self._token = token
        self._local = threading.local()
        self._thread_sessions: list[Any] = []
        self._ecdsa = pkcs11.Mechanism.ECDSA  # raw ECDSA over our digest (SoftHSM 2.6)
        # x-sign-gil=hold (default): sign through the module's C_SignInit/C_Sign holding the
        # GIL; =release: through python-pkcs11, which releases it around every call (right for
        # a network HSM taking milliseconds; for a local token each of the several GIL
        # re-acquisitions can wait a whole switch interval behind the event loop: measured
        # 0.47x the file key's issuance rate, against 0.93x holding it)
        mode = uri.query.get("x-sign-gil", "hold")
        if mode not in ("hold", "release"):
            raise KeyStoreError("keystore_uri_invalid", "x-sign-gil is hold or release")
        self._direct = _DirectSign.load(uri.module_path) if mode == "hold" else None
        sign_key = uri.query.get("x-sign-key", "session")
        if sign_key not in ("session", "token"):
            raise KeyStoreError("keystore_uri_invalid", "x-sign-key is session or token")
        self._copy_keys = sign_key == "session"

    def __repr__(self) -> str:
        return f"Pkcs11KeyStore({self._uri!r})"

    def close(self) -> None:
        with self._lock:
            for session in self._thread_sessions:
                session.close()
            self._thread_sessions.clear()
            self._session.close()

    def _thread_session(self) -> int:
        """A session of this thread's own (sessions are not for concurrent use; the login
        and the key handles are the token's, shared by every session of this process)."""
        session = getattr(self._local, "session", None)
        if session is None:
            try:
                session = self._token.open()
            except self._p11.exceptions.PKCS11Error as exc:
                _raise(exc, "session")
            self._local.session = session
            with self._lock:
                self._thread_sessions.append(session)
        return int(session.handle)  # type: ignore[union-attr]  # Cython attribute, untyped

    def signing_handle(self, key: Any) -> Any:
        """The object that signs for the token key ``key``: its session copy, or ``key``."""
        if not self._copy_keys:
            return key
        attr = self._p11.Attribute
        with self._lock:
            try:
                copy = key.copy({attr.TOKEN: False})
            except self._p11.exceptions.PKCS11Error:
                return key  # CKA_COPYABLE false, or a token without C_CopyObject
            try:
                if copy[attr.TOKEN] or copy[attr.EXTRACTABLE] or not copy[attr.SENSITIVE]:
                    copy.destroy()
                    raise KeyStoreError("ca_key_invalid", "the token's key copy is extractable")
            except self._p11.exceptions.PKCS11Error as exc:
                _raise(exc, "key copy")
        return copy

    def sign_digest(self, handle: Any, digest: bytes) -> bytes:
        if self._direct is not None:
            return self._direct.sign(self._thread_session(), handle.handle, digest)
        with self._lock:
            try:
                return bytes(handle.sign(digest, mechanism=self._ecdsa))
            except self._p11.exceptions.PKCS11Error as exc:
                _raise(exc, "sign")

    def _token_key(self, object_class: Any, key_id: bytes) -> Any:
        """The token object (not a session copy) of that class and CKA_ID; lock held."""
        from pkcs11 import Attribute, KeyType

        found = list(
            self._session.get_objects(
                {
                    Attribute.CLASS: object_class,
                    Attribute.KEY_TYPE: KeyType.EC,
                    Attribute.ID: key_id,
                    Attribute.TOKEN: True,
                }
            )
        )
        if not found:
            raise self._p11.exceptions.NoSuchKey("no such key")
        if len(found) > 1:
            raise self._p11.exceptions.MultipleObjectsReturned("several keys with that id")
        return found[0]

    def _public_of(self, key_id: bytes) -> ec.EllipticCurvePublicKey:
        from pkcs11 import ObjectClass
        from pkcs11.util.ec import encode_ec_public_key

        pub = self._token_key(ObjectClass.PUBLIC_KEY, key_id)
        key = serialization.load_der_public_key(encode_ec_public_key(pub))
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
            key.curve, ec.SECP256R1
        ):
            raise KeyStoreError("ca_key_invalid", "the token's key is not P-256")
        return key

    def generate(self, role: str) -> ec.EllipticCurvePrivateKey:
        from pkcs11 import Attribute, KeyType
        from pkcs11 import exceptions as p11e
        from pkcs11.util.ec import encode_named_curve_parameters

        if not _ROLE.fullmatch(role):
            raise KeyStoreError("keystore_unsupported", f"role {role!r}")
        key_id = secrets.token_bytes(16)
        label = f"attestmesh-{role}-{key_id[:4].hex()}"
        with self._lock:
            try:
                params = self._session.create_domain_parameters(
                    KeyType.EC,
                    {Attribute.EC_PARAMS: encode_named_curve_parameters("1.2.840.10045.3.1.7")},
                    local=True,
                )
                _, priv = params.generate_keypair(
                    id=key_id,
                    label=label,
                    store=True,
                    public_template={Attribute.VERIFY: True, Attribute.TOKEN: True},
                    private_template={
                        Attribute.SIGN: True,
                        Attribute.TOKEN: True,
                        Attribute.PRIVATE: True,
                        Attribute.SENSITIVE: True,
                        Attribute.EXTRACTABLE: False,
                    },
                )
                public = self._public_of(key_id)
            except p11e.PKCS11Error as exc:
                _raise(exc, "key generation")
        return Pkcs11PrivateKey(self, priv, public, key_id, label)

    def dump(self, key: ec.EllipticCurvePrivateKey) -> bytes:
        if not isinstance(key, Pkcs11PrivateKey) or key._store is not self:
            raise KeyStoreError(
                "ca_key_store_mismatch", "only keys generated in this token are kept by reference"
            )
        return (object_uri(key.key_id, key.label) + "\n").encode()

    def load(self, data: bytes, where: str) -> ec.EllipticCurvePrivateKey:
        from pkcs11 import Attribute, ObjectClass
        from pkcs11 import exceptions as p11e

        text = data.decode("utf-8", errors="replace").strip()
        if not text.startswith("pkcs11:"):
            raise KeyStoreError(
                "ca_key_store_mismatch",
                f"{where} holds a key in a file, not a reference into the token; this CA was "
                "created with the file key store",
            )
        ref = parse_pkcs11_uri(text)
        key_id = ref.id_bytes
        if not key_id or ref.path.get("type", "private") != "private":
            raise KeyStoreError("ca_key_invalid", f"{where}: not a private key reference")
        with self._lock:
            try:
                priv = self._token_key(ObjectClass.PRIVATE_KEY, key_id)
                if priv[Attribute.EXTRACTABLE] or not priv[Attribute.SENSITIVE]:
                    raise KeyStoreError(
                        "ca_key_invalid", f"{where}: the token's key is extractable"
                    )
                public = self._public_of(key_id)
            except p11e.NoSuchKey:
                raise KeyStoreError(
                    "ca_key_missing", f"{where}: the token has no key {ref.path.get('object')}"
                ) from None
            except p11e.PKCS11Error as exc:
                _raise(exc, "key lookup")
        return Pkcs11PrivateKey(self, priv, public, key_id, ref.path.get("object", ""))


def open_key_store(spec: str | None) -> KeyStore:
    """``None`` or ``file``: keys in files; ``pkcs11:...``: keys in that token."""
    if spec is None or spec == "file":
        return FILE_KEYS
    return Pkcs11KeyStore(parse_pkcs11_uri(spec), spec)


__all__ = [
    "FILE_KEYS",
    "FileKeyStore",
    "KeyStore",
    "KeyStoreError",
    "Pkcs11KeyStore",
    "Pkcs11PrivateKey",
    "Pkcs11Uri",
    "object_uri",
    "open_key_store",
    "parse_pkcs11_uri",
]
