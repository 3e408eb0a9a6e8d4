"""xds.adswire decodes what betterproto2 encodes, field for field, and fails on malformed
bytes only with WireError; the pre-framed delta responses parse as the plain encoding."""

from __future__ import annotations

import contextlib
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb, server
from xds.adswire import WireError, decode_delta, decode_sotw
from xds.resources import TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Locality, Node
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
        DiscoveryRequest,
        ResourceLocator,
    )
    from envoy_data_plane.google.rpc import Status

text = st.text(max_size=20)
names = st.lists(text, max_size=5)
nodes = st.one_of(
    st.none(),
    st.builds(
        lambda i, z: Node(id=i, locality=Locality(zone=z), user_agent_name="envoy"), text, text
    ),
)
errors = st.one_of(
    st.none(), st.builds(Status, code=st.integers(-(2**31), 2**31 - 1), message=text)
)


@settings(max_examples=300, deadline=None)
@given(
    text,
    nodes,
    names,
    text,
    text,
    errors,
    st.lists(st.builds(ResourceLocator, name=text), max_size=2),
)
def test_sotw_requests_decode_as_betterproto_encodes_them(
    version: str,
    node: Node | None,
    resource_names: list[str],
    type_url: str,
    nonce: str,
    error: Status | None,
    locators: list[ResourceLocator],
) -> None:
    msg = DiscoveryRequest(
        version_info=version,
        node=node,
        resource_names=resource_names,
        type_url=type_url,
        response_nonce=nonce,
        error_detail=error,
        resource_locators=locators,  # a field the decoder skips
    )
    got = decode_sotw(bytes(msg))
    assert got.version_info == version
    assert (got.node.id if got.node else None) == (node.id if node else None)
    assert got.resource_names == resource_names
    assert got.type_url == type_url
    assert got.response_nonce == nonce
    if error is None:
        assert got.error_detail is None
    else:
        assert got.error_detail is not None
        assert (got.error_detail.code, got.error_detail.message) == (error.code, error.message)


@settings(max_examples=300, deadline=None)
@given(nodes, text, names, names, st.dictionaries(text, text, max_size=5), text, errors)
def test_delta_requests_decode_as_betterproto_encodes_them(
    node: Node | None,
    type_url: str,
    subscribe: list[str],
    unsubscribe: list[str],
    initial: dict[str, str],
    nonce: str,
    error: Status | None,
) -> None:
    msg = DeltaDiscoveryRequest(
        node=node,
        type_url=type_url,
        resource_names_subscribe=subscribe,
        resource_names_unsubscribe=unsubscribe,
        initial_resource_versions=initial,
        response_nonce=nonce,
        error_detail=error,
    )
    got = decode_delta(bytes(msg))
    assert (got.node.id if got.node else None) == (node.id if node else None)
    assert got.type_url == type_url
    assert got.resource_names_subscribe == subscribe
    assert got.resource_names_unsubscribe == unsubscribe
    assert got.initial_resource_versions == initial
    assert got.response_nonce == nonce
    assert (got.error_detail is None) == (error is None)
    if error is not None and got.error_detail is not None:
        assert got.error_detail.message == error.message


def test_an_empty_error_detail_is_still_a_nack() -> None:
    # present but empty (code 0, no message): betterproto2 parses it as set, so must we
    assert decode_sotw(bytes(DiscoveryRequest(error_detail=Status()))).error_detail is not None
    assert decode_sotw(bytes(DiscoveryRequest())).error_detail is None


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05ab",  # truncated length-delimited
        b"\x0a",  # truncated length
        b"\x08" + b"\xff" * 11,  # overlong varint
        b"\x0b",  # wire type 3 (groups)
        b"\x00\x01",  # field number 0
        b"\x22\x02\xff\xfe",  # type_url not UTF-8
        b"\x21\x01",  # field 4 with wire type 1: fixed64 truncated
        b"\x20\x01",  # field 4 as a varint: the wrong wire type
    ],
)
def test_malformed_requests_raise_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        decode_sotw(data)
    with pytest.raises(WireError):
        decode_delta(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_wire_error(data: bytes) -> None:
    for decode in (decode_sotw, decode_delta):
        with contextlib.suppress(WireError):  # anything else fails the test
            decode(data)


@settings(max_examples=200, deadline=None)
@given(
    text,
    st.sampled_from(list(TypeUrl)),
    st.lists(st.tuples(text, text, st.binary(max_size=300)), max_size=20),
    names,
)
def test_pre_framed_delta_responses_parse_as_the_plain_encoding(
    version: str,
    type_url: TypeUrl,
    changed: list[tuple[str, str, bytes]],
    removed: list[str],
) -> None:
    changed = [(n, v, pb.pack_bytes(b, type_url)) for n, v, b in changed]
    # the stream's last nonce number: one the process's count gave (as every stream's is)
    after, _, _ = server._numbered_response(0, version, type_url, changed, removed)
    number, framed, given = server._numbered_response(after, version, type_url, changed, removed)
    again = server._numbered_response(after, version, type_url, changed, removed)
    assert number > after and given == str(number)
    plain = pb.encode_delta_discovery_response(version, type_url, given, changed, removed)
    if len(changed) + len(removed) <= server._FRAMED_RESOURCES:
        # another stream at the same point is sent the very same bytes (framed once)
        assert again == (number, framed, given)
    else:  # a large (first) answer is encoded per stream, with a nonce of its own
        assert again[0] > number and again[2] == str(again[0])
    assert DeltaDiscoveryResponse.parse(framed) == DeltaDiscoveryResponse.parse(plain)
