"""Hand framing of DeltaDiscoveryResponse (Resource around pre-packed Any) and of varints:
what betterproto2 parses back is exactly what went in."""

from __future__ import annotations

import warnings

from hypothesis import given
from hypothesis import strategies as st
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb
from xds.resources import TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.cluster.v3 import Cluster
    from envoy_data_plane.envoy.service.discovery.v3 import DeltaDiscoveryResponse

text = st.text(max_size=40)


def _reference_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


@given(st.integers(min_value=0, max_value=2**40))
def test_varint(n: int) -> None:
    assert pb._varint(n) == _reference_varint(n)


def test_varint_boundaries() -> None:
    for n in (0, 1, 0x7F, 0x80, 0x3FFF, 0x4000, 2**21 - 1, 2**21):
        assert pb._varint(n) == _reference_varint(n)


@given(
    st.lists(st.tuples(text, text, st.integers(0, 3000)), max_size=4, unique_by=lambda r: r[0]),
    st.lists(text, max_size=4, unique=True),
    text,
    text,
)
def test_delta_response_round_trips(
    resources: list[tuple[str, str, int]], removed: list[str], system_version: str, nonce: str
) -> None:
    packed = [
        (name, version, pb.pack(Cluster(name=name, alt_stat_name="x" * size), TypeUrl.CLUSTER))
        for name, version, size in resources
    ]
    raw = pb.encode_delta_discovery_response(
        system_version, TypeUrl.CLUSTER, nonce, packed, removed
    )
    resp = DeltaDiscoveryResponse.parse(raw)
    assert resp.system_version_info == system_version
    assert resp.type_url == TypeUrl.CLUSTER
    assert resp.nonce == nonce
    assert resp.removed_resources == removed
    assert [(r.name, r.version) for r in resp.resources] == [(n, v) for n, v, _ in packed]
    for r, (_, _, any_bytes) in zip(resp.resources, packed, strict=True):
        assert r.resource is not None
        assert bytes(r.resource) == any_bytes  # the packed Any is carried as it is
