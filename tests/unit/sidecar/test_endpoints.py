"""Several control-plane addresses for the agent: parsing, targets, failover classification,
jittered backoff (sidecar/endpoints.py, pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from certs.errors import AttestmeshError
from sidecar.endpoints import (
    ControlPlaneEndpoint,
    Target,
    backoff_s,
    is_outage,
    parse_endpoint,
    parse_endpoints,
    rotate,
    targets_of,
)


def test_urls_lists_and_duplicates() -> None:
    got = parse_endpoints(["https://cp-0.mesh:8443, https://cp-1.mesh:8443/", "https://[::1]:9"])
    assert [e.url for e in got] == [
        "https://cp-0.mesh:8443",
        "https://cp-1.mesh:8443",
        "https://[::1]:9",
    ]
    assert parse_endpoints("https://a:1,https://a:1/") == (ControlPlaneEndpoint("https", "a", 1),)
    assert parse_endpoint("https://cp.mesh").port == 443
    assert parse_endpoint("http://127.0.0.1:8080").scheme == "http"  # loopback fakes only


@pytest.mark.parametrize(
    "bad",
    [
        "",
        " , ",
        "cp.mesh:8443",  # no scheme
        "http://cp.mesh:8080",  # plaintext beyond loopback
        "https://user:pw@cp.mesh:8443",
        "https://cp.mesh:8443/v1",
        "https://cp.mesh:8443/?x=1",
        "https://cp.mesh:99999",
        "ftp://cp.mesh",
    ],
)
def test_bad_urls_are_usage_errors(bad: str) -> None:
    with pytest.raises(AttestmeshError) as refused:
        parse_endpoints(bad)
    assert refused.value.reason == "usage"


def test_a_name_has_a_target_per_address_and_tls_keeps_the_name() -> None:
    e = parse_endpoint("https://cp.mesh:8443")
    ts = targets_of(e, ["10.0.0.2", "10.0.0.3", "10.0.0.2"])
    assert [t.address for t in ts] == ["10.0.0.2", "10.0.0.3"]
    assert ts[0].base_url == "https://10.0.0.2:8443"
    assert ts[0].server_hostname == "cp.mesh" and ts[0].host_header == "cp.mesh:8443"
    assert str(ts[1]) == "https://cp.mesh:8443 (10.0.0.3)"
    ip = parse_endpoint("https://10.0.0.9:8443")
    assert targets_of(ip, ["ignored"]) == (Target(ip, "10.0.0.9"),)
    assert targets_of(e, []) == ()


def test_rotate_starts_at_the_replica_that_answered_last() -> None:
    assert rotate(["a", "b", "c"], "b") == ["b", "c", "a"]
    assert rotate(["a", "b", "c"], None) == ["a", "b", "c"]
    assert rotate(["a", "b", "c"], "gone") == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("reason", "status", "outage"),
    [
        ("control_plane_unreachable", 0, True),  # refused, timeout, TLS
        ("store_unavailable", 503, True),  # cut off from its database
        ("bad_gateway", 502, True),
        ("timeout", 504, True),
        ("quarantined", 403, False),  # an answer: the same at every replica
        ("identity_invalid", 401, False),
        ("too_many_attestations", 429, False),
        ("internal", 500, False),
        ("weird", 0, False),
    ],
)
def test_only_an_outage_moves_to_the_next_replica(reason: str, status: int, outage: bool) -> None:
    assert is_outage(reason, status) is outage


@given(st.integers(0, 64), st.floats(0, 1, exclude_max=True))
def test_backoff_is_capped_exponential_with_equal_jitter(attempt: int, r: float) -> None:
    d = backoff_s(attempt, lambda: r)
    ceiling = min(5.0, 0.2 * 2.0 ** min(attempt, 30))
    assert ceiling / 2 <= d <= ceiling
    assert backoff_s(attempt, lambda: 0.0) == ceiling / 2


def test_backoff_refuses_a_negative_attempt() -> None:
    with pytest.raises(ValueError):
        backoff_s(-1, lambda: 0.5)
