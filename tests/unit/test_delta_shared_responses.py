"""Delta responses are numbered from one count for the process, so the streams sent the same
change share one response, nonce and all; each stream's nonces still increase (unique on
the stream), and every response is exactly what the plain encoder makes of its fields."""

from __future__ import annotations

import warnings

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb, server
from xds.build import Snapshot
from xds.resources import TypeUrl
from xds.server import UNCOUNTED, DeltaSession, ResourceVersions

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
    )

_CHANGES = [
    ([("a", "v1", pb.pack_bytes(b"\x0a\x01a", TypeUrl.ENDPOINT))], []),
    ([("a", "v2", pb.pack_bytes(b"\x0a\x01b", TypeUrl.ENDPOINT))], ["gone"]),
    ([], ["a"]),
]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, len(_CHANGES) - 1), st.sampled_from(["", "x", "y"])),
        max_size=40,
    )
)  # fmt: skip
def test_streams_share_responses_and_their_nonces_increase(
    asks: list[tuple[int, int, str]],
) -> None:
    last = [0, 0, 0, 0]  # each stream's last nonce number
    given_to: list[set[str]] = [set(), set(), set(), set()]
    for stream, k, version in asks:
        changed, removed = _CHANGES[k]
        number, message, nonce = server._numbered_response(
            last[stream], version, TypeUrl.ENDPOINT, changed, removed
        )
        assert number > last[stream] and nonce == str(number)
        assert nonce not in given_to[stream]
        last[stream] = number
        given_to[stream].add(nonce)
        plain = pb.encode_delta_discovery_response(
            version, TypeUrl.ENDPOINT, nonce, changed, removed
        )
        assert DeltaDiscoveryResponse.parse(message) == DeltaDiscoveryResponse.parse(plain)


def test_streams_sent_the_same_change_get_the_same_bytes() -> None:
    changed, removed = _CHANGES[1]
    n, first, _ = server._numbered_response(0, "x", TypeUrl.ENDPOINT, changed, removed)
    _, second, _ = server._numbered_response(0, "x", TypeUrl.ENDPOINT, changed, removed)
    assert second is first
    # a stream that already holds that nonce (or a later one) gets a fresh one
    later, third, _ = server._numbered_response(n, "x", TypeUrl.ENDPOINT, changed, removed)
    assert later > n and third != first
    # another version of the same change: its own nonce too
    other, _, _ = server._numbered_response(0, "y", TypeUrl.ENDPOINT, changed, removed)
    assert other > later


def _eds(names: dict[str, bytes]) -> Snapshot:
    return Snapshot.of({TypeUrl.ENDPOINT: names})


def test_sessions_ack_shared_nonces_each_for_itself() -> None:
    versions = ResourceVersions()
    sessions = [DeltaSession(f"n{i}", UNCOUNTED, lambda: 0.0, versions) for i in range(3)]
    for s in sessions:
        s.on_request(
            DeltaDiscoveryRequest(type_url=TypeUrl.ENDPOINT, resource_names_subscribe=["a"])
        )
        list(s.responses(_eds({"a": pb.pack_bytes(b"\x0a\x01a", TypeUrl.ENDPOINT)})))
    changed = _eds({"a": pb.pack_bytes(b"\x0a\x01z", TypeUrl.ENDPOINT)})
    sent = [next(iter(s.responses(changed))) for s in sessions]
    assert sent[1] is sent[0] and sent[2] is sent[0]  # one response for the three
    nonce = DeltaDiscoveryResponse.parse(sent[0]).nonce
    # one stream NACKs it: only that stream's record rolls back
    nack = DeltaDiscoveryRequest(type_url=TypeUrl.ENDPOINT, response_nonce=nonce)
    nack.error_detail = pb_status("bad")
    sessions[0].on_request(nack)
    sessions[1].on_request(DeltaDiscoveryRequest(type_url=TypeUrl.ENDPOINT, response_nonce=nonce))
    assert sessions[0].nacks and not sessions[1].nacks and not sessions[2].nacks
    assert sessions[0]._types[TypeUrl.ENDPOINT].have != sessions[1]._types[TypeUrl.ENDPOINT].have
    assert sessions[1]._types[TypeUrl.ENDPOINT].have == sessions[2]._types[TypeUrl.ENDPOINT].have
    assert nonce not in sessions[1]._types[TypeUrl.ENDPOINT].sent  # ACKed
    assert nonce in sessions[2]._types[TypeUrl.ENDPOINT].sent  # not answered yet


def pb_status(message: str):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PydanticDeprecatedSince212)
        from envoy_data_plane.google.rpc import Status
    return Status(code=3, message=message)
