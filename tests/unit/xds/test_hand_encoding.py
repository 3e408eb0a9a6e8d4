"""Hand-encoded resources are byte for byte what betterproto2 serializes."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from xds import pb
from xds.build import (
    BuildSettings,
    app_cluster_bytes,
    build_app_cluster,
    build_inbound_listener,
    build_load_assignment,
    inbound_listener_bytes,
)
from xds.resources import TypeUrl
from xds.state import Endpoint, Registration

hosts = st.one_of(st.ip_addresses().map(str), st.from_regex(r"[a-z0-9.-]{1,40}", fullmatch=True))
ports = st.integers(1, 65535)


@settings(deadline=None)  # the first example builds betterproto schemas (cold: ~0.4 s)
@given(host=hosts, port=ports, td=st.from_regex(r"[a-z0-9.]{1,30}", fullmatch=True))
def test_inbound_listener(host: str, port: int, td: str) -> None:
    reg = Registration("n", "ns", "sa", "svc", Endpoint(host, port), 8080)
    expected = pb.pack(build_inbound_listener(reg, td), TypeUrl.LISTENER)
    assert inbound_listener_bytes(reg, td) == expected


@settings(deadline=None)  # the first example builds betterproto schemas (cold: ~0.4 s)
@given(
    name=st.from_regex(r"out\|[a-z0-9-]{1,20}", fullmatch=True),
    eps=st.lists(st.tuples(hosts, ports), max_size=20),
)
def test_load_assignment(name: str, eps: list[tuple[str, int]]) -> None:
    expected = bytes(build_load_assignment(name, eps))
    got = pb.encode_load_assignment(name, (pb.encode_lb_endpoint(h, p) for h, p in eps))
    assert got == expected


@settings(deadline=None)  # the first example builds betterproto schemas (cold: ~0.4 s)
@given(
    host=hosts,
    port=ports,
    timeout_ms=st.integers(1, 120_000),
)
def test_app_cluster(host: str, port: int, timeout_ms: int) -> None:
    bs = BuildSettings(connect_timeout=timedelta(milliseconds=timeout_ms), app_address=host)
    expected = pb.pack(build_app_cluster(port, bs), TypeUrl.CLUSTER)
    assert app_cluster_bytes(port, bs) == expected
