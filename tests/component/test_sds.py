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

from sidecar.sds import LocalSds, leaf_pem, start_sds
from xds.resources import SDS_SERVICE, WORKLOAD_CERT, WORKLOAD_LEAF_CERT, TypeUrl

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


CHAIN = (
    b"-----BEGIN CERTIFICATE-----\nTEVBRg==\n-----END CERTIFICATE-----\n"
    b"-----BEGIN CERTIFICATE-----\nSU5URVI=\n-----END CERTIFICATE-----\n"
)
LEAF = b"-----BEGIN CERTIFICATE-----\nTEVBRg==\n-----END CERTIFICATE-----\n"


async def test_serves_the_full_chain_and_the_leaf_alone_with_one_key(
    sds_socket: tuple[LocalSds, Path],
) -> None:
    """``workload-cert`` (the mesh's listeners and clusters) keeps the intermediate;
    ``workload-leaf-cert`` (the ADS cluster) is the chain's first certificate; both rotate."""
    sds, path = sds_socket
    sds.update(CHAIN, b"KEY-1")
    channel = Channel(path=str(path))
    try:
        for name, chain in ((WORKLOAD_CERT, CHAIN), (WORKLOAD_LEAF_CERT, LEAF)):
            async with channel.request(
                METHOD, grpclib.const.Cardinality.STREAM_STREAM, DiscoveryRequest, DiscoveryResponse
            ) as stream:
                await stream.send_message(
                    DiscoveryRequest(
                        node=Node(id="frontend"), type_url=TypeUrl.SECRET, resource_names=[name]
                    )
                )
                async with asyncio.timeout(2):
                    first = await stream.recv_message()
                assert first is not None
                s = secret(first)  # the one asked for, alone
                assert s.name == name
                assert pair(s) == (chain, b"KEY-1")
                await stream.send_message(
                    DiscoveryRequest(
                        type_url=TypeUrl.SECRET,
                        resource_names=[name],
                        version_info=first.version_info,
                        response_nonce=first.nonce,
                    )
                )
                sds.update(CHAIN.replace(b"TEVBRg==", b"TkVX"), b"KEY-2")
                async with asyncio.timeout(2):
                    second = await stream.recv_message()
                assert second is not None
                chain2 = chain.replace(b"TEVBRg==", b"TkVX")
                assert pair(secret(second)) == (chain2, b"KEY-2")
                await stream.end()
                sds.update(CHAIN, b"KEY-1")
    finally:
        channel.close()


def test_leaf_pem_is_the_first_certificate() -> None:
    assert leaf_pem(CHAIN) == LEAF
    assert leaf_pem(LEAF) == LEAF
    assert leaf_pem(b"CHAIN-1") == b"CHAIN-1"  # not PEM: as it is
