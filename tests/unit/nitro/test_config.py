"""The Nitro runtime's pure core: routes, the control protocol, sizing, backoff, readiness."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.nitro.bridge import BridgeError
from sidecar.nitro.config import (
    MAX_MESSAGE,
    MAX_ROUTES,
    Backoff,
    ControlError,
    EnclaveConfig,
    ParentState,
    Route,
    Status,
    build_routes,
    check_config,
    control_plane_destinations,
    decode,
    encode,
    hugetlb_limit_mib,
    parse_config,
    parse_status,
    size_enclave,
)


def config(**overrides: object) -> dict[str, object]:
    routes = build_routes(control_plane_destinations(
        "https://cp.mesh.svc:8443", "cp.mesh.svc:18000", ["10.0.0.7:15006"]
    ))  # fmt: skip
    cfg = EnclaveConfig(
        workload="shop/web-0",
        control_plane_url="https://cp.mesh.svc:8443",
        xds="cp.mesh.svc:18000",
        trust_domain="mesh.example",
        routes=tuple(r.__class__(r.name, r.host, r.port, 50000 + i) for i, r in enumerate(routes)),
        inbound_address="10.0.0.5",
        inbound_port=15006,
        ca_bundle_pem="-----BEGIN CERTIFICATE-----\n",
        token="tok",
    )
    return {**cfg.to_message(), **overrides}


def test_destinations_are_the_api_the_xds_address_and_each_peer() -> None:
    dests = control_plane_destinations(
        "https://[fd00::1]/", "cp:18000", ["10.0.0.7:15006", "b.svc:15006"]
    )
    assert dests == [("api", "[fd00::1]:443"), ("xds", "cp:18000"),
                     ("peer-0", "10.0.0.7:15006"), ("peer-1", "b.svc:15006")]  # fmt: skip
    with pytest.raises(BridgeError, match="not https"):
        control_plane_destinations("http://cp:8443", "cp:18000", [])


def test_routes_listen_on_the_destination_address_or_loopback_for_names() -> None:
    routes = build_routes([("api", "cp.svc:8443"), ("peer-0", "10.0.0.7:15006")])
    assert [(r.listen_host, r.port, r.vsock_port) for r in routes] == [
        ("127.0.0.1", 8443, 0),
        ("10.0.0.7", 15006, 0),
    ]


def test_bad_routes_are_all_reported_at_once() -> None:
    with pytest.raises(BridgeError) as err:
        build_routes([("API", "a:1"), ("x", "b:99999"), ("y", "c:5"), ("y", "d:6"),
                      ("z", "c:5"), ("w", "host/path:80")])  # fmt: skip
    detail = err.value.detail
    for part in ("'API'", "b:99999", "route 'y' twice", "127.0.0.1:5 is already bridged",
                 "host/path:80"):  # fmt: skip
        assert part in detail, detail
    with pytest.raises(BridgeError, match=f"at most {MAX_ROUTES}"):
        build_routes([(f"r{i}", f"10.0.0.{i % 250}:{1000 + i}") for i in range(MAX_ROUTES + 1)])


def test_config_round_trips_and_keeps_the_parents_vsock_ports() -> None:
    cfg = parse_config(config())
    assert cfg.workload == "shop/web-0" and cfg.token == "tok"
    assert [r.vsock_port for r in cfg.routes] == [50000, 50001, 50002]
    assert parse_config(cfg.to_message()) == cfg
    check_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"routes": [["api", "cp", 8443, 0]]}, "vsock port 0"),
        ({"routes": [["api", "cp", 8443, True]]}, "vsock port True"),
        ({"routes": [["api", "cp", True, 5]]}, "integers"),
        ({"routes": [["api", "cp", 1, 5], ["xds", "cp", 2, 5]]}, "share a vsock port"),
        ({"routes": [["api", "cp", 8443]]}, "a route is"),
        ({"routes": [[f"r{i}", "h", i + 1, i + 1] for i in range(MAX_ROUTES + 1)]}, "at most"),
        ({"inbound_address": "pod.local"}, "IP address"),
        ({"inbound_port": 0}, "out of range"),
        ({"inbound_port": True}, "must be int"),
        ({"workload": ""}, "1..253"),
        ({"xds": "no-port"}, "xds"),
        ({"token": 5}, "token must be str"),
        ({"ca_bundle_pem": None}, "ca_bundle_pem must be str"),
    ],
)
def test_malformed_config_is_refused(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ControlError, match=message):
        parse_config(config(**overrides))


def test_messages_are_bounded_json_objects_of_known_types() -> None:
    assert decode(encode({"type": "hello", "version": 1})) == {"type": "hello", "version": 1}
    with pytest.raises(ControlError, match="too large"):
        decode(b"{" + b" " * MAX_MESSAGE + b"}")
    with pytest.raises(ControlError):
        encode({"type": "token", "token": "x" * MAX_MESSAGE})
    for bad in (b"", b"[]", b'{"type": "exec"}', b"\xff", b'"hello"'):
        with pytest.raises(ControlError):
            decode(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_decode_raises_only_control_errors(data: bytes) -> None:
    try:
        msg = decode(data)
    except ControlError:
        return
    assert msg["type"] in ("hello", "config", "token", "status")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(list(config())),
        st.from_type(type(None))
        | st.integers()
        | st.text(max_size=8)
        | st.booleans()
        | st.lists(st.integers(), max_size=4),
    )
)
def test_parse_config_raises_only_control_errors(overrides: dict[str, object]) -> None:
    with contextlib.suppress(ControlError):
        parse_config(config(**overrides))


def test_status() -> None:
    s = parse_status({"type": "status", "attested": True, "not_after": 100, "serial": "ab01"})
    assert s == Status(True, 100.0, "ab01")
    assert parse_status(json.loads(json.dumps(s.to_message()))) == s
    for bad in ({"attested": 1}, {"attested": True, "not_after": True},
                {"attested": True, "serial": "XYZ"}, {"attested": True, "serial": "a" * 41}):  # fmt: skip
        with pytest.raises(ControlError):
            parse_status(bad)


def test_sizing_defaults_to_the_grant_and_never_exceeds_it() -> None:
    assert size_enclave(granted_cpus=2, granted_memory_mib=4096).cpu_count == 2
    assert size_enclave(granted_cpus=2, granted_memory_mib=4096, memory_mib=1024).memory_mib == 1024
    with pytest.raises(ControlError) as err:
        size_enclave(granted_cpus=2, granted_memory_mib=4096, cpu_count=3, memory_mib=8192)
    assert err.value.reason == "enclave_oversized"
    assert "3 CPUs (granted 2)" in err.value.detail and "8192 MiB" in err.value.detail
    with pytest.raises(ControlError) as err:
        size_enclave(granted_cpus=0, granted_memory_mib=4096)
    assert err.value.reason == "enclave_not_granted"
    with pytest.raises(ControlError):
        size_enclave(granted_cpus=2, granted_memory_mib=4096, cpu_count=0)


@given(st.integers(1, 64), st.integers(64, 1 << 20), st.integers(-4, 80), st.integers(-4, 1 << 21))
def test_sizing_property(cpus: int, mib: int, want_cpus: int, want_mib: int) -> None:
    try:
        size = size_enclave(granted_cpus=cpus, granted_memory_mib=mib, cpu_count=want_cpus,
                            memory_mib=want_mib)  # fmt: skip
    except ControlError:
        assert not (1 <= want_cpus <= cpus and 64 <= want_mib <= mib)
        return
    assert 1 <= size.cpu_count <= cpus and 64 <= size.memory_mib <= mib


def test_backoff_doubles_to_a_cap_and_a_stable_run_resets_it() -> None:
    b = Backoff(initial_s=1, maximum_s=10, stable_s=60)
    assert [b.delay(n) for n in range(0, 6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert b.delay(10_000) == 10.0
    assert b.failures_after(5, uptime_s=3) == 6
    assert b.failures_after(5, uptime_s=60) == 1


def test_ready_only_while_running_with_an_unexpired_certificate() -> None:
    attested = Status(True, 1000.0, "ab")
    assert ParentState(running=True, status=attested).ready(999.0)
    assert not ParentState(running=True, status=attested).ready(1000.0)
    assert not ParentState(running=False, status=attested).ready(1.0)
    assert not ParentState(running=True, status=Status(False)).ready(1.0)
    assert not ParentState(running=True, status=Status(True, None, "ab")).ready(1.0)
    view = ParentState(True, "i-1-enc2", 16, 3, attested).view(10.0)
    assert view == {"ready": True, "running": True, "enclave_id": "i-1-enc2", "enclave_cid": 16,
                    "restarts": 3, "attested": True, "serial": "ab"}  # fmt: skip


def test_route_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Route("a", "h", 1).port = 2  # type: ignore[misc]


def test_hugetlb_limit() -> None:
    assert hugetlb_limit_mib("4294967296\n") == 4096
    assert hugetlb_limit_mib("max\n") is None
    with pytest.raises(ControlError):
        hugetlb_limit_mib("lots")
