"""The attestation result in standard form (certs.ear): an EAR JWT signed by the issuing CA, in
a CMW record, in the TCG DICE CMW extension of each leaf; and ``attestmesh inspect``."""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import cbor2
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from attestmesh import inspect_cmd
from certs.ca import CertificateAuthority, Issuer, encode_claims_extension, parse_csr
from certs.ca.templates import build_leaf
from certs.ear import (
    CMW_IND_ATTESTATION_RESULTS,
    CMW_OID,
    EAR_MEDIA_TYPE,
    EAR_PROFILE,
    EarError,
    TrustTier,
    b64url,
    build_ear,
    build_ear_extension,
    decode_cmw_extension,
    ear_token_of,
    encode_cmw_extension,
    parse_jws,
    sign_ear,
    tier_of,
    verify_certificate_ear,
    verify_ear,
)
from certs.evidence.claims import Claims, Tee
from tests.unit.fixtures_core import NOW, TRUST_DOMAIN, claims, csr_pem, new_key, spki

SPIFFE = f"spiffe://{TRUST_DOMAIN}/ns/default/sa/web"
NONCE = bytes(range(32))


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(
        tmp_path_factory.mktemp("ca") / "ca", TRUST_DOMAIN, NOW
    )


def _leaf(
    ca: CertificateAuthority,
    *,
    key: ec.EllipticCurvePrivateKey | None = None,
    c: Claims | None = None,
    cmw: bytes | None = None,
    spiffe_id: str = SPIFFE,
    issuer: Issuer | None = None,
) -> x509.Certificate:
    key = key or new_key()
    c = c or claims()
    issuer = issuer or ca.intermediate
    if cmw is None:
        cmw = build_ear_extension(
            c, policy="default/pol", spiffe_id=spiffe_id, subject_key=key.public_key(),
            nonce=NONCE, issuer=issuer, now=NOW,
        )  # fmt: skip
    return build_leaf(
        parse_csr(csr_pem(key)),
        spiffe_id=spiffe_id,
        claims_extension=encode_claims_extension(c, "default/pol", NOW),
        issuer=issuer,
        serial=77,
        now=NOW,
        ttl=timedelta(hours=1),
        cmw_extension=cmw,
    )


def _token(ca: CertificateAuthority, **changes: Any) -> str:
    key = new_key()
    doc = build_ear(
        claims(), policy="default/pol", spiffe_id=SPIFFE, subject_spki_der=spki(key),
        nonce=NONCE, now=NOW, verifier_build="test",
    )  # fmt: skip
    doc.update(changes)
    return sign_ear(doc, ca.intermediate.key, ca.intermediate.cert)


# -- encoding ----------------------------------------------------------------------------------


def test_a_leaf_carries_the_ear_in_the_dice_cmw_extension_and_it_round_trips(
    ca: CertificateAuthority,
) -> None:
    key = new_key()
    leaf = _leaf(ca, key=key)
    ext = leaf.extensions.get_extension_for_oid(CMW_OID)
    assert CMW_OID.dotted_string == "2.23.133.5.4.9"
    assert not ext.critical  # draft-ietf-rats-msg-wrap: SHOULD NOT be critical
    raw = ext.value.value  # type: ignore[attr-defined]
    # DER OCTET STRING (the CMW "cbor" choice) around a CBOR record [type, bytes, ind]
    assert raw[0] == 0x04
    cmw = decode_cmw_extension(raw)
    assert cmw.type == EAR_MEDIA_TYPE
    assert cmw.type == 'application/eat+jwt; eat_profile="tag:github.com,2023:veraison/ear"'
    assert cmw.ind == CMW_IND_ATTESTATION_RESULTS == 8
    record = cbor2.loads(raw[2:] if raw[1] < 0x80 else raw[2 + (raw[1] & 0x7F) :])
    assert record == [EAR_MEDIA_TYPE, cmw.value, 8]

    ear = verify_certificate_ear(leaf, ca.intermediate.cert, SPIFFE)
    assert ear.header["alg"] == "ES256" and ear.header["typ"] == "JWT"
    assert ear.header["x5t#S256"] == b64url(ca.intermediate.cert.fingerprint(hashes.SHA256()))
    c = ear.claims
    assert c["eat_profile"] == EAR_PROFILE
    assert c["iat"] == int(NOW.timestamp())
    assert c["sub"] == SPIFFE
    assert c["eat_nonce"] == b64url(NONCE)
    assert set(c["ear.verifier-id"]) == {"build", "developer"}
    sub = c["submods"]["sim"]
    assert sub["ear.appraisal-policy-id"] == "default/pol"
    assert sub["ear.veraison.key-attestation"]["akpub"] == b64url(spki(key))
    assert sub["attestmesh.dev/measurements"] == dict(claims().measurements)
    assert sub["ear.trustworthiness-vector"] == {"executables": 2}
    assert ear.status is TrustTier.WARNING  # the simulated TEE never affirms


@pytest.mark.parametrize(
    ("overrides", "tee", "status", "vector"),
    [
        ({}, Tee.SEV_SNP, "affirming", {"executables": 2, "hardware": 2}),
        ({"tcb_status": "UpToDate"}, Tee.TDX, "affirming", {"executables": 2, "hardware": 2}),
        ({"tcb_status": "OutOfDate"}, Tee.TDX, "warning", {"executables": 2, "hardware": 32}),
        ({"debug": True}, Tee.SEV_SNP, "warning",
         {"executables": 2, "hardware": 2, "configuration": 32}),
        ({}, Tee.SIM, "warning", {"executables": 2}),
    ],
)  # fmt: skip
def test_trust_tier_follows_the_worst_claim(
    overrides: dict[str, Any], tee: Tee, status: str, vector: dict[str, int]
) -> None:
    doc = build_ear(
        claims(tee, **overrides), policy="p", spiffe_id=SPIFFE, subject_spki_der=b"k",
        nonce=NONCE, now=NOW, verifier_build="t",
    )  # fmt: skip
    (appraisal,) = doc["submods"].values()
    assert appraisal["ear.status"] == status
    assert appraisal["ear.trustworthiness-vector"] == vector
    if "tcb_status" in overrides:
        assert appraisal["attestmesh.dev/tcb-status"] == overrides["tcb_status"]


def test_tiers_match_ar4si_ranges() -> None:
    assert [tier_of(v) for v in (0, 1, 2, 31, 32, 95, 96, 127, -2, -96)] == [
        TrustTier.NONE, TrustTier.NONE, TrustTier.AFFIRMING, TrustTier.AFFIRMING,
        TrustTier.WARNING, TrustTier.WARNING, TrustTier.CONTRAINDICATED,
        TrustTier.CONTRAINDICATED, TrustTier.AFFIRMING, TrustTier.CONTRAINDICATED,
    ]  # fmt: skip


def test_a_nonce_outside_eat_bounds_is_refused() -> None:
    with pytest.raises(ValueError, match="8 to 64"):
        build_ear(claims(), policy="p", spiffe_id=SPIFFE, subject_spki_der=b"k",
                  nonce=b"short", now=NOW, verifier_build="t")  # fmt: skip


# -- verification and tampering, each with its precise reason ----------------------------------


def _flip_payload(token: str) -> str:
    h, p, s = token.split(".")
    doc = json.loads(base64.urlsafe_b64decode(p + "=" * (-len(p) % 4)))
    doc["submods"]["sim"]["ear.status"] = "affirming"
    return f"{h}.{b64url(json.dumps(doc).encode())}.{s}"


def _reason(token: str, key: ec.EllipticCurvePublicKey) -> str:
    with pytest.raises(EarError) as info:
        verify_ear(token, key)
    return info.value.reason


def test_tampering_is_detected_with_a_precise_reason(ca: CertificateAuthority) -> None:
    pub = ca.intermediate.key.public_key()
    good = _token(ca)
    assert verify_ear(good, pub).claims["sub"] == SPIFFE
    # a claim changed after signing (a relying party tricked into "affirming")
    assert _reason(_flip_payload(good), pub) == "ear_signature_invalid"
    # a signature byte flipped
    h, p, s = good.split(".")
    sig = bytearray(base64.urlsafe_b64decode(s + "=" * (-len(s) % 4)))
    sig[5] ^= 1
    assert _reason(f"{h}.{p}.{b64url(bytes(sig))}", pub) == "ear_signature_invalid"
    # signed by another key (an attacker's own "CA")
    forged = sign_ear(json.loads(base64.urlsafe_b64decode(p + "==")), new_key(),
                      ca.intermediate.cert)  # fmt: skip
    assert _reason(forged, pub) == "ear_signature_invalid"
    # alg none / HS256 downgrade
    none = f"{b64url(json.dumps({'alg': 'none'}).encode())}.{p}.{s}"
    assert _reason(none, pub) == "ear_alg_unsupported"
    crit = f"{b64url(json.dumps({'alg': 'ES256', 'crit': ['x']}).encode())}.{p}.{s}"
    assert _reason(crit, pub) == "ear_alg_unsupported"
    # structure
    assert _reason("a.b", pub) == "ear_malformed"
    assert _reason(f"{h}.{p}.{s}=", pub) == "ear_malformed"
    assert _reason(f"{h}.{p}.{s[:-4]}", pub) == "ear_malformed"
    # correctly signed, but not an EAR
    assert _reason(_token(ca, eat_profile="tag:other"), pub) == "ear_profile_mismatch"
    assert _reason(_token(ca, iat=1.5), pub) == "ear_claims_invalid"
    assert _reason(_token(ca, submods={}), pub) == "ear_claims_invalid"
    assert _reason(_token(ca, submods={"x": {"ear.status": "great"}}), pub) == "ear_claims_invalid"
    assert _reason(_token(ca, **{"ear.verifier-id": "me"}), pub) == "ear_claims_invalid"


def test_an_ear_moved_to_another_certificate_does_not_verify_for_it(
    ca: CertificateAuthority,
) -> None:
    original = _leaf(ca)
    stolen = original.extensions.get_extension_for_oid(CMW_OID).value.value  # type: ignore[attr-defined]
    other = _leaf(ca, cmw=stolen)  # another key, same (validly signed) EAR
    with pytest.raises(EarError) as info:
        verify_certificate_ear(other, ca.intermediate.cert)
    assert info.value.reason == "ear_key_mismatch"
    with pytest.raises(EarError) as info:
        verify_certificate_ear(original, ca.intermediate.cert, "spiffe://x/ns/a/sa/b")
    assert info.value.reason == "ear_subject_mismatch"


def test_the_wrapper_is_read_strictly(ca: CertificateAuthority) -> None:
    token = _token(ca)
    good = encode_cmw_extension(token)
    assert decode_cmw_extension(good).value == token.encode()

    def reason(value: bytes) -> str:
        with pytest.raises(EarError) as info:
            decode_cmw_extension(value)
        return info.value.reason

    assert reason(b"") == "cmw_malformed"
    assert reason(good + b"\x00") == "cmw_malformed"  # DER length disagrees
    assert reason(b"\x0c\x02[]") == "cmw_type_unsupported"  # the JSON choice
    tagged = cbor2.dumps(cbor2.CBORTag(1668576818, b"x"))
    assert reason(b"\x04" + bytes([len(tagged)]) + tagged) == "cmw_type_unsupported"
    one = cbor2.dumps(["application/eat+jwt"])
    assert reason(b"\x04" + bytes([len(one)]) + one) == "cmw_malformed"
    text_value = cbor2.dumps(["application/eat+jwt", "not bytes"])
    assert reason(b"\x04" + bytes([len(text_value)]) + text_value) == "cmw_malformed"
    zero_ind = cbor2.dumps(["application/eat+jwt", b"x", 0])
    assert reason(b"\x04" + bytes([len(zero_ind)]) + zero_ind) == "cmw_malformed"
    trailing = cbor2.dumps(["application/eat+jwt", b"x"]) + b"\x00"
    assert reason(b"\x04" + bytes([len(trailing)]) + trailing) == "cmw_malformed"
    # a leaf without the extension
    plain = build_leaf(
        parse_csr(csr_pem(new_key())), spiffe_id=SPIFFE,
        claims_extension=encode_claims_extension(claims(), "p", NOW), issuer=ca.intermediate,
        serial=5, now=NOW, ttl=timedelta(hours=1),
    )  # fmt: skip
    with pytest.raises(EarError) as info:
        ear_token_of(plain)
    assert info.value.reason == "cmw_missing"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_extension_bytes_raise_only_ear_error(data: bytes) -> None:
    with contextlib.suppress(EarError):
        decode_cmw_extension(data)


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=300)
    | st.from_regex(
        r"[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_-]{0,40}\.[A-Za-z0-9_-]{0,90}", fullmatch=True
    )
)
def test_arbitrary_tokens_raise_only_ear_error(token: str) -> None:
    with contextlib.suppress(EarError):
        parse_jws(token)


# -- attestmesh inspect ------------------------------------------------------------------------


def _pem(*certs: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)


def _inspect(tmp_path: Path, cert: bytes, *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "leaf.pem"
    path.write_bytes(cert)
    args = argparse.ArgumentParser()
    sub = args.add_subparsers()
    inspect_cmd.add_parser(sub)
    ns = args.parse_args(["inspect", str(path), *extra])
    out, err = io.StringIO(), io.StringIO()
    code = inspect_cmd.run(ns, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_inspect_prints_and_verifies_the_ear(tmp_path: Path, ca: CertificateAuthority) -> None:
    leaf = _leaf(ca)
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(ca.bundle_pem)
    code, out, _ = _inspect(tmp_path, _pem(leaf, ca.intermediate.cert), "--trust", str(bundle))
    assert code == 0, out
    assert f"SPIFFE ID  {SPIFFE}" in out
    assert "signature  verified with" in out and "anchored in --trust" in out
    assert "ear.status" in out and "warning" in out
    assert "measurement" in out  # the claims extension
    code, out, _ = _inspect(tmp_path, _pem(leaf, ca.intermediate.cert), "--json")
    report = json.loads(out)
    assert code == 0
    assert report["spiffe_id"] == SPIFFE
    assert report["claims"]["tee"] == "sim"
    assert report["ear"]["verified"] is True and report["ear"]["anchored"] is None
    assert report["ear"]["claims"]["submods"]["sim"]["ear.status"] == "warning"


def test_inspect_refuses_what_does_not_verify(tmp_path: Path, ca: CertificateAuthority) -> None:
    leaf = _leaf(ca)
    # no issuer given: the EAR cannot be verified (exit 1), the claims still show, marked
    code, out, _ = _inspect(tmp_path, _pem(leaf), "--json")
    report = json.loads(out)
    assert code == 1 and report["ear"]["error"]["reason"] == "issuer_unknown"
    assert report["ear"]["unverified_claims"]["sub"] == SPIFFE
    # an EAR signed by a key that is not the issuer's, in a leaf the real CA signed
    other = CertificateAuthority.load_or_create(tmp_path / "other", TRUST_DOMAIN, NOW)
    forged_cmw = build_ear_extension(
        claims(Tee.SEV_SNP), policy="p", spiffe_id=SPIFFE, subject_key=new_key().public_key(),
        nonce=NONCE, issuer=other.intermediate, now=NOW,
    )  # fmt: skip
    forged = _leaf(ca, cmw=forged_cmw)
    code, out, _ = _inspect(tmp_path, _pem(forged, ca.intermediate.cert))
    assert code == 1 and "NOT VERIFIED: ear_signature_invalid" in out
    assert "claims below are unverified" in out
    # a chain that does not lead to the trust bundle given
    bundle = tmp_path / "other.pem"
    bundle.write_bytes(other.bundle_pem)
    code, out, _ = _inspect(tmp_path, _pem(leaf, ca.intermediate.cert), "--trust", str(bundle),
                            "--json")  # fmt: skip
    assert code == 1 and json.loads(out)["ear"]["error"]["reason"] == "issuer_not_anchored"
    # bad input: exit 2 with a clear message
    code, _, err = _inspect(tmp_path, b"not a certificate")
    assert code == 2 and "no readable X.509 certificate" in err
    code, _, err = _inspect(tmp_path, _pem(leaf), "--trust", str(tmp_path / "missing.pem"))
    assert code == 2 and "cannot read" in err


def test_an_independent_jwt_implementation_verifies_the_ear(ca: CertificateAuthority) -> None:
    """PyJWT (RFC 7515/7518 ES256, not this project's code) accepts the token with the issuing
    intermediate's key and reads the same claims; with another key it refuses it."""
    import jwt

    key = new_key()
    leaf = _leaf(ca, key=key)
    token = ear_token_of(leaf)
    issuer_key = ca.intermediate.cert.public_key()
    later = {"verify_iat": False}  # the fixtures' clock is in 2030
    decoded = jwt.decode(token, key=issuer_key, algorithms=["ES256"], options=later)  # type: ignore[arg-type]
    assert decoded == dict(verify_certificate_ear(leaf, ca.intermediate.cert, SPIFFE).claims)
    assert jwt.get_unverified_header(token)["typ"] == "JWT"
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(token, key=new_key().public_key(), algorithms=["ES256"], options=later)
