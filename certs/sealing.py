"""Encrypting a released secret to a key that only the attested TEE holds. Pure.

Two envelopes:

* ``seal`` / ``open_sealed``: the mesh's own (secret release over mTLS). The recipient is the
  P-256 public key of the workload's live mesh certificate, the very key its evidence bound
  (``certs.binding``), whose private half never leaves the agent inside the TEE. ECIES with an
  ephemeral key: ECDH-ES on P-256 -> HKDF-SHA256 (salt: both public points; info: a domain
  separator and the release context) -> AES-256-GCM (AAD: the context). The context names the
  SPIFFE ID, the secret and its version, so an envelope cannot be replayed as another secret,
  another version or to another identity.
* ``jwe_encrypt``: the KBS resource response of the CoCo key broker protocol, a JWE in the
  flattened JSON serialization (RFC 7516 7.2.2) to the ``tee-pubkey`` JWK the TEE sent with its
  evidence: ``ECDH-ES+A256KW`` (P-256, Concat KDF per RFC 7518 4.6) or ``RSA-OAEP-256``, content
  ``A256GCM`` with the protected header as AAD. ``RSA1_5`` (which the protocol still lists) is
  refused: PKCS#1 v1.5 encryption invites padding oracles.

Randomness is injected (``random_bytes``, ``ephemeral``) so tests can pin it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.keywrap import aes_key_wrap

from certs.errors import AttestmeshError

SEAL_ALG = "ECDH-ES+HKDF-SHA256+A256GCM"
SEAL_DOMAIN = b"attestmesh/v1/secret-release\x00"
JWE_ECDH = "ECDH-ES+A256KW"
JWE_RSA_OAEP = "RSA-OAEP-256"
JWE_ENC = "A256GCM"
MIN_RSA_BITS = 2048
MAX_RSA_BITS = 8192

RandomBytes = Callable[[int], bytes]


class SealingError(AttestmeshError):
    """A key or envelope that cannot be used (wrong curve, malformed, failed authentication)."""


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_B64URL = re.compile(r"[A-Za-z0-9_-]*")


def unb64url(text: object, what: str) -> bytes:
    """Strict unpadded base64url (RFC 7515 2): other characters, padding or a dangling
    character are refused (the lenient decoder would skip them)."""
    if not isinstance(text, str) or len(text) > 1 << 20:
        raise SealingError("envelope_malformed", f"{what} must be a base64url string")
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise SealingError("envelope_malformed", f"{what} is not unpadded base64url")
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise SealingError("envelope_malformed", f"{what} is not base64url") from None


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace: the same bytes on both sides."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _point(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )


def _p256(key: object) -> ec.EllipticCurvePublicKey:
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise SealingError("key_not_supported", "the recipient key must be EC P-256")
    return key


def _seal_key(z: bytes, epk: bytes, recipient: bytes, context: bytes) -> bytes:
    return HKDF(hashes.SHA256(), 32, salt=epk + recipient, info=SEAL_DOMAIN + context).derive(z)


@dataclass(frozen=True, slots=True)
class ReleaseContext:
    """What a sealed secret is, for whom: authenticated with it, checked by the agent."""

    spiffe_id: str
    secret: str
    version: int

    def as_json(self) -> dict[str, Any]:
        return {"spiffe_id": self.spiffe_id, "secret": self.secret, "version": self.version}


def seal(
    recipient: object,
    plaintext: bytes,
    context: ReleaseContext,
    *,
    random_bytes: RandomBytes = secrets.token_bytes,
    ephemeral: ec.EllipticCurvePrivateKey | None = None,
) -> dict[str, Any]:
    """Encrypt ``plaintext`` to the P-256 public key ``recipient``: a JSON-ready envelope."""
    key = _p256(recipient)
    eph = ephemeral or ec.generate_private_key(ec.SECP256R1())
    epk = _point(eph.public_key())
    ctx = canonical_json(context.as_json())
    cek = _seal_key(eph.exchange(ec.ECDH(), key), epk, _point(key), ctx)
    iv = random_bytes(12)
    return {
        "alg": SEAL_ALG,
        "epk": b64url(epk),
        "iv": b64url(iv),
        "ciphertext": b64url(AESGCM(cek).encrypt(iv, plaintext, ctx)),
        "context": context.as_json(),
    }


def parse_context(value: object) -> ReleaseContext:
    if not isinstance(value, dict) or set(value) != {"spiffe_id", "secret", "version"}:
        raise SealingError("envelope_malformed", "context must be {spiffe_id, secret, version}")
    sid, name, version = value["spiffe_id"], value["secret"], value["version"]
    if not isinstance(sid, str) or not isinstance(name, str):
        raise SealingError("envelope_malformed", "context spiffe_id and secret must be strings")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise SealingError("envelope_malformed", "context version must be an integer >= 0")
    return ReleaseContext(sid, name, version)


def open_sealed(
    private_key: ec.EllipticCurvePrivateKey, envelope: Mapping[str, Any]
) -> tuple[ReleaseContext, bytes]:
    """Decrypt an envelope made by ``seal``; SealingError if it is malformed or was not made
    for this key and this context. The caller compares the context with what it asked for."""
    if envelope.get("alg") != SEAL_ALG:
        raise SealingError("envelope_malformed", f"alg must be {SEAL_ALG}")
    context = parse_context(envelope.get("context"))
    epk_bytes = unb64url(envelope.get("epk"), "epk")
    iv = unb64url(envelope.get("iv"), "iv")
    ciphertext = unb64url(envelope.get("ciphertext"), "ciphertext")
    if len(iv) != 12:
        raise SealingError("envelope_malformed", "iv must be 12 bytes")
    try:
        epk = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), epk_bytes)
    except ValueError:
        raise SealingError("envelope_malformed", "epk is not a P-256 point") from None
    ctx = canonical_json(context.as_json())
    cek = _seal_key(
        private_key.exchange(ec.ECDH(), epk), epk_bytes, _point(private_key.public_key()), ctx
    )
    try:
        return context, AESGCM(cek).decrypt(iv, ciphertext, ctx)
    except InvalidTag:
        raise SealingError("envelope_invalid", "the envelope does not open with this key") from None


# -- JWK / JWE (the KBS protocol) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TeePublicKey:
    """A parsed ``tee-pubkey`` JWK: the key and the JWE ``alg`` its holder asked for."""

    key: ec.EllipticCurvePublicKey | rsa.RSAPublicKey
    alg: str


def _int(value: object, what: str) -> int:
    return int.from_bytes(unb64url(value, what), "big")


def parse_tee_pubkey(jwk: object) -> TeePublicKey:
    """``tee-pubkey`` (a JWK: EC P-256 with alg ECDH-ES+A256KW, or RSA with alg RSA-OAEP-256)."""
    if not isinstance(jwk, dict):
        raise SealingError("tee_pubkey_invalid", "tee-pubkey must be a JWK object")
    kty, alg = jwk.get("kty"), jwk.get("alg")
    if kty == "EC":
        if jwk.get("crv") != "P-256":
            raise SealingError("tee_pubkey_not_supported", "EC tee-pubkey must be crv P-256")
        if alg != JWE_ECDH:
            raise SealingError("tee_pubkey_not_supported", f"EC tee-pubkey alg must be {JWE_ECDH}")
        x, y = unb64url(jwk.get("x"), "x"), unb64url(jwk.get("y"), "y")
        if len(x) != 32 or len(y) != 32:
            raise SealingError("tee_pubkey_invalid", "P-256 coordinates are 32 bytes each")
        try:
            key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), b"\x04" + x + y)
        except ValueError:
            raise SealingError("tee_pubkey_invalid", "not a point on P-256") from None
        return TeePublicKey(key, JWE_ECDH)
    if kty == "RSA":
        if alg != JWE_RSA_OAEP:
            raise SealingError(
                "tee_pubkey_not_supported", f"RSA tee-pubkey alg must be {JWE_RSA_OAEP}"
            )
        n, e = _int(jwk.get("n"), "n"), _int(jwk.get("e"), "e")
        if not MIN_RSA_BITS <= n.bit_length() <= MAX_RSA_BITS or e < 3 or e % 2 == 0:
            raise SealingError("tee_pubkey_invalid", "RSA modulus 2048..8192 bits, odd e >= 3")
        try:
            return TeePublicKey(rsa.RSAPublicNumbers(e, n).public_key(), JWE_RSA_OAEP)
        except ValueError:
            raise SealingError("tee_pubkey_invalid", "not an RSA public key") from None
    raise SealingError("tee_pubkey_not_supported", "tee-pubkey kty must be EC or RSA")


def tee_pubkey_sha256(jwk: Mapping[str, Any]) -> str:
    return hashlib.sha256(canonical_json(dict(jwk))).hexdigest()


def concat_kdf_a256kw(z: bytes, alg: str = JWE_ECDH) -> bytes:
    """RFC 7518 4.6.2 for a 256-bit key: one SHA-256 round over counter 1, Z, AlgorithmID,
    empty PartyUInfo and PartyVInfo, and keydatalen 256."""
    algorithm_id = alg.encode("ascii")
    info = (
        len(algorithm_id).to_bytes(4, "big")
        + algorithm_id
        + (0).to_bytes(4, "big")
        + (0).to_bytes(4, "big")
        + (256).to_bytes(4, "big")
    )
    return hashlib.sha256((1).to_bytes(4, "big") + z + info).digest()


def jwe_encrypt(
    recipient: TeePublicKey,
    plaintext: bytes,
    *,
    random_bytes: RandomBytes = secrets.token_bytes,
    ephemeral: ec.EllipticCurvePrivateKey | None = None,
) -> dict[str, str]:
    """A flattened-serialization JWE of ``plaintext`` to the TEE's key (see the module doc)."""
    cek = random_bytes(32)
    header: dict[str, Any] = {"alg": recipient.alg, "enc": JWE_ENC}
    if isinstance(recipient.key, ec.EllipticCurvePublicKey):
        eph = ephemeral or ec.generate_private_key(ec.SECP256R1())
        numbers = eph.public_key().public_numbers()
        header["epk"] = {
            "kty": "EC",
            "crv": "P-256",
            "x": b64url(numbers.x.to_bytes(32, "big")),
            "y": b64url(numbers.y.to_bytes(32, "big")),
        }
        kek = concat_kdf_a256kw(eph.exchange(ec.ECDH(), recipient.key))
        encrypted_key = aes_key_wrap(kek, cek)
    else:
        encrypted_key = recipient.key.encrypt(
            cek,
            padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None),
        )
    protected = b64url(canonical_json(header))
    iv = random_bytes(12)
    sealed = AESGCM(cek).encrypt(iv, plaintext, protected.encode("ascii"))
    return {
        "protected": protected,
        "encrypted_key": b64url(encrypted_key),
        "iv": b64url(iv),
        "ciphertext": b64url(sealed[:-16]),
        "tag": b64url(sealed[-16:]),
    }


__all__ = [
    "JWE_ECDH",
    "JWE_ENC",
    "JWE_RSA_OAEP",
    "SEAL_ALG",
    "ReleaseContext",
    "SealingError",
    "TeePublicKey",
    "b64url",
    "canonical_json",
    "concat_kdf_a256kw",
    "jwe_encrypt",
    "open_sealed",
    "parse_context",
    "parse_tee_pubkey",
    "seal",
    "tee_pubkey_sha256",
    "unb64url",
]
