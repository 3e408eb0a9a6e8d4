"""The CA with its keys in a real SoftHSM2 token (``--ca-key-store pkcs11:...``).

Root and intermediate keys are generated in the token (sensitive, not extractable); the CA's
state directory holds only RFC 7512 references; leaves, CRLs and the rotated intermediate are
signed by the token (SoftHSM 2.6: SHA-256 here, CKM_ECDSA there, r||s to DER) and verify with
``cryptography``; rotation makes the new intermediate's key in the token; a restart (a new
module session) loads the same CA; the file store and the token store refuse each other's
state; a wrong PIN or a missing token is a clear error."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.ca import (
    INTERMEDIATE_LIFETIME,
    NEXT_SLOT,
    CertificateAuthority,
    Issuer,
    activation_time,
    preparation_time,
    rotation_step,
)
from certs.ca.templates import build_leaf
from certs.errors import AttestmeshError
from certs.keystore import Pkcs11KeyStore, Pkcs11PrivateKey, open_key_store, parse_pkcs11_uri
from tests.softhsm_harness import Token, init_token
from tests.unit.fixtures_core import csr_pem, new_key

TD = "attestmesh.local"
NOW = datetime.now(UTC).replace(microsecond=0)


@pytest.fixture
def token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Token]:
    t = init_token(tmp_path / "hsm")
    monkeypatch.setenv("SOFTHSM2_CONF", str(t.conf))
    yield t


def _store(token: Token) -> Pkcs11KeyStore:
    store = open_key_store(token.uri)
    assert isinstance(store, Pkcs11KeyStore)
    return store


def _private_objects(store: Pkcs11KeyStore) -> list[tuple[str, bool, bool]]:
    from pkcs11 import Attribute, ObjectClass

    return sorted(
        (o[Attribute.LABEL], o[Attribute.SENSITIVE], o[Attribute.EXTRACTABLE])
        for o in store._session.get_objects(
            {Attribute.CLASS: ObjectClass.PRIVATE_KEY, Attribute.TOKEN: True}
        )
    )


def _leaf(ca: CertificateAuthority, issuer: Issuer, now: datetime) -> x509.Certificate:
    csr = x509.load_pem_x509_csr(csr_pem(new_key()))
    return build_leaf(
        csr,
        issuer=issuer,
        spiffe_id=f"spiffe://{TD}/ns/default/sa/web",
        serial=x509.random_serial_number(),
        claims_extension=b"\x30\x00",
        now=now,
        ttl=timedelta(hours=1),
    )


def _crls(pem: bytes) -> list[x509.CertificateRevocationList]:
    marker = b"-----BEGIN X509 CRL-----"
    return [x509.load_pem_x509_crl(marker + part) for part in pem.split(marker)[1:]]


def _verifies(leaf: x509.Certificate, ca: CertificateAuthority) -> None:
    issuer = ca.issuer_of(leaf)
    leaf.verify_directly_issued_by(issuer.cert)
    issuer.cert.verify_directly_issued_by(ca.root)
    ca.root.verify_directly_issued_by(ca.root)


def test_keys_are_made_in_the_token_and_never_written(token: Token, tmp_path: Path) -> None:
    store = _store(token)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=store)
    for name in ("root.key", "intermediate.key"):
        text = (tmp_path / "ca" / name).read_text()
        assert text.startswith("pkcs11:id=%") and "PRIVATE KEY" not in text
        assert parse_pkcs11_uri(text.strip()).path["type"] == "private"
    objects = _private_objects(store)
    assert len(objects) == 2
    assert all(sensitive and not extractable for _, sensitive, extractable in objects)
    key = ca.intermediate.key
    assert isinstance(key, Pkcs11PrivateKey)
    with pytest.raises(AttestmeshError):
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    assert key.public_key() == ca.intermediate.cert.public_key()


@pytest.mark.parametrize("gil", ["hold", "release"])
def test_leaf_and_crl_signed_by_the_token_verify(token: Token, tmp_path: Path, gil: str) -> None:
    """Both signing paths: C_Sign through ctypes holding the GIL, and python-pkcs11's."""
    store = open_key_store(f"{token.uri}&x-sign-gil={gil}")
    assert isinstance(store, Pkcs11KeyStore) and (store._direct is not None) == (gil == "hold")
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=store)
    leaf = _leaf(ca, ca.intermediate, NOW)
    _verifies(leaf, ca)
    assert leaf.signature_hash_algorithm is not None
    assert leaf.signature_hash_algorithm.name == "sha256"
    crls = _crls(ca.crl_pem([(leaf.serial_number, NOW)], NOW, timedelta(hours=1)))
    assert crls[0].is_signature_valid(ca.intermediate.cert.public_key())
    assert crls[0].get_revoked_certificate_by_serial_number(leaf.serial_number) is not None
    # the signature is a real ECDSA signature over SHA-256 of the TBS bytes
    ca.intermediate.cert.public_key().verify(  # type: ignore[union-attr, call-arg]
        leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256())
    )


def test_rotation_makes_the_new_intermediate_key_in_the_token_and_survives_restarts(
    token: Token, tmp_path: Path
) -> None:
    store = _store(token)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=store)
    first = ca.intermediate
    t = preparation_time(first.cert) + timedelta(seconds=1)
    prepared = rotation_step(ca, t)
    assert prepared is not None and prepared.prepared is not None
    assert len(_private_objects(store)) == 3
    slot = (tmp_path / "ca" / NEXT_SLOT).read_text()
    assert "pkcs11:id=%" in slot and "PRIVATE KEY" not in slot
    # restart between prepare and activate: a new session finds the prepared key in the token
    restarted = CertificateAuthority.load_or_create(tmp_path / "ca", TD, t, key_store=_store(token))
    assert restarted.prepared is not None
    assert restarted.prepared.cert == prepared.prepared.cert
    t2 = activation_time(first.cert) + timedelta(seconds=1)
    active = rotation_step(restarted, t2)
    assert active is not None and active.previous is not None
    assert active.intermediate.cert == prepared.prepared.cert
    assert active.previous.cert == first.cert
    leaf = _leaf(active, active.intermediate, t2)
    _verifies(leaf, active)
    assert active.issuer_of(leaf).cert == active.intermediate.cert
    # restart again: same root, the new intermediate signs; the previous stays for its CRL
    again = CertificateAuthority.load_or_create(tmp_path / "ca", TD, t2, key_store=_store(token))
    assert (again.root, again.intermediate.cert) == (active.root, active.intermediate.cert)
    assert again.previous is not None and again.previous.cert == first.cert
    _verifies(_leaf(again, again.intermediate, t2), again)
    crls = _crls(again.crl_pem([], t2, timedelta(hours=1)))
    assert [
        c.is_signature_valid(i.cert.public_key()) for c, i in zip(crls, again.issuers, strict=True)
    ] == [
        True,
        True,
    ]
    assert active.intermediate.cert.not_valid_after_utc <= t2 + INTERMEDIATE_LIFETIME


def test_file_and_token_stores_refuse_each_others_state(token: Token, tmp_path: Path) -> None:
    CertificateAuthority.load_or_create(tmp_path / "files", TD, NOW)
    with pytest.raises(AttestmeshError) as e:
        CertificateAuthority.load_or_create(tmp_path / "files", TD, NOW, key_store=_store(token))
    assert e.value.reason == "ca_key_store_mismatch"
    CertificateAuthority.load_or_create(tmp_path / "hsm-ca", TD, NOW, key_store=_store(token))
    with pytest.raises(AttestmeshError) as e:
        CertificateAuthority.load_or_create(tmp_path / "hsm-ca", TD, NOW)
    assert e.value.reason == "ca_key_store_mismatch"


def test_a_key_deleted_from_the_token_is_a_clear_error(token: Token, tmp_path: Path) -> None:
    from pkcs11 import Attribute, ObjectClass

    store = _store(token)
    CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=store)
    for o in store._session.get_objects({Attribute.CLASS: ObjectClass.PRIVATE_KEY}):
        if "intermediate" in o[Attribute.LABEL]:
            o.destroy()
    with pytest.raises(AttestmeshError) as e:
        CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=_store(token))
    assert e.value.reason == "ca_key_missing"


def test_wrong_pin_and_missing_token(token: Token) -> None:
    token.pin_file.write_text("000000\n")
    with pytest.raises(AttestmeshError) as e:
        open_key_store(token.uri)
    assert e.value.reason == "keystore_pin"
    with pytest.raises(AttestmeshError) as e:
        open_key_store(token.uri.replace(f"token={token.label}", "token=nope"))
    assert e.value.reason == "keystore_unavailable"
    with pytest.raises(AttestmeshError) as e:
        open_key_store("pkcs11:token=x?module-path=/nonexistent.so&pin-value=1")
    assert e.value.reason == "keystore_unavailable"
    token.pin_file.write_text(token.pin)
    with pytest.raises(AttestmeshError) as e:
        open_key_store(f"{token.uri}&x-sign-gil=sometimes")
    assert e.value.reason == "keystore_uri_invalid"


@pytest.mark.parametrize("sign_key", ["session", "token"])
def test_signatures_come_from_a_session_copy_inside_the_token(
    token: Token, tmp_path: Path, sign_key: str
) -> None:
    """The signing object is the key's session copy (in the token: sensitive, not extractable,
    not a token object, gone with the store's session), or with x-sign-key=token the token
    object itself; both sign for the same public key."""
    from pkcs11 import Attribute, ObjectClass

    store = open_key_store(f"{token.uri}&x-sign-key={sign_key}")
    assert isinstance(store, Pkcs11KeyStore)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, NOW, key_store=store)
    key = ca.intermediate.key
    assert isinstance(key, Pkcs11PrivateKey)
    signer = key._signer
    if sign_key == "token":
        assert signer is key._handle
    else:
        assert signer is not key._handle
        assert not signer[Attribute.TOKEN] and key._handle[Attribute.TOKEN]
        assert signer[Attribute.SENSITIVE] and not signer[Attribute.EXTRACTABLE]
        assert signer[Attribute.ID] == key.key_id
    _verifies(_leaf(ca, ca.intermediate, NOW), ca)
    session_keys = {Attribute.CLASS: ObjectClass.PRIVATE_KEY, Attribute.TOKEN: False}
    assert len(list(store._session.get_objects(session_keys))) == (
        2 if sign_key == "session" else 0
    )  # root and intermediate
    store.close()
    again = _store(token)
    assert list(again._session.get_objects(session_keys)) == []  # the copies went with it
    assert len(_private_objects(again)) == 2
    with pytest.raises(AttestmeshError) as e:
        open_key_store(f"{token.uri}&x-sign-key=file")
    assert e.value.reason == "keystore_uri_invalid"
