"""decode_delta's ACK fast path (type_url, then response_nonce, nothing else) decodes what
the general field-by-field decoder decodes, and refuses what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xds.adswire import DeltaRequest, WireError, _decode_delta, decode_delta


def _ld(num: int, payload: bytes) -> bytes:
    n, size = len(payload), bytearray()
    while n >= 0x80:
        size.append(n & 0x7F | 0x80)
        n >>= 7
    size.append(n)
    return bytes((num << 3 | 2,)) + bytes(size) + payload


def _fields(req: DeltaRequest) -> tuple[Any, ...]:
    return (
        req.node.id if req.node is not None else None,
        req.type_url,
        req.resource_names_subscribe,
        req.resource_names_unsubscribe,
        req.initial_resource_versions,
        req.response_nonce,
        None if req.error_detail is None else (req.error_detail.code, req.error_detail.message),
    )


def _outcome(decode: Any, data: bytes) -> Any:
    try:
        return _fields(decode(data))
    except WireError:
        return "WireError"


@settings(max_examples=500, deadline=None)
@given(
    st.binary(max_size=140),
    st.binary(max_size=140),
    st.binary(max_size=4),
    st.booleans(),
)
def test_the_fast_path_equals_the_general_decoder(
    type_url: bytes, nonce: bytes, tail: bytes, truncate: bool
) -> None:
    data = _ld(2, type_url) + _ld(6, nonce) + tail
    if truncate:
        data = data[:-1]
    assert _outcome(decode_delta, data) == _outcome(_decode_delta, data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=80))
def test_any_bytes_decode_alike(data: bytes) -> None:
    assert _outcome(decode_delta, data) == _outcome(_decode_delta, data)


def test_an_ack_is_read_and_bad_utf8_refused() -> None:
    tu = b"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
    req = decode_delta(_ld(2, tu) + _ld(6, b"123"))
    assert (req.type_url, req.response_nonce, req.node) == (tu.decode(), "123", None)
    with pytest.raises(WireError):
        decode_delta(_ld(2, tu) + _ld(6, b"\xff"))
