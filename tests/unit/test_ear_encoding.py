"""The hand-written encodings of the EAR path equal the library encodings they replace: the
Record CMW (cbor2) and the JWS header (one per signing certificate)."""

from __future__ import annotations

import base64
import json
from datetime import timedelta

import cbor2
from cryptography.hazmat.primitives import hashes
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.ca.templates import Issuer, ca_certificate
from certs.ear import (
    CMW_IND_ATTESTATION_RESULTS,
    EAR_MEDIA_TYPE,
    _der_length,
    decode_cmw_extension,
    encode_cmw_extension,
    sign_ear,
)
from tests.unit.fixtures_core import NOW, new_key

ASCII = st.characters(min_codepoint=0, max_codepoint=0x7F)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(ASCII, max_size=40), st.text(ASCII, min_size=200, max_size=70_000)))
def test_the_cmw_record_is_cbor2s_encoding(token: str) -> None:
    record = cbor2.dumps([EAR_MEDIA_TYPE, token.encode("ascii"), CMW_IND_ATTESTATION_RESULTS])
    assert encode_cmw_extension(token) == b"\x04" + _der_length(len(record)) + record
    if len(token) <= 16 * 1024:  # (what the decoder accepts)
        cmw = decode_cmw_extension(encode_cmw_extension(token))
        assert (cmw.type, cmw.value, cmw.ind) == (EAR_MEDIA_TYPE, token.encode(), 8)


def test_the_jws_header_names_each_signer_by_its_own_fingerprint() -> None:
    issuers = []
    for name in ("a", "b"):
        key = new_key()
        issuers.append(Issuer(ca_certificate(name, key, None, NOW, timedelta(days=1), 1,
                                             "spiffe://td.test", 0), key))  # fmt: skip
    for _ in range(2):  # (the second time from the cache)
        for issuer in issuers:
            token = sign_ear({"x": 1}, issuer.key, issuer.cert)
            header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
            thumb = base64.urlsafe_b64encode(issuer.cert.fingerprint(hashes.SHA256()))
            assert header == {"alg": "ES256", "typ": "JWT", "x5t#S256": thumb.rstrip(b"=").decode()}
