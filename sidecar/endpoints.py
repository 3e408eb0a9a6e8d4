"""Control-plane endpoints for the agent: parsing, failover classification, jittered backoff. Pure.

The control plane runs as several active-active replicas. The agent is given one or more API
URLs (repeated ``--control-plane`` or a comma-separated list), and a URL's host may be a DNS name
resolving to several replicas. A *target* is one concrete address to dial; TLS still verifies
the configured host name (``Target.server_hostname``), never the address that was dialled.

Only an outage moves the agent to the next replica: connection refused, timeout, TLS failure,
a malformed transport, HTTP 502/503/504. A refusal (4xx: policy, identity, nonce, quota) is the
control plane's answer and is the same at every replica: it is not retried elsewhere.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from certs.errors import AttestmeshError

# HTTP statuses that mean "this replica cannot answer now" (503: cut off from its store, or
# draining; 502/504: a proxy in front of it could not reach it).
OUTAGE_STATUSES = frozenset({502, 503, 504})
# AgentError reasons that are transport failures, not answers.
OUTAGE_REASONS = frozenset({"control_plane_unreachable"})


@dataclass(frozen=True, slots=True)
class ControlPlaneEndpoint:
    """One configured control-plane API URL, https://host:port."""

    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"{self.scheme}://{_netloc(self.host, self.port)}"

    @property
    def is_ip(self) -> bool:
        return is_ip(self.host)


@dataclass(frozen=True, slots=True)
class Target:
    """A concrete address to dial for ``endpoint``."""

    endpoint: ControlPlaneEndpoint
    address: str

    @property
    def base_url(self) -> str:
        return f"{self.endpoint.scheme}://{_netloc(self.address, self.endpoint.port)}"

    @property
    def server_hostname(self) -> str:
        """The name TLS verifies: the configured host, whatever address was dialled."""
        return self.endpoint.host

    @property
    def host_header(self) -> str:
        return _netloc(self.endpoint.host, self.endpoint.port)

    def __str__(self) -> str:
        if self.address == self.endpoint.host:
            return self.endpoint.url
        return f"{self.endpoint.url} ({self.address})"


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_endpoint(text: str) -> ControlPlaneEndpoint:
    """``https://host:port`` (a trailing ``/`` allowed) as an endpoint; ``AttestmeshError``
    ("usage") for anything else: no path, query or credentials, and plaintext ``http`` only to
    a loopback address (tests against local fakes)."""
    raw = text.strip()
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise AttestmeshError("usage", f"control-plane URL {raw!r}: {exc}") from None
    if not parts.hostname or parts.username or parts.password:
        raise AttestmeshError("usage", f"control-plane URL {raw!r} needs a host (no user info)")
    if parts.scheme != "https" and not (parts.scheme == "http" and _loopback(parts.hostname)):
        raise AttestmeshError(
            "usage", f"control-plane URL {raw!r} must be https://host:port (http: loopback only)"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise AttestmeshError("usage", f"control-plane URL {raw!r} must not carry a path")
    return ControlPlaneEndpoint(parts.scheme, parts.hostname, port if port is not None else 443)


def parse_endpoints(values: str | Iterable[str]) -> tuple[ControlPlaneEndpoint, ...]:
    """Every URL in ``values`` (each may be a comma-separated list), duplicates dropped, order
    kept. At least one is required."""
    items = [values] if isinstance(values, str) else list(values)
    out: list[ControlPlaneEndpoint] = []
    for item in items:
        for piece in item.split(","):
            if not piece.strip():
                continue
            endpoint = parse_endpoint(piece)
            if endpoint not in out:
                out.append(endpoint)
    if not out:
        raise AttestmeshError("usage", "at least one control-plane URL is required")
    return tuple(out)


def targets_of(endpoint: ControlPlaneEndpoint, addresses: Sequence[str]) -> tuple[Target, ...]:
    """The targets of ``endpoint`` given its resolved ``addresses`` (duplicates dropped); an IP
    endpoint is its own single target."""
    if endpoint.is_ip:
        return (Target(endpoint, endpoint.host),)
    seen: list[str] = []
    for a in addresses:
        if a not in seen:
            seen.append(a)
    return tuple(Target(endpoint, a) for a in seen)


_T = TypeVar("_T")


def rotate(items: Sequence[_T], first: _T | None) -> list[_T]:
    """``items`` starting at ``first`` (the replica that answered last: stay with it while it
    works), or unchanged when ``first`` is absent."""
    if first is None or first not in items:
        return list(items)
    i = items.index(first)
    return [*items[i:], *items[:i]]


def is_outage(reason: str, status: int) -> bool:
    """Whether a failure (``AgentError`` reason and HTTP status, 0 for none) means this replica
    is unavailable, so the next one should be tried. A 4xx never is."""
    if 400 <= status < 500:
        return False
    return status in OUTAGE_STATUSES or (status == 0 and reason in OUTAGE_REASONS)


def backoff_s(
    attempt: int, rand: Callable[[], float], *, base_s: float = 0.2, cap_s: float = 5.0
) -> float:
    """Delay before failover attempt ``attempt`` (0-based): exponential, capped, with "equal
    jitter" (half fixed, half random) so agents that lost the same replica do not all arrive
    at the next one in the same instant. ``rand`` returns a float in [0, 1)."""
    if attempt < 0:
        raise ValueError("attempt must be >= 0")
    ceiling = min(cap_s, base_s * 2.0 ** min(attempt, 30))
    r = min(max(rand(), 0.0), 1.0)
    return ceiling / 2 + r * ceiling / 2


__all__ = [
    "OUTAGE_STATUSES",
    "ControlPlaneEndpoint",
    "Target",
    "backoff_s",
    "is_ip",
    "is_outage",
    "parse_endpoint",
    "parse_endpoints",
    "rotate",
    "targets_of",
]
