"""The Nitro runtime's pure core: routes, the parent <-> enclave control protocol, enclave
sizing, restart backoff and readiness. No I/O; time is an argument.

Ports (vsock). The enclave listens on ``CONTROL_PORT`` and ``INBOUND_PORT`` of its own CID
(each enclave has its CID, so these fixed ports never collide); the parent connects to the
control port once ``nitro-cli run-enclave`` returned the CID. The parent's own vsock ports (one
per outbound route) are in the host's single vsock port space, shared by every pod on the
node: the parent binds them to ports the kernel picks and tells the enclave which in the
configuration (``Route.vsock_port``).

Control protocol: one JSON object per line, at most ``MAX_MESSAGE`` bytes; one session per
enclave (a second connection is refused).

- enclave -> parent ``{"type": "hello", "version": 1}`` on accept, then every second
  ``{"type": "status", "attested": bool, "not_after": epoch seconds | null, "serial": hex |
  null}``;
- parent -> enclave ``{"type": "config", ...EnclaveConfig}`` once, then ``{"type": "token",
  "token": str}`` whenever the pod's projected token changes.

The parent is outside the enclave and untrusted by the mesh: everything it sends is only
operational (where to connect, the pod's token, which the control plane checks); the mesh root
may be pinned in the image (``enclave-init --ca-bundle``), and then the parent's copy is ignored.
Readiness (what the parent reports) is operational too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

from certs.errors import AttestmeshError
from sidecar.nitro.bridge import MAX_VSOCK_PORT, BridgeError, is_ip, parse_host_port

CONTROL_PORT = 9000
INBOUND_PORT = 9001
MAX_ROUTES = 64
MAX_MESSAGE = 64 * 1024
PROTOCOL_VERSION = 1
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_SERIAL = re.compile(r"[0-9a-f]{1,40}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ControlError(AttestmeshError):
    """A malformed control message or configuration."""


@dataclass(frozen=True, slots=True)
class Route:
    """An outbound destination: inside the enclave ``listen_host:port`` (the destination's own
    port; ``listen_host`` is the destination's address when it is an IP, else 127.0.0.1 with a
    hosts entry), over the parent's vsock ``vsock_port`` (0 until the parent bound it) to the
    parent, which dials exactly ``host:port``."""

    name: str
    host: str
    port: int
    vsock_port: int = 0

    @property
    def listen_host(self) -> str:
        return self.host if is_ip(self.host) else "127.0.0.1"


def build_routes(destinations: Sequence[tuple[str, str]]) -> tuple[Route, ...]:
    """Routes for ``(name, "host:port")`` pairs (vsock ports not bound yet); every problem
    reported at once (BridgeError ``bad_routes``)."""
    problems: list[str] = []
    routes: list[Route] = []
    seen_names: set[str] = set()
    seen_listen: set[tuple[str, int]] = set()
    if len(destinations) > MAX_ROUTES:
        problems.append(f"{len(destinations)} routes (at most {MAX_ROUTES})")
    for name, target in destinations[:MAX_ROUTES]:
        if not _NAME.match(name):
            problems.append(f"route name {name!r} (lowercase letters, digits, '-', <= 32)")
        elif name in seen_names:
            problems.append(f"route {name!r} twice")
        seen_names.add(name)
        try:
            host, port = parse_host_port(target)
        except BridgeError as exc:
            problems.append(f"route {name}: {exc.detail}")
            continue
        route = Route(name, host, port)
        key = (route.listen_host, port)
        if key in seen_listen:
            problems.append(f"route {name}: {key[0]}:{port} is already bridged")
        seen_listen.add(key)
        routes.append(route)
    if problems:
        raise BridgeError("bad_routes", "; ".join(problems))
    return tuple(routes)


def control_plane_destinations(
    control_plane_url: str, xds: str, peers: Sequence[str]
) -> list[tuple[str, str]]:
    """The fixed destinations of a mesh workload: the attestation API, ADS, each peer."""
    parts = urlsplit(control_plane_url)
    if parts.scheme != "https" or not parts.hostname:
        raise BridgeError("bad_routes", f"control plane URL {control_plane_url!r} is not https")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    out = [("api", f"{host}:{parts.port or 443}"), ("xds", xds)]
    out += [(f"peer-{i}", p) for i, p in enumerate(peers)]
    return out


@dataclass(frozen=True, slots=True)
class EnclaveConfig:
    """What the parent tells the enclave at boot."""

    workload: str
    control_plane_url: str
    xds: str
    trust_domain: str
    routes: tuple[Route, ...]
    inbound_address: str
    inbound_port: int
    ca_bundle_pem: str
    token: str | None = None
    envoy_admin_port: int = 15000

    def to_message(self) -> dict[str, Any]:
        return {
            "type": "config",
            "workload": self.workload,
            "control_plane_url": self.control_plane_url,
            "xds": self.xds,
            "trust_domain": self.trust_domain,
            "routes": [[r.name, r.host, r.port, r.vsock_port] for r in self.routes],
            "inbound_address": self.inbound_address,
            "inbound_port": self.inbound_port,
            "ca_bundle_pem": self.ca_bundle_pem,
            "token": self.token,
            "envoy_admin_port": self.envoy_admin_port,
        }


def _field(msg: Mapping[str, Any], key: str, kind: type, *, optional: bool = False) -> Any:
    value = msg.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ControlError("control_invalid", f"{key} must be {kind.__name__}")
    return value


def _port(value: int, what: str) -> int:
    if not 1 <= value <= 65535:
        raise ControlError("control_invalid", f"{what} {value} out of range")
    return value


def parse_config(msg: Mapping[str, Any]) -> EnclaveConfig:
    """The config message, validated; ControlError when malformed."""
    raw_routes = _field(msg, "routes", list)
    if len(raw_routes) > MAX_ROUTES:
        raise ControlError("control_invalid", f"{len(raw_routes)} routes (at most {MAX_ROUTES})")
    routes = []
    for item in raw_routes:
        if not (isinstance(item, list) and len(item) == 4):
            raise ControlError("control_invalid", "a route is [name, host, port, vsock_port]")
        name, host, port, vport = item
        if not isinstance(name, str) or not isinstance(host, str):
            raise ControlError("control_invalid", "route name and host are text")
        if not _is_int(port):
            raise ControlError("control_invalid", "route ports are integers")
        if not _is_int(vport) or not 1 <= vport <= MAX_VSOCK_PORT:
            raise ControlError("control_invalid", f"route {name!r}: vsock port {vport!r}")
        routes.append((name, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", vport))
    try:
        built = build_routes([(n, t) for n, t, _ in routes])
    except BridgeError as exc:
        raise ControlError("control_invalid", exc.detail) from None
    vports = [v for _, _, v in routes]
    if len(set(vports)) != len(vports):
        raise ControlError("control_invalid", "two routes share a vsock port")
    inbound_address = _field(msg, "inbound_address", str)
    if not is_ip(inbound_address):
        raise ControlError("control_invalid", "inbound_address must be an IP address")
    for key in ("workload", "trust_domain"):
        if not _field(msg, key, str) or len(msg[key]) > 253:
            raise ControlError("control_invalid", f"{key} must be 1..253 characters")
    xds = _field(msg, "xds", str)
    try:
        parse_host_port(xds)
    except BridgeError as exc:
        raise ControlError("control_invalid", f"xds: {exc.detail}") from None
    return EnclaveConfig(
        workload=msg["workload"],
        control_plane_url=_field(msg, "control_plane_url", str),
        xds=xds,
        trust_domain=msg["trust_domain"],
        routes=tuple(replace(r, vsock_port=v) for r, v in zip(built, vports, strict=True)),
        inbound_address=inbound_address,
        inbound_port=_port(_field(msg, "inbound_port", int), "inbound_port"),
        ca_bundle_pem=_field(msg, "ca_bundle_pem", str),
        token=_field(msg, "token", str, optional=True),
        envoy_admin_port=_port(_field(msg, "envoy_admin_port", int), "envoy_admin_port"),
    )


def check_config(config: EnclaveConfig) -> None:
    """ControlError unless the enclave would accept ``config`` (vsock ports not bound yet)."""
    msg = config.to_message()
    msg["routes"] = [[r.name, r.host, r.port, i + 1] for i, r in enumerate(config.routes)]
    parse_config(msg)


def encode(msg: Mapping[str, Any]) -> bytes:
    data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_MESSAGE:
        raise ControlError("control_invalid", f"message of {len(data)} bytes")
    return data


def decode(line: bytes) -> dict[str, Any]:
    """One control message; ControlError when it is not a JSON object with a known type."""
    if len(line) > MAX_MESSAGE:
        raise ControlError("control_invalid", "message too large")
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ControlError("control_invalid", "not JSON") from None
    if not isinstance(msg, dict) or msg.get("type") not in (
        "hello", "config", "token", "status"
    ):  # fmt: skip
        raise ControlError("control_invalid", "not a control message")
    return msg


@dataclass(frozen=True, slots=True)
class Status:
    """What the enclave reports about its agent."""

    attested: bool
    not_after: float | None = None
    serial: str | None = None

    def to_message(self) -> dict[str, Any]:
        return {
            "type": "status",
            "attested": self.attested,
            "not_after": self.not_after,
            "serial": self.serial,
        }


def parse_status(msg: Mapping[str, Any]) -> Status:
    attested = msg.get("attested")
    not_after = msg.get("not_after")
    serial = msg.get("serial")
    if not isinstance(attested, bool):
        raise ControlError("control_invalid", "attested must be a boolean")
    if not_after is not None and (
        isinstance(not_after, bool) or not isinstance(not_after, int | float)
    ):
        raise ControlError("control_invalid", "not_after must be a number")
    if serial is not None and not (isinstance(serial, str) and _SERIAL.fullmatch(serial)):
        raise ControlError("control_invalid", "serial must be hex")
    return Status(attested, float(not_after) if not_after is not None else None, serial)


# ---------------------------------------------------------------------------------------------
# sizing, backoff, readiness


@dataclass(frozen=True, slots=True)
class EnclaveSize:
    cpu_count: int
    memory_mib: int


def size_enclave(
    *,
    granted_cpus: int,
    granted_memory_mib: int,
    cpu_count: int | None = None,
    memory_mib: int | None = None,
) -> EnclaveSize:
    """The enclave's size: what was asked for, by default everything the pod was granted; never
    more than it was granted (ControlError ``enclave_oversized``)."""
    if granted_cpus < 1 or granted_memory_mib < 64:
        raise ControlError(
            "enclave_not_granted",
            f"the pod was granted {granted_cpus} enclave CPUs and {granted_memory_mib} MiB of "
            "hugepages: request aws.ec2.nitro/nitro_enclaves_cpus and hugepages-1Gi",
        )
    cpus = granted_cpus if cpu_count is None else cpu_count
    mib = granted_memory_mib if memory_mib is None else memory_mib
    problems = []
    if not 1 <= cpus <= granted_cpus:
        problems.append(f"{cpus} CPUs (granted {granted_cpus})")
    if not 64 <= mib <= granted_memory_mib:
        problems.append(f"{mib} MiB (granted {granted_memory_mib} MiB of hugepages)")
    if problems:
        raise ControlError("enclave_oversized", "refusing an enclave of " + ", ".join(problems))
    return EnclaveSize(cpus, mib)


def hugetlb_limit_mib(text: str) -> int | None:
    """The pod's 1 GiB hugepages limit from cgroup v2 ``hugetlb.1GB.max`` (bytes, or ``max``
    when unlimited: None); ControlError when it is not one of those."""
    value = text.strip()
    if value == "max":
        return None
    if not value.isdigit():
        raise ControlError("enclave_not_granted", f"hugetlb.1GB.max is {value[:40]!r}")
    return int(value) // (1024 * 1024)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Restart delays: ``initial * 2**(failures-1)`` capped at ``maximum``; a run that lasted
    ``stable_s`` resets the count."""

    initial_s: float = 1.0
    maximum_s: float = 60.0
    stable_s: float = 120.0

    def failures_after(self, failures: int, uptime_s: float) -> int:
        return 1 if uptime_s >= self.stable_s else failures + 1

    def delay(self, failures: int) -> float:
        if failures <= 0:
            return 0.0
        return float(min(self.maximum_s, self.initial_s * 2 ** min(failures - 1, 32)))


@dataclass(frozen=True, slots=True)
class ParentState:
    """What readiness is decided from."""

    running: bool = False
    enclave_id: str | None = None
    enclave_cid: int | None = None
    restarts: int = 0
    status: Status | None = None

    def ready(self, now: float) -> bool:
        s = self.status
        return (
            self.running
            and s is not None
            and s.attested
            and s.not_after is not None
            and now < s.not_after
        )

    def view(self, now: float) -> dict[str, Any]:
        return {
            "ready": self.ready(now),
            "running": self.running,
            "enclave_id": self.enclave_id,
            "enclave_cid": self.enclave_cid,
            "restarts": self.restarts,
            "attested": bool(self.status and self.status.attested),
            "serial": self.status.serial if self.status else None,
        }
