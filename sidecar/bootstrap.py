"""The Envoy bootstrap for a sidecar: admin, the control plane (ADS) and the local SDS. Pure.

Everything else (listeners, clusters, routes, endpoints, the trust bundle) arrives over ADS;
the workload certificate arrives from the sidecar's own SDS socket.
"""

from __future__ import annotations

import enum
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xds.resources import SDS_CLUSTER, WORKLOAD_CERT, XDS_CLUSTER


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
    """mTLS to the control plane: Envoy presents the workload certificate (from the local SDS)
    and accepts only a server with ``server_spiffe_id`` under the mesh root in ``ca_bundle``.
    Whoever could feed an Envoy configuration could make it trust anything: never plaintext
    beyond loopback."""

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
                        "name": WORKLOAD_CERT,
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


def _static_cluster(name: str, address: dict[str, Any], connect_timeout_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_s}s",
        "typed_extension_protocol_options": _http2_options(),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": address}}]}],
        },
    }


def build_bootstrap(
    node: str,
    xds: ControlPlaneAddress,
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

    ADS speaks ``xds_protocol`` (delta by default); the local SDS stays state-of-the-world."""
    ads = {
        "ads": {},
        "resource_api_version": "V3",
        "initial_fetch_timeout": f"{initial_fetch_timeout_s}s",
    }
    xds_cluster = _static_cluster(
        XDS_CLUSTER, {"socket_address": {"address": xds.host, "port_value": xds.port}},
        connect_timeout_s,
    )  # fmt: skip
    if not _is_ip(xds.host):  # e.g. the in-cluster Service name: resolve it, keep resolving
        xds_cluster["type"] = "STRICT_DNS"
        xds_cluster["dns_lookup_family"] = "V4_PREFERRED"
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
                    SDS_CLUSTER, {"pipe": {"path": str(sds_socket)}}, connect_timeout_s
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


__all__ = ["ControlPlaneAddress", "XdsProtocol", "XdsTls", "build_bootstrap", "render_bootstrap"]
