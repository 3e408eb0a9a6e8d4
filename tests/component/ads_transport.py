"""Run the ADS component tests on both transports: the lean one the control plane serves
(``xds.adsconn``, over real TCP, optionally mTLS) and the grpclib fallback. A module sets
``TRANSPORT.name`` from a parametrized autouse fixture; the tests' clients are grpclib's."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from grpclib.client import Channel
from grpclib.server import Server
from grpclib.testing import ChannelFor

from attestmesh.demo import free_port
from xds.adsconn import LeanAds
from xds.server import AdsServer

TRANSPORTS = ("lean", "grpclib")


class _Transport:
    name = "lean"


TRANSPORT = _Transport()


@asynccontextmanager
async def ads_channel(ads: AdsServer) -> AsyncIterator[Channel]:
    """A grpclib client channel to ``ads`` served on the current transport."""
    if TRANSPORT.name == "grpclib":
        async with ChannelFor([ads]) as channel:
            yield channel
        return
    async with serve_ads(ads) as port:
        channel = Channel("127.0.0.1", port)
        try:
            yield channel
        finally:
            channel.close()


@asynccontextmanager
async def serve_ads(ads: AdsServer, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serve ``ads`` on a fresh local port on the current transport; yields the port."""
    port = free_port()
    if TRANSPORT.name == "grpclib":
        server = Server([ads])
        await server.start("127.0.0.1", port, ssl=tls)
        try:
            yield port
        finally:
            server.close()
            await server.wait_closed()
        return
    from attestmesh.listen import ListenLimits, start_h2

    lean = LeanAds(ads)
    if tls is None:
        await lean.start("127.0.0.1", port)
    else:
        await start_h2(lean, "127.0.0.1", port, ssl=tls, limits=ListenLimits())
    try:
        yield port
    finally:
        lean.close()
        await lean.wait_closed()
