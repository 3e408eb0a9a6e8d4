"""``_SocketTLS``: what the application writes while the read that completed the handshake is
handled (an HTTP/2 server's SETTINGS from ``connection_made``) goes out with the push that
read woke (a callback it queued: ``xds.adsconn``'s pushes), in one TLS write, not two."""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

import pytest
import trustme

from attestmesh import listen
from tests.component.test_listen_socket_tls import LIMITS, Blob, Service, served


class _Counted:
    """The server's TLS connection, its writes counted."""

    def __init__(self, tls: Any, writes: list[bytes]) -> None:
        self._tls = tls
        self._writes = writes

    def write(self, data: bytes) -> int:
        self._writes.append(bytes(data))
        return int(self._tls.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tls, name)


class _Pushing(Blob):
    """Writes its SETTINGS when connected; a request wakes a push, which runs in a callback
    of its own (not in the read)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        self.transport.write(b"SETTINGS;")

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None
        asyncio.get_running_loop().call_soon(transport.write, b"PUSH;")


def _client(port: int, ca: trustme.CA) -> bytes:
    """The client's last handshake flight and its first request leave in one segment (TLS
    over memory BIOs), so the server reads both in one readiness callback, as at a loaded
    control plane, whatever the scheduling of this thread."""
    ctx = ssl.create_default_context()
    ca.configure_trust(ctx)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:

        def more() -> bool:
            data = raw.recv(65536)
            incoming.write(data)
            return bool(data)

        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                raw.sendall(outgoing.read())
                if not more():
                    return got
        tls.write(b"request")  # after the Finished, in the same send
        raw.sendall(outgoing.read())
        while got.count(b";") < 2:
            try:
                chunk = tls.read(4096)
            except ssl.SSLWantReadError:
                if not more():
                    break
                continue
            if not chunk:
                break
            got += chunk
    return got


async def test_settings_go_out_with_the_first_push(monkeypatch: pytest.MonkeyPatch) -> None:
    ca = trustme.CA()
    writes: list[bytes] = []
    real = listen._server_connection
    monkeypatch.setattr(
        listen, "_server_connection", lambda ctx, sock: _Counted(real(ctx, sock), writes)
    )
    async with served(ca, LIMITS, Service(_Pushing)) as (_service, lst, _seen):
        got = await asyncio.to_thread(_client, lst.port, ca)
        assert got == b"SETTINGS;PUSH;"
        assert writes == [b"SETTINGS;PUSH;"]
