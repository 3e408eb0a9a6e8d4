"""The sidecar's local SDS server over a real Unix socket, as Envoy's sds-local cluster calls it."""

from __future__ import annotations

import asyncio
import shutil
import stat
import tempfile
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import grpclib.const
import pytest
from grpclib.client import Channel
from pydantic.warnings import PydanticDeprecatedSince212

from sidecar.sds import LocalSds, start_sds
from xds.resources import SDS_SERVICE, WORKLOAD_CERT, TypeUrl

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.extensions.transport_sockets.tls.v3 import Secret
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest, DiscoveryResponse

METHOD = f"/{SDS_SERVICE}/StreamSecrets"


@pytest.fixture
async def sds_socket() -> AsyncIterator[tuple[LocalSds, Path]]:
    d = Path(tempfile.mkdtemp(prefix="sds-", dir="/tmp"))
    sds = LocalSds()
    path = d / "sds.sock"
    server = await start_sds(sds, path)
    try:
        yield sds, path
    finally:
        server.close()
        await server.wait_closed()
        shutil.rmtree(d, ignore_errors=True)


def secret(resp: DiscoveryResponse) -> Secret:
    (res,) = resp.resources
    assert res.type_url == TypeUrl.SECRET
    msg = res.unpack()
    assert isinstance(msg, Secret)
    return msg


def pair(s: Secret) -> tuple[bytes, bytes]:
    cert = s.tls_certificate
    assert cert is not None and cert.certificate_chain is not None and cert.private_key is not None
    return cert.certificate_chain.inline_bytes or b"", cert.private_key.inline_bytes or b""


async def test_socket_is_private(sds_socket: tuple[LocalSds, Path]) -> None:
    _, path = sds_socket
    mode = path.stat().st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


async def test_serves_workload_cert_and_pushes_rotation(
    sds_socket: tuple[LocalSds, Path],
) -> None:
    sds, path = sds_socket
    channel = Channel(path=str(path))
    try:
        async with channel.request(
            METHOD, grpclib.const.Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
        ) as stream:
            await stream.send_message(
                DiscoveryRequest(
                    node=Node(id="frontend"),
                    type_url=TypeUrl.SECRET,
                    resource_names=[WORKLOAD_CERT],
                )
            )
            # nothing to serve until the agent has a certificate
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.15):
                    await stream.recv_message()
            sds.update(b"CHAIN-1", b"KEY-1")
            async with asyncio.timeout(2):
                first = await stream.recv_message()
            assert first is not None
            s1 = secret(first)
            assert s1.name == WORKLOAD_CERT
            assert pair(s1) == (b"CHAIN-1", b"KEY-1")
            await stream.send_message(
                DiscoveryRequest(
                    type_url=TypeUrl.SECRET,
                    resource_names=[WORKLOAD_CERT],
                    version_info=first.version_info,
                    response_nonce=first.nonce,
                )
            )
            sds.update(b"CHAIN-2", b"KEY-2")  # rotation reaches the connected Envoy at once
            async with asyncio.timeout(2):
                second = await stream.recv_message()
            assert second is not None
            assert second.version_info != first.version_info
            assert pair(secret(second)) == (b"CHAIN-2", b"KEY-2")
            await stream.end()
    finally:
        channel.close()
    assert sds.rotations == 2
