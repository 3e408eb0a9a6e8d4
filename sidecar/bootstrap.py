"""The Envoy bootstrap for a sidecar: admin, the control plane (ADS) and the local SDS. Pure.

Everything else (listeners, clusters, routes, endpoints, the trust bundle) arrives over ADS;
the workload certificate arrives from the sidecar's own SDS socket.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xds.resources import SDS_CLUSTER, WORKLOAD_LEAF_CERT, XDS_CLUSTER


class XdsProtocol(enum.StrEnum):
    """How the sidecar's Envoy speaks ADS: incremental (delta, the default: a change sends only
    the changed resources) or state-of-the-world."""

    DELTA = "delta"
    SOTW = "sotw"

    @property
    def api_type(self) -> str:
        return "DELTA_GRPC" if self is XdsProtocol.DELTA else "GRPC"


@dataclass(frozen=True, slots=True)
class ControlPlaneAddress:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class XdsTls:
    """mTLS to the control plane: Envoy presents the workload certificate (from the local SDS,
    the leaf alone: the control plane's ADS port trusts the live intermediates, and keeps one
    certificate less per stream for the stream's life) and accepts only a server with
    ``server_spiffe_id`` under the mesh root in ``ca_bundle``. Whoever could feed an Envoy
    configuration could make it trust anything: never plaintext beyond loopback."""

    ca_bundle: Path
    server_spiffe_id: str


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _xds_transport_socket(tls: XdsTls) -> dict[str, Any]:
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "common_tls_context": {
                "alpn_protocols": ["h2"],
                "tls_certificate_sds_secret_configs": [
                    {
                        "name": WORKLOAD_LEAF_CERT,
                        "sds_config": {
                            "resource_api_version": "V3",
                            "api_config_source": {
                                "api_type": "GRPC",
                                "transport_api_version": "V3",
                                "grpc_services": [{"envoy_grpc": {"cluster_name": SDS_CLUSTER}}],
                            },
                        },
                    }
                ],
                "validation_context": {
                    "trusted_ca": {"filename": str(tls.ca_bundle)},
                    "match_typed_subject_alt_names": [
                        {"san_type": "URI", "matcher": {"exact": tls.server_spiffe_id}}
                    ],
                },
            },
        },
    }


def _http2_options() -> dict[str, Any]:
    # gRPC needs HTTP/2 upstream; without it the ADS stream fails with status 14, silently at
    # info log level.
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }


def _static_cluster(
    name: str, addresses: Sequence[dict[str, Any]], connect_timeout_s: float
) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_s}s",
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": a}} for a in addresses]}],
        },
    }


def control_plane_addresses(text: str) -> tuple[ControlPlaneAddress, ...]:
    """``host:port[,host:port...]`` (an IPv6 host in brackets) as addresses, duplicates
    dropped; ValueError for anything else."""
    out: list[ControlPlaneAddress] = []
    for piece in text.split(","):
        item = piece.strip()
        host, _, port = item.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"control-plane address must be host:port, got {item!r}")
        address = ControlPlaneAddress(host, int(port))
        if address not in out:
            out.append(address)
    return tuple(out)


def build_bootstrap(
    node: str,
    xds: ControlPlaneAddress | Sequence[ControlPlaneAddress],
    sds_socket: Path,
    admin_port: int,
    *,
    cluster: str = "attestmesh",
    initial_fetch_timeout_s: float = 15.0,
    connect_timeout_s: float = 1.0,
    xds_tls: XdsTls | None = None,
    xds_protocol: XdsProtocol = XdsProtocol.DELTA,
) -> dict[str, Any]:
    """Bootstrap of the Envoy whose node id is ``node`` (= its Registration name).

    ``xds``: one control-plane address or several (replicas; a DNS name may also resolve to
    several): each is an endpoint of the ADS cluster. When the stream's replica fails, Envoy
    reconnects through the cluster's load balancer, i.e. to another endpoint; TCP keepalives
    notice a replica that went silent. ADS speaks ``xds_protocol`` (delta by default); the
    local SDS stays state-of-the-world."""
    addresses = (xds,) if isinstance(xds, ControlPlaneAddress) else tuple(xds)
    if not addresses:
        raise ValueError("at least one control-plane address is required")
    ads = {
        "ads": {},
        "resource_api_version": "V3",
        "initial_fetch_timeout": f"{initial_fetch_timeout_s}s",
    }
    xds_cluster = _static_cluster(
        XDS_CLUSTER,
        [{"socket_address": {"address": a.host, "port_value": a.port}} for a in addresses],
        connect_timeout_s,
    )
    if not all(_is_ip(a.host) for a in addresses):  # the Service name: resolve, keep resolving
        xds_cluster["type"] = "STRICT_DNS"
        xds_cluster["dns_lookup_family"] = "V4_PREFERRED"
    xds_cluster["upstream_connection_options"] = {
        "tcp_keepalive": {"keepalive_time": 10, "keepalive_interval": 3, "keepalive_probes": 3}
    }
    if xds_tls is not None:
        xds_cluster["transport_socket"] = _xds_transport_socket(xds_tls)
    return {
        "node": {"id": node, "cluster": cluster},
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "clusters": [
                xds_cluster,
                _static_cluster(
                    SDS_CLUSTER, [{"pipe": {"path": str(sds_socket)}}], connect_timeout_s
                ),
            ]
        },
        "dynamic_resources": {
            "ads_config": {
                "api_type": XdsProtocol(xds_protocol).api_type,
                "transport_api_version": "V3",
                "grpc_services": [{"envoy_grpc": {"cluster_name": XDS_CLUSTER}}],
                "set_node_on_first_message_only": True,
            },
            "lds_config": ads,
            "cds_config": ads,
        },
    }


def render_bootstrap(bootstrap: dict[str, Any]) -> str:
    return json.dumps(bootstrap, indent=2, sort_keys=True)


__all__ = [
    "ControlPlaneAddress",
    "XdsProtocol",
    "XdsTls",
    "build_bootstrap",
    "control_plane_addresses",
    "render_bootstrap",
]
