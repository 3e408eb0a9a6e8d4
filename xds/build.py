"""Mesh state -> one Envoy's configuration snapshot (CDS, EDS, LDS, RDS, SDS). Pure.

Per node (``Registration.name``):

- CDS: ``inbound|app`` (static, the local app) and, per called service S, ``out|S`` (EDS) with
  mTLS: the workload certificate from the sidecar's local SDS, peers validated against the
  ``mesh-trust`` secret (bundle + CRL, from ADS) and pinned to the SPIFFE IDs of S's attested
  workloads.
- EDS ``out|S``: inbound endpoints of attested, ready workloads of S (none for a node not
  attested). A workload that is not ready keeps its identity pinned in CDS: only its endpoint
  leaves, so readiness flapping never changes clusters.
- LDS: ``inbound`` (mTLS, client certificate required, any identity of the trust domain; HCM with
  RDS ``inbound`` and the RBAC filter) and ``out|S`` on 127.0.0.1 (plaintext from the app).
- RDS ``inbound``: one route to the app whose per-route RBAC allows exactly the principals
  ``compile_permissions`` returns; nobody for a node not attested. Per-route RBAC in RDS applies
  to connections already open, without draining listeners.
- SDS ``mesh-trust``: trust bundle + CRL (``only_verify_leaf_cert_crl``).

Every resource is serialized once into ``Any`` bytes; a :class:`Packer` shares identical
resources between nodes and successive snapshots (e.g. the trust secret, a service's EDS).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import TypeVar

import betterproto2
from pydantic.warnings import PydanticDeprecatedSince212

from certs.ca import CLAIMS_CLASS_ORG
from xds import pb
from xds.index import Identity, MeshIndex, principal_of
from xds.meshpolicy import HttpMatch, MeshPolicy, Permission, compile_permissions_for
from xds.resources import (
    INBOUND_APP_CLUSTER,
    INBOUND_LISTENER,
    INBOUND_ROUTE,
    MESH_TRUST,
    REFERENCED_BY,
    SDS_CLUSTER,
    WORKLOAD_CERT,
    TypeUrl,
    outbound_name,
)
from xds.state import Endpoint as WorkloadEndpoint
from xds.state import (
    MeshState,
    Registration,
    ServiceKey,
    Status,
    UnknownWorkloadError,
    resolve_service,
)

with warnings.catch_warnings():
    # generated code uses a pydantic 2.12-deprecated validator form; harmless, noisy
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.cluster.v3 import (
        Cluster,
        ClusterDiscoveryType,
        ClusterEdsClusterConfig,
    )
    from envoy_data_plane.envoy.config.core.v3 import (
        Address,
        AggregatedConfigSource,
        ApiConfigSource,
        ApiConfigSourceApiType,
        ApiVersion,
        ConfigSource,
        DataSource,
        GrpcService,
        GrpcServiceEnvoyGrpc,
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
    from envoy_data_plane.envoy.config.rbac.v3 import (
        Permission as RbacPermission,
    )
    from envoy_data_plane.envoy.config.rbac.v3 import (
        PermissionSet,
        Policy,
        Principal,
        PrincipalAuthenticated,
        PrincipalSet,
        RbacAction,
    )
    from envoy_data_plane.envoy.config.rbac.v3 import Rbac as RbacRules
    from envoy_data_plane.envoy.config.route.v3 import (
        HeaderMatcher,
        Route,
        RouteAction,
        RouteConfiguration,
        RouteMatch,
        VirtualHost,
    )
    from envoy_data_plane.envoy.extensions.filters.http.rbac.v3 import Rbac as RbacFilter
    from envoy_data_plane.envoy.extensions.filters.http.rbac.v3 import RbacPerRoute
    from envoy_data_plane.envoy.extensions.filters.http.router.v3 import Router
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
        HttpConnectionManagerForwardClientCertDetails,
        HttpConnectionManagerSetCurrentClientCertDetails,
        HttpFilter,
        Rds,
    )
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import (
        CertificateValidationContext,
        CommonTlsContext,
        CommonTlsContextCombinedCertificateValidationContext,
        DownstreamTlsContext,
        SdsSecretConfig,
        Secret,
        SubjectAltNameMatcher,
        SubjectAltNameMatcherSanType,
        UpstreamTlsContext,
    )
    from envoy_data_plane.envoy.type.matcher.v3 import PathMatcher, StringMatcher
    from envoy_data_plane.google.protobuf import Any as AnyMsg

HCM = "envoy.filters.network.http_connection_manager"
RBAC_FILTER = "envoy.filters.http.rbac"
ROUTER_FILTER = "envoy.filters.http.router"
TLS_SOCKET = "envoy.transport_sockets.tls"
XFCC = "x-forwarded-client-cert"


@dataclass(frozen=True, slots=True)
class TrustMaterial:
    """What every Envoy validates peers against: the CA bundle and the CRL (both PEM)."""

    bundle_pem: bytes
    crl_pem: bytes = b""


@dataclass(frozen=True, slots=True)
class BuildSettings:
    connect_timeout: timedelta = timedelta(seconds=1)
    outbound_bind: str = "127.0.0.1"
    app_address: str = "127.0.0.1"


_NO_RESOURCES: Mapping[str, bytes] = MappingProxyType({})
_V = TypeVar("_V")

# Types whose mappings are made of resources shared between nodes (a service's endpoints, a
# destination's routes, the trust secret): equal mappings are interned, so the nodes that
# hold one share it and its version, and a patch of it is computed once for all of them.
_SHARED_TYPES = frozenset({TypeUrl.ENDPOINT, TypeUrl.ROUTE, TypeUrl.SECRET})
# Both memos are cleared when full (cost, not meaning): at most this many entries, and about
# this many bytes of resources they hold (a trust secret with a long CRL is large, and every
# CRL change makes another; the snapshots share the live ones)
_MEMO_ENTRIES = 4_096
_MEMO_BYTES = 16 << 20
_interned: dict[tuple[TypeUrl, tuple[tuple[str, bytes], ...]], tuple[Mapping[str, bytes], str]]
_interned = {}
# (id of the mapping patched, the replacement's items) -> (that mapping, the patched one or
# None if nothing differs, its version); the mapping is kept to tell a reused id apart
_patches: dict[
    tuple[int, tuple[tuple[str, bytes], ...]],
    tuple[Mapping[str, bytes], Mapping[str, bytes] | None, str],
] = {}
_memo_bytes = 0


def _remember(resources: Mapping[str, bytes]) -> None:
    """Room for one more memo entry holding ``resources`` (both memos cleared if there is
    none)."""
    global _memo_bytes
    size = sum(len(b) for b in resources.values())
    if (
        len(_interned) >= _MEMO_ENTRIES
        or len(_patches) >= _MEMO_ENTRIES
        or _memo_bytes + size > _MEMO_BYTES
    ):
        _interned.clear()
        _patches.clear()
        _memo_bytes = 0
    _memo_bytes += size


def _frozen(t: TypeUrl, resources: Mapping[str, bytes]) -> tuple[Mapping[str, bytes], str]:
    """A read-only copy of ``resources`` and its version, for a shared type the one shared
    by every equal mapping (the same names in the same order, equal bytes)."""
    if t not in _SHARED_TYPES:
        frozen = MappingProxyType(dict(resources))
        return frozen, content_version(frozen)
    key = (t, tuple(resources.items()))
    hit = _interned.get(key)
    if hit is None:
        frozen = MappingProxyType(dict(resources))
        _remember(frozen)
        hit = _interned[key] = (frozen, content_version(frozen))
    return hit


def _merge(
    t: TypeUrl, current: Mapping[str, bytes], replacement: Mapping[str, bytes]
) -> tuple[Mapping[str, bytes] | None, str]:
    """``current`` with the resources it holds replaced by ``replacement``'s (None: nothing
    differs; equal bytes are no difference, an interned mapping may hold an equal copy)."""
    update: dict[str, bytes] | None = None
    for n, b in replacement.items():
        held = current.get(n)
        if held is None or held is b or held == b:
            continue
        if update is None:
            update = {}
        update[n] = b
    if update is None:
        return None, ""
    return _frozen(t, {**current, **update})


class Layer:
    """One resource mapping that many nodes' snapshots read instead of holding: the endpoints
    of every caller of the same services from the same namespace (a group), the trust secret
    (every node). What it is built from changes -> it takes the new mapping (interned: equal
    contents, one object) and version as a whole, once, and every snapshot that reads it sees
    them: a change of a shared resource costs a wake per stream, not a patched snapshot per
    node (the publisher wakes whom the change concerns, as it did when it patched them).

    A snapshot stays consistent: a layer carries whole resource sets of one type whose names
    never change (a group's outbound services are part of its key; the trust secret's one
    name), so the names the node's other resources reference are always there."""

    __slots__ = ("mapping", "version")

    def __init__(self, mapping: Mapping[str, bytes], version: str) -> None:
        self.mapping = mapping
        self.version = version

    def set(self, mapping: Mapping[str, bytes], version: str) -> None:
        """Take ``mapping`` (an interned one: ``_frozen``) and its version."""
        self.mapping, self.version = mapping, version


_V2 = TypeVar("_V2")


class _Layered(Mapping[TypeUrl, _V2]):
    """A snapshot's per-type mapping (its resources, or its versions) with some types read
    through layers: the node's own values, and the layers' current ones."""

    __slots__ = ("_layers", "_versions", "own")

    def __init__(
        self, own: Mapping[TypeUrl, _V2], layers: Mapping[TypeUrl, Layer], versions: bool
    ) -> None:
        self.own = own
        self._layers = layers
        self._versions = versions

    def _layer_value(self, layer: Layer) -> _V2:
        return layer.version if self._versions else layer.mapping  # type: ignore[return-value]

    def __getitem__(self, t: TypeUrl) -> _V2:
        layer = self._layers.get(t)
        return self.own[t] if layer is None else self._layer_value(layer)

    def get(self, t: TypeUrl, default: object = None) -> object:  # type: ignore[override]
        layer = self._layers.get(t)
        return self.own.get(t, default) if layer is None else self._layer_value(layer)

    def __contains__(self, t: object) -> bool:
        return t in self._layers or t in self.own

    def __iter__(self) -> Iterator[TypeUrl]:
        return (t for t in TypeUrl if t in self._layers or t in self.own)

    def __len__(self) -> int:
        return sum(1 for _ in self)


_NO_LAYERS: Mapping[TypeUrl, Layer] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable, versioned set of one node's resources, per type: name -> packed Any bytes.

    ``references`` lists, per referenced type (EDS, RDS), the names the other resources use;
    ``consistent()`` holds when every one of them is present. Versions are content hashes.
    ``layers``: types the snapshot reads through a :class:`Layer` shared with other nodes
    (their resources and versions are the layer's current ones); the rest is the node's own.
    """

    resources: Mapping[TypeUrl, Mapping[str, bytes]]
    references: Mapping[TypeUrl, frozenset[str]] = field(default_factory=dict)
    versions: Mapping[TypeUrl, str] = field(default_factory=dict)
    layers: Mapping[TypeUrl, Layer] = field(default_factory=dict, compare=False)

    @classmethod
    def of(
        cls,
        resources: Mapping[TypeUrl, Mapping[str, bytes]],
        references: Mapping[TypeUrl, frozenset[str]] | None = None,
        layers: Mapping[TypeUrl, Layer] | None = None,
    ) -> Snapshot:
        frozen: dict[TypeUrl, Mapping[str, bytes]] = {}
        versions: dict[TypeUrl, str] = {}
        for t in TypeUrl:
            if layers is None or t not in layers:
                frozen[t], versions[t] = _frozen(t, resources.get(t, _NO_RESOURCES))
        if not isinstance(references, MappingProxyType):  # a read-only one is shared as is
            references = MappingProxyType(dict(references or {}))
        if not layers:
            return cls(MappingProxyType(frozen), references, MappingProxyType(versions))
        return _new_snapshot(
            MappingProxyType(frozen), references, MappingProxyType(versions), layers
        )

    def patched(self, changes: Mapping[TypeUrl, Mapping[str, bytes]]) -> Snapshot:
        """This snapshot with existing resources replaced (names and references unchanged):
        a change of shared resources costs each node a lookup per changed type (a shared
        mapping is merged once for every node holding it) and a copy of its two per-type
        dicts, not a rebuild. Returns ``self`` when nothing differs."""
        resources: dict[TypeUrl, Mapping[str, bytes]] | None = None
        versions: dict[TypeUrl, str] | None = None
        layers = self.layers
        held, own_versions = (
            (self.resources, self.versions)
            if not layers
            else (self.resources.own, self.versions.own)  # type: ignore[attr-defined]
        )
        for t, replacement in changes.items():
            if t in layers:
                continue  # read through its layer: a change there reached it already
            current = held[t]
            if t in _SHARED_TYPES:
                # nodes that hold the same shared mapping (every caller of a service holds one
                # EDS mapping) get the same patched one: merged and versioned once
                key = (id(current), tuple(replacement.items()))
                hit = _patches.get(key)
                if hit is None or hit[0] is not current:
                    hit = (current, *_merge(t, current, replacement))
                    _remember(current)
                    _patches[key] = hit
                merged, version = hit[1], hit[2]
            else:
                for n, b in replacement.items():  # (what _merge looks for, without a call)
                    now = current.get(n)
                    if now is not None and now is not b and now != b:
                        break
                else:
                    continue  # nothing differs (the common case: a caller's cluster)
                merged, version = _merge(t, current, replacement)
            if merged is None:
                continue
            if resources is None or versions is None:
                resources, versions = _copied(held), _copied(own_versions)
            resources[t] = merged
            versions[t] = version
        if resources is None or versions is None:
            return self
        return _new_snapshot(
            MappingProxyType(resources), self.references, MappingProxyType(versions), layers
        )

    def version(self, type_url: TypeUrl) -> str:
        return self.versions.get(type_url, "")

    def get(self, type_url: TypeUrl) -> Mapping[str, bytes]:
        return self.resources.get(type_url, _NO_RESOURCES)

    def missing(self) -> frozenset[tuple[TypeUrl, str]]:
        """Referenced (type, name) pairs that the snapshot does not hold."""
        return frozenset(
            (t, name)
            for t, names in self.references.items()
            for name in names
            if name not in self.get(t)
        )

    def consistent(self) -> bool:
        return not self.missing()


_set_resources = Snapshot.__dict__["resources"].__set__
_set_references = Snapshot.__dict__["references"].__set__
_set_versions = Snapshot.__dict__["versions"].__set__
_set_layers = Snapshot.__dict__["layers"].__set__


def _new_snapshot(
    resources: Mapping[TypeUrl, Mapping[str, bytes]],
    references: Mapping[TypeUrl, frozenset[str]],
    versions: Mapping[TypeUrl, str],
    layers: Mapping[TypeUrl, Layer] = _NO_LAYERS,
) -> Snapshot:
    """``Snapshot(resources, references, versions, layers)`` without the frozen dataclass's
    ``__init__`` (an ``object.__setattr__`` per field: ~1 us, a third of a patch per node);
    ``resources`` and ``versions`` are the node's own, read through ``layers`` if any."""
    snapshot = object.__new__(Snapshot)
    if layers:
        resources = _Layered(resources, layers, False)
        versions = _Layered(versions, layers, True)
    _set_resources(snapshot, resources)
    _set_references(snapshot, references)
    _set_versions(snapshot, versions)
    _set_layers(snapshot, layers)
    return snapshot


def _copied(mapping: Mapping[TypeUrl, _V]) -> dict[TypeUrl, _V]:
    """A dict copy of a snapshot's per-type mapping (a read-only proxy's ``copy`` copies the
    dict under it, several times faster than ``dict(proxy)``)."""
    if type(mapping) is MappingProxyType or type(mapping) is dict:
        return mapping.copy()
    return dict(mapping)


class ResourceVersions:
    """Version of a packed resource: a content hash, memoized by the bytes object.

    Resources are shared between nodes and streams, so each distinct bytes object is hashed
    once, however many streams send it. The memo is keyed by the bytes themselves: CPython
    caches a bytes object's hash, and a dict lookup with the very same object is an identity
    check, so a hit costs no more than a lookup by ``id``. Bounded: two generations, each of at
    most ``limit`` entries and ``max_bytes`` of keys; an entry unused for a whole generation is
    dropped (and hashed again if it ever comes back), so the memo keeps at most about
    ``2 * max_bytes`` of resources alive that no snapshot holds any more.
    """

    __slots__ = ("_current", "_current_bytes", "_limit", "_max_bytes", "_previous", "hashed")

    def __init__(self, limit: int = 100_000, max_bytes: int = 16 << 20) -> None:
        self._current: dict[bytes, str] = {}
        self._previous: dict[bytes, str] = {}
        self._current_bytes = 0
        self._limit = limit
        self._max_bytes = max_bytes
        self.hashed = 0  # resources actually hashed (tests and benchmarks read it)

    def __call__(self, packed: bytes) -> str:
        version = self._current.get(packed)
        if version is not None:
            return version
        version = self._previous.get(packed)
        if version is None:
            version = hashlib.blake2b(packed, digest_size=8).hexdigest()
            self.hashed += 1
        if len(self._current) >= self._limit or self._current_bytes >= self._max_bytes:
            self._previous, self._current, self._current_bytes = self._current, {}, 0
        self._current[packed] = version
        self._current_bytes += len(packed)
        return version


resource_version = ResourceVersions()
"""The process's one memo of resource versions: snapshots (per-type versions) and delta
streams (per-resource versions) share it, so each distinct resource is hashed once."""


def content_version(resources: Mapping[str, bytes]) -> str:
    """Opaque version = hash of the (name, resource version) set: stable across restarts and
    processes, and as cheap as the number of resources (not their size)."""
    h = hashlib.sha256()
    for name in sorted(resources):
        h.update(f"{len(name)}:{name}:{resource_version(resources[name])};".encode())
    return h.hexdigest()[:16]


class Packer:
    """Memo of packed resources keyed by their inputs: equal inputs are serialized once.

    Not semantics, only cost: a pure builder given the same inputs gives the same bytes with or
    without it. Bounded: cleared wholesale when it grows past ``limit`` entries.
    """

    def __init__(self, limit: int = 200_000) -> None:
        self._memo: dict[Hashable, bytes] = {}
        self._limit = limit
        self.packed = 0  # resources actually serialized (tests assert sharing with it)

    def get(
        self, key: Hashable, type_url: TypeUrl, make: Callable[[], betterproto2.Message]
    ) -> bytes:
        return self.get_bytes((type_url, key), lambda: pb.pack(make(), type_url))

    def get_bytes(self, key: Hashable, make: Callable[[], bytes]) -> bytes:
        """Like ``get`` for a maker that returns packed ``Any`` bytes itself (hand encodings)."""
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if len(self._memo) >= self._limit:
            self._memo.clear()
        value = make()
        self.packed += 1
        self._memo[key] = value
        return value


# ---------------------------------------------------------------------------------------------
# small constructors


def _ads() -> ConfigSource:
    return ConfigSource(ads=AggregatedConfigSource(), resource_api_version=ApiVersion.V3)


def _local_sds() -> ConfigSource:
    return ConfigSource(
        api_config_source=ApiConfigSource(
            api_type=ApiConfigSourceApiType.GRPC,
            transport_api_version=ApiVersion.V3,
            grpc_services=[GrpcService(envoy_grpc=GrpcServiceEnvoyGrpc(cluster_name=SDS_CLUSTER))],
        ),
        resource_api_version=ApiVersion.V3,
    )


def _address(host: str, port: int) -> Address:
    return Address(socket_address=SocketAddress(address=host, port_value=port))


def _common_tls(san_matchers: Sequence[SubjectAltNameMatcher]) -> CommonTlsContext:
    return CommonTlsContext(
        tls_certificate_sds_secret_configs=[
            SdsSecretConfig(name=WORKLOAD_CERT, sds_config=_local_sds())
        ],
        combined_validation_context=CommonTlsContextCombinedCertificateValidationContext(
            default_validation_context=CertificateValidationContext(
                match_typed_subject_alt_names=list(san_matchers)
            ),
            validation_context_sds_secret_config=SdsSecretConfig(
                name=MESH_TRUST, sds_config=_ads()
            ),
        ),
    )


def _uri_san(matcher: StringMatcher) -> SubjectAltNameMatcher:
    return SubjectAltNameMatcher(san_type=SubjectAltNameMatcherSanType.URI, matcher=matcher)


def _hcm(
    stat_prefix: str,
    http_filters: list[HttpFilter],
    rds: Rds | None = None,
    route_config: RouteConfiguration | None = None,
    set_client_cert: bool = False,
) -> Filter:
    # set_client_cert (the inbound HCM): x-forwarded-client-cert is replaced by the verified
    # client certificate's Subject and URI SAN (whatever the caller sent is dropped) before any
    # HTTP filter runs.
    manager = HttpConnectionManager(
        stat_prefix=stat_prefix,
        http_filters=[*http_filters, HttpFilter(name=ROUTER_FILTER, typed_config=_any(Router()))],
        rds=rds,
        route_config=route_config,
        forward_client_cert_details=HttpConnectionManagerForwardClientCertDetails.SANITIZE_SET
        if set_client_cert
        else HttpConnectionManagerForwardClientCertDetails.SANITIZE,
        set_current_client_cert_details=HttpConnectionManagerSetCurrentClientCertDetails(
            subject=True, uri=True
        )
        if set_client_cert
        else None,
    )
    return Filter(name=HCM, typed_config=_any(manager))


def _any(message: betterproto2.Message) -> AnyMsg:
    return AnyMsg.pack(message)


# ---------------------------------------------------------------------------------------------
# resources


def build_mesh_trust(trust: TrustMaterial) -> Secret:
    context = CertificateValidationContext(
        trusted_ca=DataSource(inline_bytes=trust.bundle_pem),
        crl=DataSource(inline_bytes=trust.crl_pem) if trust.crl_pem else None,
        only_verify_leaf_cert_crl=bool(trust.crl_pem),
    )
    return Secret(name=MESH_TRUST, validation_context=context)


def build_outbound_cluster(
    service: str, peer_ids: Sequence[str], trust_domain: str, settings: BuildSettings
) -> Cluster:
    # No attested peer: pin to an identity nobody holds rather than leave the SAN check empty.
    ids = peer_ids or (f"spiffe://{trust_domain}/-/none",)
    tls = UpstreamTlsContext(
        common_tls_context=_common_tls([_uri_san(StringMatcher(exact=i)) for i in ids])
    )
    return Cluster(
        name=outbound_name(service),
        type=ClusterDiscoveryType.EDS,
        eds_cluster_config=ClusterEdsClusterConfig(eds_config=_ads()),
        connect_timeout=settings.connect_timeout,
        transport_socket=TransportSocket(name=TLS_SOCKET, typed_config=_any(tls)),
    )


def build_app_cluster(app_port: int, settings: BuildSettings) -> Cluster:
    return Cluster(
        name=INBOUND_APP_CLUSTER,
        type=ClusterDiscoveryType.STATIC,
        connect_timeout=settings.connect_timeout,
        load_assignment=build_load_assignment(
            INBOUND_APP_CLUSTER, [(settings.app_address, app_port)]
        ),
    )


def build_load_assignment(name: str, endpoints: Sequence[tuple[str, int]]) -> ClusterLoadAssignment:
    return ClusterLoadAssignment(
        cluster_name=name,
        endpoints=[
            LocalityLbEndpoints(
                lb_endpoints=[
                    LbEndpoint(endpoint=Endpoint(address=_address(host, port)))
                    for host, port in endpoints
                ]
            )
        ]
        if endpoints
        else [],
    )


def build_inbound_listener(reg: Registration, trust_domain: str) -> Listener:
    # Any identity of the trust domain may handshake; who may call is RBAC's job (in RDS), so
    # policy changes never drain this listener.
    tls = DownstreamTlsContext(
        require_client_certificate=True,
        common_tls_context=_common_tls(
            [_uri_san(StringMatcher(prefix=f"spiffe://{trust_domain}/"))]
        ),
    )
    deny_all = RbacFilter(rules=RbacRules(action=RbacAction.ALLOW, policies={}))
    hcm = _hcm(
        INBOUND_LISTENER,
        [HttpFilter(name=RBAC_FILTER, typed_config=_any(deny_all))],
        rds=Rds(config_source=_ads(), route_config_name=INBOUND_ROUTE),
        set_client_cert=True,  # claims-conditioned RBAC matches the caller's Subject in XFCC
    )
    return Listener(
        name=INBOUND_LISTENER,
        address=_address(reg.inbound.address, reg.inbound.port),
        filter_chains=[
            FilterChain(
                filters=[hcm],
                transport_socket=TransportSocket(name=TLS_SOCKET, typed_config=_any(tls)),
            )
        ],
    )


def build_outbound_listener(service: str, port: int, settings: BuildSettings) -> Listener:
    name = outbound_name(service)
    routes = RouteConfiguration(
        name=name,
        virtual_hosts=[
            VirtualHost(
                name=service,
                domains=["*"],
                routes=[Route(match=RouteMatch(prefix="/"), route=RouteAction(cluster=name))],
            )
        ],
    )
    return Listener(
        name=name,
        address=_address(settings.outbound_bind, port),
        filter_chains=[FilterChain(filters=[_hcm(name, [], route_config=routes)])],
    )


def _or_rules(rules: list[RbacPermission]) -> RbacPermission:
    return rules[0] if len(rules) == 1 else RbacPermission(or_rules=PermissionSet(rules=rules))


def build_rbac_permission(match: HttpMatch) -> RbacPermission:
    """One ``to`` entry: ports OR'ed, AND paths (prefix) OR'ed, AND methods OR'ed."""
    parts: list[RbacPermission] = []
    if match.ports:
        parts.append(_or_rules([RbacPermission(destination_port=p) for p in sorted(match.ports)]))
    if match.paths:
        parts.append(
            _or_rules(
                [
                    RbacPermission(url_path=PathMatcher(path=StringMatcher(prefix=p)))
                    for p in match.paths
                ]
            )
        )
    if match.methods:
        parts.append(
            _or_rules(
                [
                    RbacPermission(
                        header=HeaderMatcher(name=":method", string_match=StringMatcher(exact=m))
                    )
                    for m in sorted(match.methods)
                ]
            )
        )
    if not parts:
        return RbacPermission(any=True)
    return parts[0] if len(parts) == 1 else RbacPermission(and_rules=PermissionSet(rules=parts))


def xfcc_subject_fragment(claims_class: str) -> str:
    """What the x-forwarded-client-cert value the inbound HCM sets contains, and only then,
    when the verified client certificate's Subject is exactly ``O=attestmesh,
    OU=<claims_class>``. The HCM replaces the header (SANITIZE_SET, Subject and URI; Envoy
    always adds By and Hash), e.g. ``By=<own id>;Hash=<hex>;Subject="OU=claims-<hex>,
    O=attestmesh";URI=<caller id>``: Envoy prints the Subject in RFC 2253 order (last RDN
    first), double-quoted. The fragment is delimited by ``;Subject="`` and ``";URI=``, so a
    longer or shorter OU, extra RDNs or another class do not match; no other field can hold
    a double quote (By and URI are SPIFFE IDs). A substring, not a regex: Envoy refuses RE2
    programs over 100 instructions (``re2.max_program_size.error_level``) and this one was 112."""
    return f';Subject="OU={claims_class},O={CLAIMS_CLASS_ORG}";URI='


def build_rbac_principal(permission: Permission) -> Principal:
    """The certificate ``permission`` admits: its SPIFFE ID (the URI SAN), and when it is
    claims-conditioned, also a Subject naming one of its claims classes."""
    identity = Principal(
        authenticated=PrincipalAuthenticated(
            principal_name=StringMatcher(exact=permission.principal)
        )
    )
    if permission.claim_classes is None:
        return identity
    classes = [
        Principal(
            header=HeaderMatcher(
                name=XFCC,
                string_match=StringMatcher(contains=xfcc_subject_fragment(c)),
            )
        )
        for c in sorted(permission.claim_classes)
    ]
    claims = classes[0] if len(classes) == 1 else Principal(or_ids=PrincipalSet(ids=classes))
    return Principal(and_ids=PrincipalSet(ids=[identity, claims]))


def build_rbac(permissions: Sequence[Permission]) -> RbacRules:
    """ALLOW policies, one per permission (a principal, perhaps limited to claims classes); no
    permission at all denies everyone."""
    policies = {
        f"{i:04d}|{p.principal}": Policy(
            principals=[build_rbac_principal(p)],
            permissions=[build_rbac_permission(m) for m in p.to] or [RbacPermission(any=True)],
        )
        for i, p in enumerate(permissions)
    }
    return RbacRules(action=RbacAction.ALLOW, policies=policies)


def build_inbound_routes(permissions: Sequence[Permission]) -> RouteConfiguration:
    per_route = RbacPerRoute(rbac=RbacFilter(rules=build_rbac(permissions)))
    return RouteConfiguration(
        name=INBOUND_ROUTE,
        virtual_hosts=[
            VirtualHost(
                name=INBOUND_ROUTE,
                domains=["*"],
                routes=[
                    Route(
                        match=RouteMatch(prefix="/"),
                        route=RouteAction(cluster=INBOUND_APP_CLUSTER),
                        typed_per_filter_config={RBAC_FILTER: _any(per_route)},
                    )
                ],
            )
        ],
    )


# ---------------------------------------------------------------------------------------------
# the snapshot


_Group = tuple[str, tuple[str, ...], bool]
"""Callers that read one endpoints layer: namespace, outbound services as spelled (sorted),
attested."""


class SharedResources:
    """Resources many nodes share, built and serialised once and reused until what they are
    built from changes: a service's outbound cluster (its members' identities) and endpoints,
    a destination identity's inbound routes (its authorization), the trust secret.

    Callers invalidate by service, by destination identity, or everything (mesh policies, trust
    domain, settings); the memo never decides anything, it only saves work.
    """

    def __init__(
        self,
        index: MeshIndex,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        settings: BuildSettings,
        packer: Packer,
    ) -> None:
        self.index = index
        self.mesh_policies = tuple(mesh_policies)
        self.trust = trust
        self.settings = settings
        self.packer = packer
        # per service, per spelling of it in callers' outbound entries (the resource name)
        self._clusters: dict[ServiceKey, dict[str, bytes]] = {}
        self._endpoints: dict[ServiceKey, dict[str, bytes]] = {}
        self._routes: dict[Identity, bytes] = {}
        self._trust: bytes | None = None
        # the endpoints layers, one per group of callers (namespace, outbound services as
        # spelled, attested), and the groups that call each service
        self._groups: dict[_Group, Mapping[TypeUrl, Layer]] = {}
        self._groups_of: dict[ServiceKey, set[_Group]] = {}
        self._trust_layer: Layer | None = None

    def invalidate_services(self, services: Iterable[ServiceKey]) -> None:
        for s in services:
            self._clusters.pop(s, None)
            self._endpoints.pop(s, None)

    def clusters_of(self, service: ServiceKey) -> dict[str, bytes]:
        """The outbound clusters of ``service`` built so far, per spelling (to tell, after
        ``invalidate_services``, whether they changed)."""
        return dict(self._clusters.get(service, {}))

    def layers(self, reg: Registration, attested: bool) -> Mapping[TypeUrl, Layer]:
        """What a node registered as ``reg`` reads through layers: the endpoints of its group
        (every caller of the same services, spelled alike, from its namespace, attested or
        not) and the trust secret; one read-only mapping per group, shared by its nodes."""
        key: _Group = (reg.namespace, tuple(sorted(reg.outbound)), attested)
        layers = self._groups.get(key)
        if layers is None:
            layers = self._groups[key] = MappingProxyType(
                {
                    TypeUrl.ENDPOINT: Layer(*self._group_endpoints(key)),
                    TypeUrl.SECRET: self.trust_layer(),
                }
            )
            for spelled in key[1]:
                self._groups_of.setdefault(resolve_service(key[0], spelled), set()).add(key)
        return layers

    def _group_endpoints(self, key: _Group) -> tuple[Mapping[str, bytes], str]:
        namespace, outbound, attested = key
        endpoints = {
            outbound_name(spelled): (
                self.endpoints(resolve_service(namespace, spelled), spelled)
                if attested
                else _load_assignment(self.packer, outbound_name(spelled), ())
            )
            for spelled in outbound
        }
        return _frozen(TypeUrl.ENDPOINT, endpoints)

    def refresh_endpoint_layers(self, services: Iterable[ServiceKey]) -> None:
        """After ``invalidate_services(services)``: the layers of the attested groups that
        call them take their new endpoints (an unattested group's have none, ever)."""
        keys: set[_Group] = set()
        for s in services:
            keys |= self._groups_of.get(s, set())
        for key in keys:
            if key[2]:
                self._groups[key][TypeUrl.ENDPOINT].set(*self._group_endpoints(key))

    def trust_layer(self) -> Layer:
        """The layer holding the trust secret every node reads."""
        if self._trust_layer is None:
            self._trust_layer = Layer(*self._trust_mapping())
        return self._trust_layer

    def _trust_mapping(self) -> tuple[Mapping[str, bytes], str]:
        return _frozen(TypeUrl.SECRET, {MESH_TRUST: self.trust_secret()})

    def invalidate_routes(self, destinations: Iterable[Identity]) -> None:
        for d in destinations:
            self._routes.pop(d, None)

    def set_mesh_policies(self, mesh_policies: Sequence[MeshPolicy]) -> None:
        self.mesh_policies = tuple(mesh_policies)
        self._routes.clear()

    def set_trust(self, trust: TrustMaterial) -> None:
        if trust != self.trust:
            self.trust = trust
            self._trust = None
            if self._trust_layer is not None:
                self._trust_layer.set(*self._trust_mapping())

    def trust_secret(self) -> bytes:
        if self._trust is None:
            trust = self.trust
            self._trust = self.packer.get(
                ("trust", trust), TypeUrl.SECRET, lambda: build_mesh_trust(trust)
            )
        return self._trust

    def outbound_cluster(self, service: ServiceKey, spelled: str) -> bytes:
        """Cluster ``out|<spelled>`` of a caller that names ``service`` as ``spelled``: it pins
        the identities of the service's attested members."""
        per = self._clusters.setdefault(service, {})
        hit = per.get(spelled)
        if hit is None:
            td, settings = self.index.trust_domain, self.settings
            ids = tuple(sorted({p.spiffe_id(td) for p in self.index.peers(service)}))
            hit = per[spelled] = self.packer.get(
                ("out", spelled, ids, td, settings),
                TypeUrl.CLUSTER,
                lambda: build_outbound_cluster(spelled, ids, td, settings),
            )
        return hit

    def endpoints(self, service: ServiceKey, spelled: str) -> bytes:
        """The load assignment an attested caller naming ``service`` as ``spelled`` gets."""
        per = self._endpoints.setdefault(service, {})
        hit = per.get(spelled)
        if hit is None:
            eps = tuple(
                sorted(
                    (p.inbound.address, p.inbound.port)
                    for p in self.index.peers(service)
                    if p.ready
                )
            )
            hit = per[spelled] = _load_assignment(self.packer, outbound_name(spelled), eps)
        return hit

    def inbound_routes(self, destination: Identity) -> bytes:
        """The inbound route table (with its RBAC) of attested workloads of ``destination``."""
        hit = self._routes.get(destination)
        if hit is None:
            permissions = compile_permissions_for(
                self.mesh_policies,
                destination,
                self.index.trust_domain,
                self.index.attested_with,
            )
            hit = self._routes[destination] = _routes(self.packer, permissions)
        return hit


def _load_assignment(packer: Packer, name: str, eps: tuple[tuple[str, int], ...]) -> bytes:
    """Hand-encoded (``pb.encode_load_assignment``; equal to ``build_load_assignment``'s bytes):
    a service with thousands of endpoints costs a join of memoized entries, not a message tree."""
    return packer.get_bytes(
        ("eds", name, eps),
        lambda: pb.pack_bytes(
            pb.encode_load_assignment(name, (_lb_endpoint(h, p) for h, p in eps)),
            TypeUrl.ENDPOINT,
        ),
    )


@functools.lru_cache(maxsize=65_536)
def _lb_endpoint(host: str, port: int) -> bytes:
    return pb.encode_lb_endpoint(host, port)


@functools.lru_cache(maxsize=16)
def _inbound_listener_parts(trust_domain: str) -> tuple[bytes, bytes]:
    """The inbound listener's serialized fields before (name) and after (filter chains) its
    address: the same for every node of a trust domain."""
    full = build_inbound_listener(
        Registration("-", "-", "-", "-", WorkloadEndpoint("0.0.0.0", 1), 1), trust_domain
    )
    head = bytes(Listener(name=full.name))
    tail = bytes(Listener(filter_chains=full.filter_chains))
    return head, tail


def inbound_listener_bytes(reg: Registration, trust_domain: str) -> bytes:
    """``pb.pack(build_inbound_listener(reg, td))`` without rebuilding the message per node: the
    shared fields are serialized once per trust domain and the node's address spliced in."""
    head, tail = _inbound_listener_parts(trust_domain)
    address = pb.encode_address(reg.inbound.address, reg.inbound.port)
    return pb.pack_bytes(head + pb._ld(2, address) + tail, TypeUrl.LISTENER)


@functools.lru_cache(maxsize=16)
def _app_cluster_head(settings: BuildSettings) -> bytes:
    """The app cluster's serialized fields before its load assignment (name, type, connect
    timeout): the same for every node."""
    return bytes(
        Cluster(
            name=INBOUND_APP_CLUSTER,
            type=ClusterDiscoveryType.STATIC,
            connect_timeout=settings.connect_timeout,
        )
    )


def app_cluster_bytes(app_port: int, settings: BuildSettings) -> bytes:
    """``pb.pack(build_app_cluster(app_port, settings))`` without a message tree per node (each
    workload has its own app port: ~0.3 ms of betterproto per new stream after a restart): the
    shared fields serialized once, the node's load assignment (field 33) hand-encoded."""
    # not _lb_endpoint's cache: a node's own port would hold an entry per node there
    endpoint = pb.encode_lb_endpoint(settings.app_address, app_port)
    assignment = pb.encode_load_assignment(INBOUND_APP_CLUSTER, (endpoint,))
    return pb.pack_bytes(_app_cluster_head(settings) + pb._ld(33, assignment), TypeUrl.CLUSTER)


def _routes(packer: Packer, permissions: tuple[Permission, ...]) -> bytes:
    return packer.get(
        ("rds", permissions), TypeUrl.ROUTE, lambda: build_inbound_routes(permissions)
    )


def build_node_snapshot(shared: SharedResources, node: str) -> Snapshot:
    """Envoy ``node``'s complete, consistent configuration from the shared resources: cost
    follows the node's own configuration (its outbound services), not the size of the mesh."""
    me = shared.index.get(node)
    if me is None:
        raise UnknownWorkloadError("unknown_identity", f"no workload {node!r}")
    packer, settings, td = shared.packer, shared.settings, shared.index.trust_domain
    reg = me.registration
    attested = me.status is Status.ATTESTED
    clusters: dict[str, bytes] = {
        INBOUND_APP_CLUSTER: packer.get_bytes(
            ("app", reg.app_port, settings), lambda: app_cluster_bytes(reg.app_port, settings)
        )
    }
    listeners: dict[str, bytes] = {
        INBOUND_LISTENER: packer.get_bytes(
            ("inbound", reg.inbound, td), lambda: inbound_listener_bytes(reg, td)
        )
    }
    for service, port in sorted(reg.outbound.items()):
        name = outbound_name(service)
        key = resolve_service(reg.namespace, service)
        clusters[name] = shared.outbound_cluster(key, service)
        listeners[name] = packer.get(
            ("outl", service, port, settings),
            TypeUrl.LISTENER,
            lambda s=service, p=port: build_outbound_listener(s, p, settings),  # type: ignore[misc]
        )
    routes = {
        INBOUND_ROUTE: shared.inbound_routes(principal_of(reg)) if attested else _routes(packer, ())
    }
    # the endpoints and the trust secret through layers: a change of a service's endpoints or
    # of the CRL is one layer's new mapping, not a patch of every caller's snapshot
    layers = shared.layers(reg, attested)
    return Snapshot.of(
        {TypeUrl.CLUSTER: clusters, TypeUrl.LISTENER: listeners, TypeUrl.ROUTE: routes},
        _node_references(frozenset(reg.outbound)),
        layers,
    )


@functools.lru_cache(maxsize=4_096)
def _node_references(outbound: frozenset[str]) -> Mapping[TypeUrl, frozenset[str]]:
    """What a node's resources reference, one read-only mapping per set of outbound services
    (shared by every node that calls the same services: ~0.9 KB less per node snapshot)."""
    return MappingProxyType(
        {
            # EDS clusters name their load assignments, the inbound HCM its route table.
            REFERENCED_BY[TypeUrl.CLUSTER]: frozenset(outbound_name(s) for s in outbound),
            REFERENCED_BY[TypeUrl.LISTENER]: _INBOUND_ROUTE_REF,
            TypeUrl.SECRET: _MESH_TRUST_REF,
        }
    )


_INBOUND_ROUTE_REF = frozenset({INBOUND_ROUTE})
_MESH_TRUST_REF = frozenset({MESH_TRUST})


def build_snapshot(
    state: MeshState,
    node: str,
    mesh_policies: Sequence[MeshPolicy],
    trust: TrustMaterial,
    settings: BuildSettings | None = None,
    packer: Packer | None = None,
) -> Snapshot:
    """The complete, consistent configuration of Envoy ``node`` for this mesh state."""
    state.get(node)  # unknown nodes raise before the index is built
    shared = SharedResources(
        MeshIndex.of(state), mesh_policies, trust, settings or BuildSettings(), packer or Packer()
    )
    return build_node_snapshot(shared, node)


def build_snapshots(
    state: MeshState,
    mesh_policies: Sequence[MeshPolicy],
    trust: TrustMaterial,
    settings: BuildSettings | None = None,
    packer: Packer | None = None,
) -> dict[str, Snapshot]:
    """Snapshots of every registered node from one index and one set of shared resources: a
    full rebuild (start-up, tests, the reference the incremental publisher is checked against)."""
    shared = SharedResources(
        MeshIndex.of(state), mesh_policies, trust, settings or BuildSettings(), packer or Packer()
    )
    return {name: build_node_snapshot(shared, name) for name in sorted(state.workloads)}


__all__ = [
    "BuildSettings",
    "Layer",
    "Packer",
    "ResourceVersions",
    "SharedResources",
    "Snapshot",
    "TrustMaterial",
    "build_node_snapshot",
    "build_snapshot",
    "build_snapshots",
    "content_version",
    "resource_version",
]
