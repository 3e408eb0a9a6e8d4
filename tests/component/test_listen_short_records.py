"""_SocketTLS reads one short record per readiness callback (no failing read after it): many
short records sent in one burst, then the peer's close, all arrive, whole and in order, and
the close is seen."""

from __future__ import annotations

import asyncio
import socket
import ssl

import trustme

from tests.component.test_listen_socket_tls import LIMITS, Blob, Service, ca, served, until

__all__ = ["ca"]  # the fixture


class Recording(Blob):
    def __init__(self) -> None:
        super().__init__()
        self.got = bytearray()

    def data_received(self, data: bytes) -> None:
        self.got += data


def _burst(port: int, ca_: trustme.CA, records: list[bytes]) -> None:
    """Blocking client: one TLS record per ``write``, then close_notify and the TCP close."""
    ctx = ssl.create_default_context()
    ca_.configure_trust(ctx)
    with (
        socket.create_connection(("127.0.0.1", port)) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        for record in records:
            tls.write(record)
        tls.unwrap()


async def test_a_burst_of_short_records_and_the_close_all_arrive(ca: trustme.CA) -> None:
    async with served(ca, LIMITS, Service(Recording)) as (service, lst, _seen):
        records = [b"%03d:" % i + b"x" * (i % 40) for i in range(200)]
        await asyncio.to_thread(_burst, lst.port, ca, records)
        await until(lambda: bool(service.conns) and service.conns[0].lost)
        conn = service.conns[0]
        assert isinstance(conn, Recording)
        assert bytes(conn.got) == b"".join(records)
        assert lst.stats().open == 0
