"""An accepted socket's asyncio transport, which ``_Admission`` aborts once it has handed the
socket to ``_SocketTLS`` (or refused it), leaves no cyclic garbage: the control plane's GC
policy freezes what survives a tick, so such garbage stayed for good (~0.6 KB per stream)."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trustme

from attestmesh.listen import CloseReason, ListenLimits
from tests.component.test_listen_socket_tls import LIMITS, connect, served, until


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@contextmanager
def collector_off() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def garbage_transports(port: int) -> int:
    """Server-side socket transports (bound to ``port``) that only the collector could free."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [
            o
            for o in gc.garbage
            if isinstance(o, asyncio.Transport)
            and type(o).__name__ == "_SelectorSocketTransport"
            and (o.get_extra_info("sockname") or ("", 0))[1] == port
        ]
        return len(found)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


async def test_handed_over_transports_are_freed_by_reference_counting(ca: trustme.CA) -> None:
    async with served(ca) as (service, lst, _seen):
        with collector_off():
            gc.collect()
            writers = []
            try:
                for _ in range(5):
                    _reader, writer = await connect(ca, lst.port)
                    writers.append(writer)
                await until(lambda: len(service.conns) == 5)
                await asyncio.sleep(0.05)  # the callbacks queued by the handover have run
                assert garbage_transports(lst.port) == 0
                assert all(c.transport is not None for c in service.conns)  # still served
            finally:
                for writer in writers:
                    writer.close()


async def test_refused_transports_are_freed_by_reference_counting(ca: trustme.CA) -> None:
    limits = ListenLimits(
        write_timeout=LIMITS.write_timeout,
        idle_timeout=LIMITS.idle_timeout,
        body_timeout=LIMITS.body_timeout,
        header_timeout=LIMITS.header_timeout,
        max_connections=1,
    )
    async with served(ca, limits) as (_service, lst, seen):
        with collector_off():
            gc.collect()
            socks = [socket.create_connection(("127.0.0.1", lst.port)) for _ in range(4)]
            try:
                await until(lambda: seen.count(CloseReason.MAX_CONNECTIONS) == 3)
                await asyncio.sleep(0.05)
                assert garbage_transports(lst.port) == 0
            finally:
                for s in socks:
                    s.close()
