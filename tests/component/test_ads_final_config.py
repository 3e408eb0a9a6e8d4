"""The grpclib fallback transport: a stream whose certificate stops identifying its node gets
the node's configuration as it is now once, then PERMISSION_DENIED (the lean transport's
version is tests/integration/test_ads_lean.py, with a raw HTTP/2 client: grpclib's client drops
a message that arrives in the same read as the stream's reset)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import grpclib.const
import pytest
from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from attestmesh.serve import ControlPlaneSettings, _load_server_cert, _xds_tls
from certs.ca import CertificateAuthority
from tests.component.ads_transport import TRANSPORT, serve_ads
from tests.component.test_ads_mtls import (
    METHOD,
    DiscoveryRequest,
    DiscoveryResponse,
    Node,
    client_context,
)
from tests.unit.xds.meshfixture import TD, TRUST, allow, attested, reg, two_workloads
from xds.build import Packer, build_snapshots
from xds.cache import SnapshotCache
from xds.resources import TypeUrl
from xds.server import AdsServer, PeerIdentity, warm
from xds.state import MeshState


@pytest.fixture(autouse=True)
def _grpclib() -> None:
    TRANSPORT.name = "grpclib"


async def test_a_revoked_stream_gets_its_final_configuration_then_permission_denied(
    tmp_path: Path,
) -> None:
    """When the stream's certificate stops identifying its node (a quarantine revoked it), the
    node's configuration as it is now goes out once before PERMISSION_DENIED, so an honest
    Envoy applies it (admits nobody, routes nowhere) at once."""
    warm()
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, datetime.now(UTC))
    ctx = _xds_tls(ca)
    _load_server_cert(
        [ctx], ca, ControlPlaneSettings(state_dir=tmp_path, trust_domain=TD), datetime.now(UTC)
    )
    cache = SnapshotCache()
    cache.set_snapshots(
        build_snapshots(two_workloads(), [allow("backend", "frontend")], TRUST, packer=Packer())
    )
    revoked: set[str] = set()

    def authorize(node: str, peer: PeerIdentity) -> bool:
        return node not in revoked and any(u.endswith(f"/sa/{node}") for u in peer.uris)

    got: list[DiscoveryResponse] = []
    async with serve_ads(AdsServer(cache, authorize=authorize), ctx) as port:
        channel = Channel("127.0.0.1", port, ssl=client_context(ca, tmp_path, "frontend"))
        try:
            with pytest.raises(GRPCError) as exc:  # the status, raised as the call closes
                await final_then_status(channel, cache, revoked, got)
        finally:
            channel.close()
    first, final = got
    assert final.type_url == TypeUrl.CLUSTER and len(final.resources) < len(first.resources)
    assert exc.value.status is grpclib.const.Status.PERMISSION_DENIED
    assert "no longer identifies" in (exc.value.message or "")


async def final_then_status(
    channel: Channel, cache: SnapshotCache, revoked: set[str], got: list[DiscoveryResponse]
) -> None:
    async with (
        asyncio.timeout(10),
        channel.request(
            METHOD, grpclib.const.Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
        ) as stream,
    ):
        await stream.send_message(
            DiscoveryRequest(type_url=TypeUrl.CLUSTER, node=Node(id="frontend"))
        )
        first = await stream.recv_message()
        assert first is not None and first.resources
        await stream.send_message(  # the ACK: an open request again
            DiscoveryRequest(
                type_url=TypeUrl.CLUSTER,
                version_info=first.version_info,
                response_nonce=first.nonce,
            )
        )
        await asyncio.sleep(0.1)
        revoked.add("frontend")
        # the revocation's own change: frontend may call nothing more
        alone = attested(
            attested(MeshState(TD), reg("frontend", 15001), 1), reg("backend", 15002), 2
        )
        cache.set_snapshot("frontend", build_snapshots(alone, [], TRUST)["frontend"])
        final = await stream.recv_message()
        assert final is not None
        got.extend([first, final])
        await stream.recv_message()  # the end: a reset here, the status as the call closes
