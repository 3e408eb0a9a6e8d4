"""xDS protocol facts in one place: type URLs, the ADS send order, fixed resource names."""

from __future__ import annotations

import enum

_PREFIX = "type.googleapis.com/"


class TypeUrl(enum.StrEnum):
    CLUSTER = _PREFIX + "envoy.config.cluster.v3.Cluster"
    ENDPOINT = _PREFIX + "envoy.config.endpoint.v3.ClusterLoadAssignment"
    LISTENER = _PREFIX + "envoy.config.listener.v3.Listener"
    ROUTE = _PREFIX + "envoy.config.route.v3.RouteConfiguration"
    SECRET = _PREFIX + "envoy.extensions.transport_sockets.tls.v3.Secret"

    @property
    def short(self) -> str:
        """Bounded metric label: cds, eds, lds, rds, sds."""
        return _SHORT[self]


_SHORT = {
    TypeUrl.CLUSTER: "cds",
    TypeUrl.ENDPOINT: "eds",
    TypeUrl.LISTENER: "lds",
    TypeUrl.ROUTE: "rds",
    TypeUrl.SECRET: "sds",
}

# Make-before-break over one ADS stream: clusters before their endpoints, listeners before
# their routes; secrets first so that listeners and clusters referring to them can warm.
ADS_ORDER: tuple[TypeUrl, ...] = (
    TypeUrl.SECRET,
    TypeUrl.CLUSTER,
    TypeUrl.ENDPOINT,
    TypeUrl.LISTENER,
    TypeUrl.ROUTE,
)

# Types Envoy subscribes to as wildcards (all resources for the node); the others by name.
WILDCARD_TYPES = frozenset({TypeUrl.CLUSTER, TypeUrl.LISTENER})

# The type whose resources are referenced by name from each wildcard type.
REFERENCED_BY = {TypeUrl.CLUSTER: TypeUrl.ENDPOINT, TypeUrl.LISTENER: TypeUrl.ROUTE}

SDS_SERVICE = "envoy.service.secret.v3.SecretDiscoveryService"
ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"

WORKLOAD_CERT = "workload-cert"  # served by the sidecar's local SDS: the key stays in the pod
# the same key with the leaf alone (no intermediate): what Envoy presents to the control plane,
# whose ADS port trusts the live intermediates (the mesh's peers trust the root only)
WORKLOAD_LEAF_CERT = "workload-leaf-cert"
MESH_TRUST = "mesh-trust"  # served by the control plane over ADS: bundle + CRL
INBOUND_LISTENER = "inbound"
INBOUND_ROUTE = "inbound"
INBOUND_APP_CLUSTER = "inbound|app"
XDS_CLUSTER = "xds"
SDS_CLUSTER = "sds-local"


def control_plane_spiffe_id(trust_domain: str) -> str:
    """The SPIFFE ID of the control plane's xDS (and API) server: what bootstraps pin."""
    return f"spiffe://{trust_domain}/ns/attestmesh-system/sa/controlplane"


def outbound_name(service: str) -> str:
    """Name of the outbound listener, cluster and load assignment for ``service``."""
    return f"out|{service}"
