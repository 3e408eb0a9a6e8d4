"""certs/keystore.py without a token: RFC 7512 URI parsing (strict; arbitrary text raises only
KeyStoreError), object references, the file store, and the store selection."""

from __future__ import annotations

import contextlib

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st

from certs.keystore import (
    FILE_KEYS,
    KeyStoreError,
    object_uri,
    open_key_store,
    parse_pkcs11_uri,
)


def test_rfc7512_examples_parse() -> None:
    u = parse_pkcs11_uri(
        "pkcs11:token=The%20Software%20PKCS%2311%20Softtoken;manufacturer=Snake%20Oil,%20Inc."
        "?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/token_pin"
    )
    assert u.path == {
        "token": "The Software PKCS#11 Softtoken",
        "manufacturer": "Snake Oil, Inc.",
    }
    assert u.module_path == "/usr/lib/softhsm/libsofthsm2.so"
    assert u.query["pin-source"] == "file:/etc/token_pin"
    assert parse_pkcs11_uri("pkcs11:").path == {}
    assert parse_pkcs11_uri("pkcs11:object=my-key;type=private").path["type"] == "private"


def test_object_reference_round_trips_binary_ids() -> None:
    key_id = bytes(range(256))[::17]
    ref = object_uri(key_id, "attestmesh root/é")
    u = parse_pkcs11_uri(ref)
    assert u.id_bytes == key_id
    assert u.path["object"] == "attestmesh root/é"
    assert u.path["type"] == "private"


@pytest.mark.parametrize(
    "text",
    [
        "pkcs12:token=x",
        "pkcs11:token",
        "pkcs11:colour=blue",
        "pkcs11:token=a;token=b",
        "pkcs11:token=a b",
        "pkcs11:token=%zz",
        "pkcs11:token=%ff",  # not UTF-8
        "pkcs11:token=x?module-path=/a&pin-value=1&pin-source=file:/p",
        "pkcs11:token=x?module-path=/a&module-path=/b",
        "pkcs11:token=x?pin-value=a&b",
        "pkcs11:" + "a" * 5000,
    ],
)
def test_bad_uris_are_refused(text: str) -> None:
    with pytest.raises(KeyStoreError) as e:
        parse_pkcs11_uri(text)
    assert e.value.reason == "keystore_uri_invalid"


def test_pin_is_never_shown_and_comes_from_a_file(tmp_path: object) -> None:
    from pathlib import Path

    pin = Path(str(tmp_path)) / "pin"
    pin.write_text("123456\n")
    u = parse_pkcs11_uri(f"pkcs11:token=t?module-path=/m.so&pin-source=file:{pin}")
    assert u.pin() == "123456"
    v = parse_pkcs11_uri("pkcs11:token=t?module-path=/m.so&pin-value=s3cret")
    assert v.pin() == "s3cret" and "s3cret" not in repr(v)
    with pytest.raises(KeyStoreError) as e:
        parse_pkcs11_uri(f"pkcs11:token=t?pin-source=file:{pin}.missing").pin()
    assert e.value.reason == "keystore_pin"
    with pytest.raises(KeyStoreError):
        parse_pkcs11_uri("pkcs11:token=t").module_path  # noqa: B018


@given(st.text(max_size=200))
def test_arbitrary_text_raises_only_keystore_error(text: str) -> None:
    for candidate in (text, "pkcs11:" + text):
        with contextlib.suppress(KeyStoreError):
            parse_pkcs11_uri(candidate)


def test_file_store_round_trip_and_refuses_references() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    loaded = FILE_KEYS.load(FILE_KEYS.dump(key), "k")
    assert loaded.private_numbers() == key.private_numbers()
    with pytest.raises(KeyStoreError) as e:
        FILE_KEYS.load(object_uri(b"\x01", "x").encode(), "root.key")
    assert e.value.reason == "ca_key_store_mismatch"
    with pytest.raises(KeyStoreError) as e:
        FILE_KEYS.load(b"not a key", "root.key")
    assert e.value.reason == "ca_key_invalid"
    assert open_key_store(None) is FILE_KEYS and open_key_store("file") is FILE_KEYS
    with pytest.raises(KeyStoreError):
        open_key_store("hsm:thing")


def test_token_uri_needs_a_token() -> None:
    with pytest.raises(KeyStoreError) as e:
        open_key_store("pkcs11:?module-path=/nonexistent.so&pin-value=1")
    assert e.value.reason == "keystore_uri_invalid"
