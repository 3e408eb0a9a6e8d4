"""``start_h2`` with TLS accepts its connections itself (``_Acceptor``): no asyncio accept path
(a Task, a future and a socket transport per connection, aborted at once), and an accepted or
refused connection leaves no cyclic garbage (the control plane's GC policy freezes what
survives a tick, so such garbage stayed for good: ~0.6 KB per stream). Out of descriptors, it
stops accepting for a while, then accepts again."""

from __future__ import annotations

import asyncio
import asyncio.selector_events
import errno
import gc
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import trustme

from attestmesh import listen
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


async def test_tls_connections_skip_asyncios_accept_path(
    ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop_class = asyncio.selector_events.BaseSelectorEventLoop
    calls: list[int] = []
    original = loop_class._accept_connection  # type: ignore[attr-defined]

    def spy(self: object, *args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(loop_class, "_accept_connection", spy)
    async with served(ca) as (service, lst, _seen):
        _reader, writer = await connect(ca, lst.port)
        try:
            await until(lambda: len(service.conns) == 1)
            writer.write(b"bye")
            await until(lambda: service.conns[0].lost)
            assert calls == []
        finally:
            writer.close()


class _Exhausted:
    """A listening socket whose first accept fails for want of descriptors."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.accepts = 0

    def fileno(self) -> int:
        return self.fd

    def listen(self, backlog: int) -> None:
        pass

    def accept(self) -> tuple[socket.socket, object]:
        self.accepts += 1
        if self.accepts == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        raise BlockingIOError


class _Open:
    sockets = (object(),)  # not closed


async def test_out_of_descriptors_it_pauses_accepting_then_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(listen, "_ACCEPT_RETRY_S", 0.2)
    loop = asyncio.get_running_loop()
    readable, peer = socket.socketpair()
    fake = _Exhausted(readable.fileno())
    lst = listen._Listener("t", ListenLimits(), None, asyncio.Protocol, listen._lean_h2_phase, None)
    listen._Acceptor(lst, _Open(), [fake])  # type: ignore[arg-type]
    try:
        peer.send(b"x")  # readable: as a pending connection makes a listening socket
        await until(lambda: fake.accepts >= 1)
        await asyncio.sleep(0.1)
        assert fake.accepts == 1  # paused: not called again while out of descriptors
        await until(lambda: fake.accepts >= 2)  # and accepting again after the delay
    finally:
        loop.remove_reader(readable.fileno())
        readable.close()
        peer.close()
