"""decode_delta keeps the ACKs it decoded lately by their bytes (thousands of streams sent one
change ACK the same nonce with the same bytes): the same bytes give the same fields, other
bytes are decoded for themselves, and the memo stays bounded."""

from __future__ import annotations

from xds import adswire
from xds.adswire import _decode_delta, decode_delta
from xds.resources import TypeUrl


def _ack(nonce: str, type_url: TypeUrl = TypeUrl.ENDPOINT) -> bytes:
    t, n = type_url.value.encode(), nonce.encode()
    return b"\x12" + bytes([len(t)]) + t + b"\x32" + bytes([len(n)]) + n


def _fields(req: adswire.DeltaRequest) -> tuple[object, ...]:
    return (
        req.type_url,
        req.response_nonce,
        req.resource_names_subscribe,
        req.resource_names_unsubscribe,
        req.initial_resource_versions,
        req.node,
        req.error_detail,
    )


def test_the_same_ack_bytes_decode_once_and_equal_the_general_decoder() -> None:
    first = decode_delta(bytes(bytearray(_ack("41"))))
    again = decode_delta(bytes(bytearray(_ack("41"))))  # equal bytes, another object
    assert again is first
    assert _fields(first) == _fields(_decode_delta(_ack("41")))
    other = decode_delta(_ack("42"))
    assert other is not first and other.response_nonce == "42"
    cds = decode_delta(_ack("41", TypeUrl.CLUSTER))
    assert cds.type_url == TypeUrl.CLUSTER.value and cds.response_nonce == "41"


def test_requests_that_are_not_bare_acks_are_not_kept() -> None:
    nack = _ack("43") + b"\x3a\x02\x08\x03"  # error_detail {code: 3}
    req = decode_delta(nack)
    assert req.error_detail is not None
    assert nack not in adswire._acks
    assert decode_delta(nack) is not req
    # a subclass of bytes (its own hash and equality) is decoded as ever, and not kept
    ack = _Bytes(_ack("44"))
    assert decode_delta(ack).response_nonce == "44"
    assert decode_delta(ack) is not decode_delta(ack)
    assert not any(type(key) is _Bytes for key in adswire._acks)


class _Bytes(bytes):
    pass


def test_the_memo_is_bounded() -> None:
    for i in range(3 * adswire._ACKS_KEPT):
        assert decode_delta(_ack(str(i))).response_nonce == str(i)
        assert len(adswire._acks) <= adswire._ACKS_KEPT
