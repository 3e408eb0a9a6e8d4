"""certs/sealing.py: the secret-release envelope and the KBS JWE.

The envelope opens only with the recipient's key and only under the context it was sealed
for; any change to context, ephemeral key, IV or ciphertext fails authentication. The JWE is
decrypted here by an independent reading of RFC 7516/7518 (Concat KDF written out again in the
test, AES key unwrap, OAEP-SHA256)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.keywrap import aes_key_unwrap
from hypothesis import given
from hypothesis import strategies as st

from certs.sealing import (
    ReleaseContext,
    SealingError,
    b64url,
    jwe_encrypt,
    open_sealed,
    parse_tee_pubkey,
    seal,
    unb64url,
)

KEY = ec.generate_private_key(ec.SECP256R1())
CTX = ReleaseContext("spiffe://td/ns/a/sa/web", "a/db", 3)


def test_round_trip_and_context() -> None:
    env = seal(KEY.public_key(), b"hunter2", CTX)
    assert b"hunter2" not in json.dumps(env).encode()
    assert open_sealed(KEY, env) == (CTX, b"hunter2")
    # a fresh ephemeral key per envelope: the same secret seals differently each time
    assert seal(KEY.public_key(), b"hunter2", CTX)["epk"] != env["epk"]


def test_another_key_cannot_open() -> None:
    env = seal(KEY.public_key(), b"s", CTX)
    with pytest.raises(SealingError) as e:
        open_sealed(ec.generate_private_key(ec.SECP256R1()), env)
    assert e.value.reason == "envelope_invalid"


@pytest.mark.parametrize(
    "context",
    [
        {"spiffe_id": "spiffe://td/ns/a/sa/other", "secret": "a/db", "version": 3},
        {"spiffe_id": CTX.spiffe_id, "secret": "a/other", "version": 3},
        {"spiffe_id": CTX.spiffe_id, "secret": "a/db", "version": 2},
    ],
)
def test_relabelled_context_fails(context: dict[str, Any]) -> None:
    env = seal(KEY.public_key(), b"s", CTX)
    env["context"] = context
    with pytest.raises(SealingError) as e:
        open_sealed(KEY, env)
    assert e.value.reason == "envelope_invalid"


@pytest.mark.parametrize("field", ["epk", "iv", "ciphertext"])
def test_any_flipped_bit_fails(field: str) -> None:
    env = seal(KEY.public_key(), b"secret value", CTX)
    raw = bytearray(unb64url(env[field], field))
    raw[-1] ^= 1
    env[field] = b64url(bytes(raw))
    with pytest.raises(SealingError):
        open_sealed(KEY, env)


def test_only_p256_recipients() -> None:
    with pytest.raises(SealingError):
        seal(ec.generate_private_key(ec.SECP384R1()).public_key(), b"s", CTX)
    with pytest.raises(SealingError):
        seal(rsa.generate_private_key(65537, 2048).public_key(), b"s", CTX)


@pytest.mark.parametrize("text", ["a+b/", "ab==", "a", "ab cd", "é"])
def test_base64url_is_strict(text: str) -> None:
    with pytest.raises(SealingError):
        unb64url(text, "x")


@given(st.dictionaries(st.text(max_size=12), st.recursive(st.text(max_size=40), st.lists)))
def test_arbitrary_envelopes_raise_only_sealing_error(doc: dict[str, Any]) -> None:
    with pytest.raises(SealingError):
        open_sealed(KEY, doc)


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_arbitrary_bytes_in_fields_raise_only_sealing_error(epk: bytes, ct: bytes) -> None:
    env = seal(KEY.public_key(), b"s", CTX)
    env["epk"], env["ciphertext"] = b64url(epk), b64url(ct)
    with pytest.raises(SealingError):
        open_sealed(KEY, env)


# -- JWE ---------------------------------------------------------------------------------


def _unb64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _jwk_ec(key: ec.EllipticCurvePrivateKey) -> dict[str, str]:
    n = key.public_key().public_numbers()
    return {
        "kty": "EC",
        "crv": "P-256",
        "alg": "ECDH-ES+A256KW",
        "x": b64url(n.x.to_bytes(32, "big")),
        "y": b64url(n.y.to_bytes(32, "big")),
    }


def _decrypt_jwe(jwe: dict[str, str], key: Any) -> bytes:
    header = json.loads(_unb64(jwe["protected"]))
    assert header["enc"] == "A256GCM"
    if header["alg"] == "ECDH-ES+A256KW":
        epk = header["epk"]
        peer = ec.EllipticCurvePublicNumbers(
            int.from_bytes(_unb64(epk["x"]), "big"),
            int.from_bytes(_unb64(epk["y"]), "big"),
            ec.SECP256R1(),
        ).public_key()
        z = key.exchange(ec.ECDH(), peer)
        alg = b"ECDH-ES+A256KW"
        other = len(alg).to_bytes(4, "big") + alg + bytes(8) + (256).to_bytes(4, "big")
        kek = hashlib.sha256(b"\x00\x00\x00\x01" + z + other).digest()
        cek = aes_key_unwrap(kek, _unb64(jwe["encrypted_key"]))
    else:
        assert header["alg"] == "RSA-OAEP-256"
        cek = key.decrypt(
            _unb64(jwe["encrypted_key"]),
            padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None),
        )
    return AESGCM(cek).decrypt(
        _unb64(jwe["iv"]),
        _unb64(jwe["ciphertext"]) + _unb64(jwe["tag"]),
        jwe["protected"].encode(),
    )


def test_jwe_ecdh_es_a256kw_decrypts_per_rfc() -> None:
    tee = ec.generate_private_key(ec.SECP256R1())
    jwe = jwe_encrypt(parse_tee_pubkey(_jwk_ec(tee)), b"image key")
    assert _decrypt_jwe(jwe, tee) == b"image key"


def test_jwe_rsa_oaep_256_decrypts_and_rsa1_5_is_refused() -> None:
    tee = rsa.generate_private_key(65537, 2048)
    n = tee.public_key().public_numbers()
    jwk = {
        "kty": "RSA",
        "alg": "RSA-OAEP-256",
        "n": b64url(n.n.to_bytes(256, "big")),
        "e": b64url(n.e.to_bytes(3, "big")),
    }
    assert _decrypt_jwe(jwe_encrypt(parse_tee_pubkey(jwk), b"k"), tee) == b"k"
    with pytest.raises(SealingError) as e:
        parse_tee_pubkey({**jwk, "alg": "RSA1_5"})
    assert e.value.reason == "tee_pubkey_not_supported"


@pytest.mark.parametrize(
    "change",
    [{"crv": "P-384"}, {"alg": "ECDH-ES"}, {"x": b64url(bytes(32))}, {"kty": "oct"}, {"y": "!"}],
)
def test_bad_tee_pubkeys_are_refused(change: dict[str, str]) -> None:
    with pytest.raises(SealingError):
        parse_tee_pubkey({**_jwk_ec(KEY), **change})
