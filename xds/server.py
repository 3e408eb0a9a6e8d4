"""State-of-the-world ADS over grpclib: snapshots from the cache to each Envoy's stream.

The protocol logic lives in :class:`AdsSession` (no I/O: requests in, encoded responses out) so it
is tested with plain values; :class:`AdsServer` only moves bytes between a grpclib stream, the
session and the cache's watch.

Rules, each learnt from a real Envoy (see ENVOY-NOTES):

- LDS/CDS are wildcards; EDS/RDS/SDS are answered for the subscribed names, and again whenever the
  subscribed set changes (Envoy subscribes SDS names incrementally, before any response).
- A request is a NACK only when it carries an error *and* its version differs from the version
  sent under its nonce (Envoy may repeat a stale error_detail on a later ACK).
- After every CDS response the next EDS request is answered even if it looks like an ACK: Envoy
  re-requests EDS with the old nonce when CDS changed an EDS cluster, and a silent server leaves
  that cluster warming until ``initial_fetch_timeout``.
- Several pending types go out in ADS order (SDS, CDS, EDS, LDS, RDS).
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import grpclib.const
import grpclib.server
from grpclib.exceptions import GRPCError, StreamTerminatedError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.metrics import Metrics
from xds import pb
from xds.build import Packer, Snapshot, TrustMaterial, build_snapshot, content_version
from xds.cache import SnapshotCache
from xds.resources import ADS_ORDER, ADS_SERVICE, WILDCARD_TYPES, TypeUrl
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    record_attestation,
    register,
)

with warnings.catch_warnings():
    # generated code uses a pydantic 2.12-deprecated validator form; harmless, noisy
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse

log = logging.getLogger(__name__)

_NONCES_KEPT = 8


@dataclass(slots=True)
class _Sent:
    version: str
    at: float
    acked: bool = False


@dataclass(slots=True)
class _TypeState:
    subscribed: bool = False
    names: frozenset[str] = frozenset()
    sent_version: str | None = None
    sent_names: frozenset[str] | None = None
    sent: dict[str, _Sent] = field(default_factory=dict)
    force: bool = False
    eds_after_cds: bool = False


class AdsSession:
    """The protocol state of one ADS stream. Feed it requests, ask it for responses."""

    def __init__(self, node: str, metrics: Metrics, clock: Callable[[], float]) -> None:
        self.node = node
        self._metrics = metrics
        self._clock = clock
        self._types = {t: _TypeState() for t in TypeUrl}
        self._nonce = 0
        self.nacks: list[tuple[TypeUrl, str]] = []  # (type, Envoy's message), newest last

    def on_request(self, req: DiscoveryRequest) -> None:
        try:
            type_url = TypeUrl(req.type_url)
        except ValueError:
            log.warning("node %s requested unsupported type %r", self.node, req.type_url)
            return
        st = self._types[type_url]
        st.subscribed = True
        if type_url not in WILDCARD_TYPES:
            st.names = frozenset(req.resource_names)
        if not req.response_nonce:
            st.force = True  # initial request on this stream: always answered
        else:
            sent = st.sent.get(req.response_nonce)
            if sent is not None:
                self._classify(type_url, req, sent)
        if st.eds_after_cds:
            st.eds_after_cds = False
            st.force = True

    def _classify(self, type_url: TypeUrl, req: DiscoveryRequest, sent: _Sent) -> None:
        if req.error_detail is not None and req.version_info != sent.version:
            message = req.error_detail.message
            self._metrics.xds_nacks.labels(type_url.short).inc()
            self.nacks.append((type_url, message))
            del self.nacks[:-16]
            log.warning(
                "node %s rejected %s %s: %s", self.node, type_url.short, sent.version, message
            )
        elif not sent.acked:
            sent.acked = True
            self._metrics.xds_push_ack_seconds.labels(type_url.short).observe(
                max(0.0, self._clock() - sent.at)
            )

    def responses(self, snapshot: Snapshot) -> Iterator[bytes]:
        """Encoded DiscoveryResponses now due, in ADS order (a generator: state advances as each
        one is taken, so a send that fails leaves the rest pending)."""
        for type_url in ADS_ORDER:
            st = self._types[type_url]
            if not st.subscribed:
                continue
            available = snapshot.get(type_url)
            if type_url in WILDCARD_TYPES:
                chosen = dict(available)
                version = snapshot.version(type_url)
            else:
                chosen = {n: available[n] for n in sorted(st.names) if n in available}
                version = content_version(chosen)
            names = frozenset(chosen) if type_url in WILDCARD_TYPES else st.names
            if not st.force and version == st.sent_version and names == st.sent_names:
                continue
            self._nonce += 1
            nonce = str(self._nonce)
            st.force = False
            st.sent_version, st.sent_names = version, names
            st.sent[nonce] = _Sent(version, self._clock())
            if len(st.sent) > _NONCES_KEPT:
                del st.sent[next(iter(st.sent))]
            if type_url is TypeUrl.CLUSTER:
                self._types[TypeUrl.ENDPOINT].eds_after_cds = True
            yield pb.encode_discovery_response(version, type_url, nonce, chosen.values())


class AdsServer:
    """grpclib service: envoy.service.discovery.v3.AggregatedDiscoveryService (SotW only)."""

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        authorize: Authorize | None = None,
    ) -> None:
        self._cache = cache
        self._metrics = metrics or Metrics()
        self._clock = clock
        self._authorize = authorize

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/{ADS_SERVICE}/StreamAggregatedResources": grpclib.const.Handler(
                self.stream_aggregated_resources,
                grpclib.const.Cardinality.STREAM_STREAM,
                DiscoveryRequest,
                pb.Encoded,
            )
        }

    async def stream_aggregated_resources(
        self, stream: grpclib.server.Stream[DiscoveryRequest, pb.Encoded]
    ) -> None:
        authorize = self._authorize
        if authorize is None:
            node_key = _node_id
        else:
            uris = peer_uri_sans(stream.peer.cert())

            def node_key(first: DiscoveryRequest) -> str:
                node = _node_id(first)
                if not authorize(node, uris):
                    raise GRPCError(
                        grpclib.const.Status.PERMISSION_DENIED,
                        f"the client certificate does not identify node {node!r}",
                    )
                return node

        await serve_sotw_stream(stream, self._cache, self._metrics, self._clock, node_key)


Authorize = Callable[[str, tuple[str, ...]], bool]
"""May the client whose certificate carries these URI SANs fetch node ``node``'s config?"""


def peer_uri_sans(cert: Mapping[str, Any] | None) -> tuple[str, ...]:
    """URI SANs of a peer certificate as ``ssl.SSLSocket.getpeercert()`` reports them."""
    if not cert:
        return ()
    return tuple(v for k, v in cert.get("subjectAltName", ()) if k == "URI")


def _node_id(first: DiscoveryRequest) -> str:
    node = first.node.id if first.node is not None else ""
    if not node:
        raise GRPCError(grpclib.const.Status.INVALID_ARGUMENT, "node.id is required")
    return str(node)


async def serve_sotw_stream(
    stream: grpclib.server.Stream[DiscoveryRequest, pb.Encoded],
    cache: SnapshotCache,
    metrics: Metrics,
    clock: Callable[[], float],
    node_key: Callable[[DiscoveryRequest], str],
) -> None:
    """Serve one state-of-the-world stream from ``cache[node_key(first request)]`` until the
    client closes it. Requests are read concurrently; the cache's watch wakes the sender."""
    first = await stream.recv_message()
    if first is None:
        return
    node = node_key(first)
    session = AdsSession(node, metrics, clock)
    session.on_request(first)
    closed = False
    metrics.xds_streams.inc()
    try:
        with cache.watch(node) as watch:

            async def read() -> None:
                nonlocal closed
                try:
                    async for req in stream:
                        session.on_request(req)
                        watch.changed.set()
                except StreamTerminatedError:
                    pass  # the peer reset the stream: nothing more to send
                closed = True
                watch.changed.set()

            async with asyncio.TaskGroup() as tg:
                tg.create_task(read())
                while True:
                    await watch.changed.wait()
                    watch.changed.clear()
                    if closed:
                        break
                    snapshot = cache.get(node)
                    if snapshot is None:
                        continue
                    for message in session.responses(snapshot):
                        await stream.send_message(pb.Encoded(message))
    finally:
        metrics.xds_streams.dec()


def _warm_snapshot() -> Snapshot:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    reg = Registration("warm", "warm", "warm", "warm", Endpoint("127.0.0.1", 1), 2, {"warm": 3})
    state, _ = register(MeshState("warm.invalid"), reg, now)
    state, _ = record_attestation(
        state, "warm", AttestationRecord("sim", {}, "p", "0", now), IssuedCert(1, now), now, now
    )
    return build_snapshot(state, "warm", [], TrustMaterial(b"x", b"y"), packer=Packer())


def warm() -> None:
    """Build every resource kind and round-trip the discovery messages once, so the first
    real stream does not pay for pydantic's lazy schemas (~0.6 s cold)."""
    snapshot = _warm_snapshot()
    for type_url in TypeUrl:
        encoded = pb.encode_discovery_response("v", type_url, "1", snapshot.get(type_url).values())
        DiscoveryResponse.parse(encoded)
    pb.warm([lambda: DiscoveryRequest(version_info="v", type_url=TypeUrl.CLUSTER)])


async def start_ads(
    cache: SnapshotCache,
    host: str,
    port: int,
    metrics: Metrics | None = None,
) -> tuple[grpclib.server.Server, AdsServer]:
    """Cache betterproto2 validators (xds.pb), warm the message classes, then listen. The
    caller closes the server (``server.close(); await server.wait_closed()``)."""
    pb.install_validator_cache()
    warm()
    ads = AdsServer(cache, metrics)
    server = grpclib.server.Server([ads])
    await server.start(host, port)
    return server, ads


__all__ = ["AdsServer", "AdsSession", "serve_sotw_stream", "start_ads", "warm"]
