"""Explains part of bench_scale's server CPU per attestation: what one HTTPS request costs the
attestation API's process before any attestation work, against a lower bound measured in the
same run.

Two server processes answer the same requests with the same bytes over TLS on loopback, to the
same client (an aiohttp session, keep-alive, ``--concurrency`` requests in flight, in this
process), at two sizes: a challenge's (~20 bytes in, ~100 out) and an attestation's (~1.1 KB
in, ~5.5 KB out: evidence and CSR in, the chain and bundle out):

- ``aiohttp``: an aiohttp application served as the control plane serves its API
  (``attestmesh.listen.start_aiohttp``: TLS on the socket, the listener's limits), the handler
  reading the JSON body and returning ``web.json_response`` of a constant;
- ``floor``: a loop on ``selectors`` and ``SSLSocket`` that reads a request's head and body and
  writes the ready-made response in one TLS write: no HTTP framework, no event loop.

Each prints its own CPU (user + system) per request; the median of ``--rounds`` and the ratio
are reported. What the first costs beyond the second is what a leaner HTTP path could save per
request (an attestation takes one or two: the challenge and the attestation).

Run: ``python -m benchmarks.bench_http``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import selectors
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import trustme

from benchmarks.scale_floor import process_cpu


def answer_body(size: int) -> dict[str, str]:
    """A JSON answer of about ``size`` bytes (a challenge's is ~100, an attestation's ~5,500)."""
    body = {"nonce": "A" * 44, "expires_at": "2026-12-07T16:40:00.123456+00:00"}
    if size > 120:
        body["certificate_chain"] = "-----BEGIN CERTIFICATE-----\n" + "B" * (size - 150)
    return body


def response_bytes(body: dict[str, str]) -> bytes:
    payload = json.dumps(body).encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\nDate: Mon, 07 Dec 2026 "
        b"16:40:00 GMT\r\nServer: floor\r\n\r\n" + payload
    )


# -- the servers (each in a process of its own; a line on stdin asks for its CPU so far) --------


async def _aiohttp_server(cert: str, size: int) -> None:
    from aiohttp import web

    from attestmesh.listen import ListenLimits, start_aiohttp

    body = answer_body(size)

    async def challenge(request: web.Request) -> web.Response:
        await request.json()  # (as the API reads every body)
        return web.json_response(body)

    app = web.Application()
    app.router.add_post("/v1/challenge", challenge)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert)
    site = await start_aiohttp(runner, "127.0.0.1", 0, ssl=ctx, limits=ListenLimits(), name="api")
    print(site.port, flush=True)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while await reader.readline():
        print(process_cpu(), flush=True)
    await runner.cleanup()


def _floor_server(cert: str, size: int) -> None:
    response = response_bytes(answer_body(size))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, None)
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print(listener.getsockname()[1], flush=True)
    pending: dict[ssl.SSLSocket, bytearray] = {}
    while True:
        for key, _ in sel.select():
            if key.data == "stdin":
                if not sys.stdin.readline():
                    return
                print(process_cpu(), flush=True)
            elif key.data is None:
                conn, _ = listener.accept()
                tls = ctx.wrap_socket(conn, server_side=True)  # (blocking handshake: loopback)
                tls.setblocking(False)
                pending[tls] = bytearray()
                sel.register(tls, selectors.EVENT_READ, "conn")
            else:
                tls = key.fileobj  # type: ignore[assignment]
                try:
                    data = tls.recv(65_536)
                except ssl.SSLWantReadError:
                    continue
                if not data:
                    sel.unregister(tls)
                    tls.close()
                    del pending[tls]
                    continue
                buf = pending[tls]
                buf += data
                while (end := buf.find(b"\r\n\r\n")) >= 0:
                    head = bytes(buf[:end]).lower()
                    at = head.find(b"content-length:")
                    size = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
                    if len(buf) < end + 4 + size:
                        break
                    del buf[: end + 4 + size]
                    tls.sendall(response)


def _serve(role: str, cert: str, size: int) -> None:
    if role == "aiohttp":
        asyncio.run(_aiohttp_server(cert, size))
    else:
        _floor_server(cert, size)


# -- the client --------------------------------------------------------------------------------


class Server:
    def __init__(self, role: str, cert: str, size: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_http", "--serve", role, cert, str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def cpu(self) -> float:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()  # the server ends with its stdin
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


async def _load(
    port: int, ca: str, concurrency: int, seconds: float, request: int, size: int
) -> int:
    ctx = ssl.create_default_context(cafile=ca)
    url = f"https://localhost:{port}/v1/challenge"
    sent = {"workload": "w1", "evidence": "C" * max(0, request - 40)}
    want = answer_body(size)
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        end = time.monotonic() + seconds

        async def loop() -> None:
            nonlocal done
            while time.monotonic() < end:
                async with session.post(url, json=sent) as r:
                    got = await r.read()
                    if r.status != 200 or json.loads(got) != want:
                        raise RuntimeError(f"unexpected answer {r.status} {got[:80]!r}")
                done += 1

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return done


def write_certs(d: Path) -> None:
    """``ca.pem`` and ``server.pem`` (chain and key, for localhost) in ``d``: what ``measure``
    reads."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "server.pem"))


def measure(role: str, d: Path, args: argparse.Namespace, request: int, size: int) -> list[float]:
    server = Server(role, str(d / "server.pem"), size)
    ca = str(d / "ca.pem")
    try:
        asyncio.run(_load(server.port, ca, args.concurrency, 0.5, request, size))  # warm up
        per: list[float] = []
        for _ in range(args.rounds):
            cpu0 = server.cpu()
            n = asyncio.run(_load(server.port, ca, args.concurrency, args.seconds, request, size))
            per.append((server.cpu() - cpu0) / n * 1e6)
        return per
    finally:
        server.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--serve", nargs=3, metavar=("ROLE", "CERT", "SIZE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        role, cert, size = args.serve
        _serve(role, cert, int(size))
        return
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        d = Path(tmp)
        write_certs(d)
        # a challenge (small request, small answer), an attestation (~1.1 KB in, ~5.5 KB out)
        for name, request, size in (("challenge", 20, 100), ("attestation", 1_100, 5_500)):
            figures: dict[str, list[float]] = {}
            for role in ("floor", "aiohttp", "floor", "aiohttp"):  # interleaved
                figures.setdefault(role, []).extend(measure(role, d, args, request, size))
            floor = statistics.median(figures["floor"])
            ours = statistics.median(figures["aiohttp"])
            print(
                f"{name}-sized HTTPS request ({request} B in, {size} B out; {args.concurrency} "
                f"in flight, keep-alive, median of {len(figures['aiohttp'])} rounds): server CPU "
                f"{ours:.0f} us as the API serves it (aiohttp, JSON in and out); floor (one TLS "
                f"read and one TLS write, no HTTP) {floor:.0f} us; {ours / floor:.1f}x, "
                f"{ours - floor:.0f} us above the floor"
            )


if __name__ == "__main__":
    main()
