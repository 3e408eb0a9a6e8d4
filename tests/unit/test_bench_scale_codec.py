"""bench_scale's lean ADS client reads only a few xDS fields by hand; these tests hold its codec
to the real protobuf classes (envoy_data_plane): the names a client must subscribe to, the
endpoints it holds, and the requests it sends."""

from __future__ import annotations

import warnings

from benchmarks import scale_ads as ads

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterEdsClusterConfig,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        AggregatedConfigSource,
        ApiConfigSource,
        ConfigSource,
        HealthStatus,
        SocketAddress,
        TransportSocket,
    )
    from envoy_data_plane.envoy.config.endpoint.v3 import (
        ClusterLoadAssignment,
        Endpoint,
        LbEndpoint,
        LocalityLbEndpoints,
    )
    from envoy_data_plane.envoy.config.listener.v3 import Filter, FilterChain, Listener
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        Rds,
    )
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CommonTlsContext,
        DownstreamTlsContext,
        SdsSecretConfig,
        UpstreamTlsContext,
    )
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DiscoveryRequest,
    )
    from envoy_data_plane.google.protobuf import Any

ADS = ConfigSource(ads=AggregatedConfigSource())
LOCAL = ConfigSource(api_config_source=ApiConfigSource())
PREFIX = "type.googleapis.com/"


def _any(msg: object, name: str) -> Any:
    return Any(type_url=PREFIX + name, value=bytes(msg))  # type: ignore[call-overload]


def _tls(kind: type, trust: str) -> TransportSocket:
    common = CommonTlsContext(
        tls_certificate_sds_secret_configs=[SdsSecretConfig(name="local-cert", sds_config=LOCAL)],
        validation_context_sds_secret_config=SdsSecretConfig(name=trust, sds_config=ADS),
    )
    name = "envoy.extensions.transport_sockets.tls.v3." + kind.__name__
    return TransportSocket(name="tls", typed_config=_any(kind(common_tls_context=common), name))


def test_cluster_refs_eds_name_and_only_ads_secrets() -> None:
    eds = Cluster(
        name="outbound|target",
        type=ClusterDiscoveryType.EDS,
        eds_cluster_config=ClusterEdsClusterConfig(eds_config=ADS),
        transport_socket=_tls(UpstreamTlsContext, "mesh-trust"),
    )
    assert ads.cluster_refs(bytes(eds)) == ("outbound|target", "outbound|target", {"mesh-trust"})
    named = Cluster(
        name="c",
        type=ClusterDiscoveryType.EDS,
        eds_cluster_config=ClusterEdsClusterConfig(eds_config=ADS, service_name="svc"),
    )
    assert ads.cluster_refs(bytes(named)) == ("c", "svc", set())
    static = Cluster(name="inbound|app", type=ClusterDiscoveryType.STATIC)
    assert ads.cluster_refs(bytes(static)) == ("inbound|app", None, set())


def test_listener_refs_rds_and_downstream_secrets() -> None:
    hcm = HttpConnectionManager(rds=Rds(config_source=ADS, route_config_name="inbound"))
    hcm_name = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    listener = Listener(
        name="inbound",
        filter_chains=[
            FilterChain(
                filters=[Filter(name="hcm", typed_config=_any(hcm, hcm_name))],
                transport_socket=_tls(DownstreamTlsContext, "trust-2"),
            )
        ],
    )
    assert ads.listener_refs(bytes(listener)) == ({"inbound"}, {"trust-2"})
    assert ads.listener_refs(bytes(Listener(name="empty"))) == (set(), set())


def test_healthy_endpoints_skip_unhealthy_and_draining() -> None:
    def lb(port: int, health: HealthStatus = HealthStatus.UNKNOWN) -> LbEndpoint:
        addr = Address(socket_address=SocketAddress(address="127.0.0.1", port_value=port))
        return LbEndpoint(endpoint=Endpoint(address=addr), health_status=health)

    cla = ClusterLoadAssignment(
        cluster_name="x",
        endpoints=[
            LocalityLbEndpoints(
                lb_endpoints=[
                    lb(1),
                    lb(2, HealthStatus.HEALTHY),
                    lb(3, HealthStatus.UNHEALTHY),
                    lb(4, HealthStatus.DRAINING),
                ]
            )
        ],
    )
    assert ads.healthy_endpoints(bytes(cla)) == {("127.0.0.1", 1), ("127.0.0.1", 2)}
    assert ads.healthy_endpoints(bytes(ClusterLoadAssignment(cluster_name="x"))) == set()


def test_requests_decode_as_envoy_messages() -> None:
    sotw = DiscoveryRequest.parse(ads.sotw_request("w1", ads.EDS, "v3", ["a", "b"], "n7"))
    assert sotw.node is not None
    assert (sotw.node.id, sotw.type_url, sotw.version_info) == ("w1", ads.EDS, "v3")
    assert (list(sotw.resource_names), sotw.response_nonce) == (["a", "b"], "n7")
    ack = DiscoveryRequest.parse(ads.sotw_request(None, ads.CDS, "v1", [], "n1"))
    assert ack.node is None or ack.node.id == ""
    delta = DeltaDiscoveryRequest.parse(ads.delta_request("w2", ads.RDS, ["r"], ["old"], "n2"))
    assert delta.node is not None
    assert (delta.node.id, delta.type_url, delta.response_nonce) == ("w2", ads.RDS, "n2")
    assert (list(delta.resource_names_subscribe), list(delta.resource_names_unsubscribe)) == (
        ["r"],
        ["old"],
    )
