"""The floor under a fan-out's CPU: what one process spends to send a few KB over TLS to each
of N connections on loopback and read a short answer back from each, with no HTTP/2, gRPC or
xDS. It is the lower bound bench_scale prints beside "one quarantine: control-plane CPU" (every
caller stream must at least be written to once and its ACK read once) and beside the time to
the last caller's ACK (one thread does it all).

A server process (``server`` role) accepts ``n`` mTLS connections from a client process
(``client`` role), then per round writes ``payload`` bytes to every connection (one
``SSLSocket.write`` each, one TLS record, one system call) and waits on epoll until every
connection has sent back ``ack`` bytes (the client answers each payload with one write). Its
own CPU (user + system, ``getrusage``) and the wall time per round are the figures; the median
of ``rounds`` is reported. The certificates are made by trustme (P-256, as the mesh's).

Measured here (2 cores, loaded): 10,000 connections 0.35-0.45 s; 2,000 connections
0.06 s; 500-byte and 2,500-byte payloads cost the same within noise (system calls and the
loopback TCP path, which the sender's system call pays for, dominate, not bytes)."""

from __future__ import annotations

import json
import resource
import selectors
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import trustme

from benchmarks.scale_ads import raise_nofile


def _ready_reads(sel: selectors.BaseSelector) -> Iterator[tuple[ssl.SSLSocket, bytes]]:
    """(connection, what it had) for the readable connections (b"": closed or failed)."""
    for key, _mask in sel.select():
        tls: ssl.SSLSocket = key.fileobj  # type: ignore[assignment]
        try:
            yield tls, tls.read(65_536)
        except ssl.SSLWantReadError:
            continue
        except (ssl.SSLError, OSError):
            yield tls, b""


def process_cpu() -> float:
    """This process's CPU so far (user + system), seconds."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def push_floor(
    n: int, payload: int = 2048, ack: int = 200, rounds: int = 5, timeout: float = 300.0
) -> tuple[float, float]:
    """(median CPU s, median wall s) of one round at ``n`` connections, measured in a fresh
    server process (this one only starts it and reads its answer)."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.scale_floor", "server"]
        + [str(x) for x in (n, payload, ack, rounds)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return float(got["cpu_s"]), float(got["wall_s"])


def _server(n: int, payload: int, ack: int, rounds: int) -> None:
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="scale-floor-") as tmp:
        d = Path(tmp)
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(d / "ca.pem"))
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(str(d / "s.pem"))
        ca.issue_cert("client.local").private_key_and_cert_chain_pem.write_to_path(str(d / "c.pem"))
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(d / "ca.pem"))
        ctx.load_cert_chain(str(d / "s.pem"))
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.set_alpn_protocols(["h2"])
        ctx.num_tickets = 0
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        port = listener.getsockname()[1]
        client = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.scale_floor", "client"]
            + [str(x) for x in (n, payload, ack, port, d)],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )
        assert client.stdout is not None
        conns: list[ssl.SSLSocket] = []
        try:
            for _ in range(n):
                raw, _addr = listener.accept()
                tls = ctx.wrap_socket(raw, server_side=True)
                tls.setblocking(False)
                conns.append(tls)
            if not client.stdout.readline().startswith(b"ready"):
                raise RuntimeError("the floor's client did not connect")
            sel = selectors.DefaultSelector()
            for tls in conns:
                sel.register(tls, selectors.EVENT_READ)
            data = b"p" * payload
            cpus: list[float] = []
            walls: list[float] = []
            for _ in range(rounds):
                time.sleep(0.3)
                got = dict.fromkeys(conns, 0)
                c0, t0 = process_cpu(), time.perf_counter()
                for tls in conns:
                    tls.write(data)
                left = n
                while left:
                    for tls, chunk in _ready_reads(sel):
                        if not chunk:
                            raise RuntimeError("a floor connection closed mid-round")
                        before = got[tls]
                        got[tls] = before + len(chunk)
                        if before < ack <= before + len(chunk):
                            left -= 1
                cpus.append(process_cpu() - c0)
                walls.append(time.perf_counter() - t0)
            cpu, wall = statistics.median(cpus), statistics.median(walls)
            print(json.dumps({"cpu_s": cpu, "wall_s": wall}))
        finally:
            for tls in conns:
                tls.close()
            client.wait(timeout=60)


def _client(n: int, payload: int, ack: int, port: int, certs: Path) -> None:
    raise_nofile()
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.load_cert_chain(str(certs / "c.pem"))
    ctx.set_alpn_protocols(["h2"])
    sel = selectors.DefaultSelector()
    held: dict[ssl.SSLSocket, int] = {}
    for _ in range(n):
        tls = ctx.wrap_socket(
            socket.create_connection(("127.0.0.1", port)), server_hostname="localhost"
        )
        tls.setblocking(False)
        held[tls] = 0
        sel.register(tls, selectors.EVENT_READ)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    answer = b"a" * ack
    while held:
        for tls, chunk in _ready_reads(sel):
            if not chunk:  # the server closed: this connection is done
                sel.unregister(tls)
                del held[tls]
                tls.close()
                continue
            have = held[tls] + len(chunk)
            if have >= payload:
                have -= payload
                tls.setblocking(True)
                tls.sendall(answer)
                tls.setblocking(False)
            held[tls] = have


if __name__ == "__main__":
    role, args = sys.argv[1], [int(x) for x in sys.argv[2:6]]
    if role == "server":
        _server(*args)
    else:
        _client(args[0], args[1], args[2], args[3], Path(sys.argv[6]))
