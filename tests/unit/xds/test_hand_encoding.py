"""Hand-encoded resources are byte for byte what betterproto2 serializes."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from xds import pb
from xds.build import build_inbound_listener, build_load_assignment, inbound_listener_bytes
from xds.resources import TypeUrl
from xds.state import Endpoint, Registration

hosts = st.one_of(st.ip_addresses().map(str), st.from_regex(r"[a-z0-9.-]{1,40}", fullmatch=True))
ports = st.integers(1, 65535)


@given(host=hosts, port=ports, td=st.from_regex(r"[a-z0-9.]{1,30}", fullmatch=True))
def test_inbound_listener(host: str, port: int, td: str) -> None:
    reg = Registration("n", "ns", "sa", "svc", Endpoint(host, port), 8080)
    expected = pb.pack(build_inbound_listener(reg, td), TypeUrl.LISTENER)
    assert inbound_listener_bytes(reg, td) == expected


@given(
    name=st.from_regex(r"out\|[a-z0-9-]{1,20}", fullmatch=True),
    eps=st.lists(st.tuples(hosts, ports), max_size=20),
)
def test_load_assignment(name: str, eps: list[tuple[str, int]]) -> None:
    expected = bytes(build_load_assignment(name, eps))
    got = pb.encode_load_assignment(name, (pb.encode_lb_endpoint(h, p) for h, p in eps))
    assert got == expected
