"""xDS over mutual TLS: an Envoy must present a mesh certificate, and may fetch only the node
its certificate names."""

from __future__ import annotations

import asyncio
import ssl
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpclib.const
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.serve import ControlPlaneSettings, _load_server_cert, _xds_tls
from certs.ca import CertificateAuthority
from certs.ca.templates import build_leaf
from tests.component.ads_transport import TRANSPORT, TRANSPORTS, serve_ads
from tests.unit.fixtures_core import csr_pem, new_key
from tests.unit.xds.meshfixture import TD, TRUST, allow, two_workloads
from xds.build import Packer, build_snapshots
from xds.cache import SnapshotCache
from xds.resources import ADS_SERVICE, TypeUrl
from xds.server import AdsServer, PeerIdentity, warm

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse

METHOD = f"/{ADS_SERVICE}/StreamAggregatedResources"


def client_context(ca: CertificateAuthority, tmp: Path, sa: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cadata=ca.bundle_pem.decode())
    ctx.set_alpn_protocols(["h2"])
    if sa is not None:
        key = new_key()
        now = datetime.now(UTC)
        leaf = build_leaf(
            x509.load_pem_x509_csr(csr_pem(key)),
            spiffe_id=f"spiffe://{TD}/ns/default/sa/{sa}",
            claims_extension=b"\x0c\x02{}",
            issuer=ca.intermediate,
            serial=x509.random_serial_number(),
            now=now,
            ttl=timedelta(minutes=5),
        )
        (tmp / f"{sa}.pem").write_bytes(ca.chain_pem(leaf))
        (tmp / f"{sa}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        ctx.load_cert_chain(tmp / f"{sa}.pem", tmp / f"{sa}.key")
    return ctx


@pytest.fixture(params=TRANSPORTS, autouse=True)
def _transport(request: pytest.FixtureRequest) -> None:
    TRANSPORT.name = request.param


@asynccontextmanager
async def ads_server(tmp: Path) -> AsyncIterator[tuple[int, CertificateAuthority]]:
    async with ads_server_tls(tmp) as (port, ca, _ctx):
        yield port, ca


@asynccontextmanager
async def ads_server_tls(
    tmp: Path,
) -> AsyncIterator[tuple[int, CertificateAuthority, ssl.SSLContext]]:
    """The ADS port over mTLS for ``two_workloads``, with the server's TLS context."""
    warm()
    ca = CertificateAuthority.load_or_create(tmp / "ca", TD, datetime.now(UTC))
    ctx = _xds_tls(ca)
    _load_server_cert(
        [ctx], ca, ControlPlaneSettings(state_dir=tmp, trust_domain=TD), datetime.now(UTC)
    )
    state = two_workloads()
    cache = SnapshotCache()
    cache.set_snapshots(
        build_snapshots(state, [allow("backend", "frontend")], TRUST, packer=Packer())
    )

    def authorize(node: str, peer: PeerIdentity) -> bool:
        w = state.workloads.get(node)
        return w is not None and w.registration.spiffe_id(TD) in peer.uris

    async with serve_ads(AdsServer(cache, authorize=authorize), ctx) as port:
        yield port, ca, ctx


async def first_response(port: int, ctx: ssl.SSLContext, node: str) -> DiscoveryResponse:
    channel = Channel("127.0.0.1", port, ssl=ctx)
    try:
        async with (
            asyncio.timeout(5),
            channel.request(
                METHOD, grpclib.const.Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
            ) as stream,
        ):
            await stream.send_message(
                DiscoveryRequest(type_url=TypeUrl.CLUSTER, node=Node(id=node))
            )
            resp = await stream.recv_message()
            assert resp is not None
            await stream.cancel()
            return resp
    finally:
        channel.close()


async def test_envoy_gets_its_own_node_config(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca):
        resp = await first_response(port, client_context(ca, tmp_path, "frontend"), "frontend")
        assert resp.resources


async def test_certificate_for_another_workload_is_refused(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca):
        with pytest.raises(GRPCError) as exc:
            await first_response(port, client_context(ca, tmp_path, "frontend"), "backend")
        assert exc.value.status is grpclib.const.Status.PERMISSION_DENIED


async def test_client_without_a_mesh_certificate_cannot_connect(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca):
        # the TLS handshake fails: the connection is lost before any gRPC status
        with pytest.raises((StreamTerminatedError, ssl.SSLError, ConnectionError)):
            await first_response(port, client_context(ca, tmp_path, None), "frontend")
