"""The Nitro bridges' cost: throughput and connection round trip through the parent + enclave
bridge pair (TCP -> Bridge -> vsock-shaped Unix socket -> Bridge -> TCP, the shape of every
enclave connection) and through one bridge, against a direct loopback TCP connection measured
in the same run. Medians of ``--runs`` repetitions; ratios against the direct connection.

Run: python -m benchmarks.bench_nitro_bridge [--mib 64] [--runs 5] [--rtts 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

from sidecar.nitro.bridge import (
    PARENT_CID,
    PORT_ANY,
    Bridge,
    UnixTransport,
    dial_tcp,
    dial_vsock,
    listen_tcp,
    listen_vsock,
)

CHUNK = 256 * 1024


async def _sink(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Reads everything, answers with the byte count; or echoes one line per line."""
    first = await r.readline()
    if first == b"bulk\n":
        n = 0
        while chunk := await r.read(CHUNK):
            n += len(chunk)
        w.write(f"{n}\n".encode())
    else:
        line = first
        while line:
            w.write(line)
            await w.drain()
            line = await r.readline()
    w.close()


@contextlib.asynccontextmanager
async def paths() -> AsyncIterator[dict[str, int]]:
    """TCP ports of: the destination itself, one bridge in front of it, the bridge pair."""
    directory = Path(tempfile.mkdtemp(prefix="amb-", dir="/tmp"))
    dest = await asyncio.start_server(_sink, "127.0.0.1", 0)
    dest_port = dest.sockets[0].getsockname()[1]
    one = Bridge("one", dial_tcp("127.0.0.1", dest_port))
    one_server = await listen_tcp("127.0.0.1", 0, one)
    # parent side: vsock (Unix) -> destination; enclave side: loopback TCP -> parent's vsock
    parent = Bridge("api", dial_tcp("127.0.0.1", dest_port))
    parent_server, vport = await listen_vsock(
        UnixTransport(directory, PARENT_CID), PORT_ANY, parent
    )
    enclave = Bridge("api", dial_vsock(UnixTransport(directory, 16), PARENT_CID, vport))
    enclave_server = await listen_tcp("127.0.0.1", 0, enclave)
    try:
        yield {
            "direct": dest_port,
            "one bridge": one_server.sockets[0].getsockname()[1],
            "enclave pair": enclave_server.sockets[0].getsockname()[1],
        }
    finally:
        for s in (dest, one_server, parent_server, enclave_server):
            s.close()
        for b in (one, parent, enclave):
            await b.close()
        shutil.rmtree(directory, ignore_errors=True)


async def bulk(port: int, total: int) -> float:
    """MiB/s of ``total`` bytes sent through ``port`` (until the sink counted them all)."""
    payload = b"\x5a" * CHUNK
    start = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"bulk\n")
    sent = 0
    while sent < total:
        w.write(payload)
        sent += len(payload)
        await w.drain()
    w.write_eof()
    count = int((await r.readline()).strip())
    elapsed = time.perf_counter() - start
    w.close()
    assert count == sent, (count, sent)
    return sent / (1024 * 1024) / elapsed


async def connect_rtt(port: int, n: int) -> float:
    """Median microseconds to connect and get one line back (a new connection each time)."""
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"ping\n")
        assert await r.readline() == b"ping\n"
        samples.append((time.perf_counter() - start) * 1e6)
        w.close()
    return statistics.median(samples)


async def main(mib: int, runs: int, rtts: int) -> None:
    async with paths() as ports:
        rates: dict[str, list[float]] = {k: [] for k in ports}
        rtt: dict[str, list[float]] = {k: [] for k in ports}
        for _ in range(runs):
            for name, port in ports.items():  # interleaved: load changes hit all alike
                rates[name].append(await bulk(port, mib * 1024 * 1024))
                rtt[name].append(await connect_rtt(port, rtts // runs or 1))
    base_rate = statistics.median(rates["direct"])
    base_rtt = statistics.median(rtt["direct"])
    print(f"{mib} MiB per transfer, {runs} runs, {rtts} new connections (medians)")
    print(f"{'path':<14} {'MiB/s':>8} {'vs direct':>10} {'connect+rtt us':>15} {'vs direct':>10}")
    for name in ports:
        rate, us = statistics.median(rates[name]), statistics.median(rtt[name])
        print(f"{name:<14} {rate:8.0f} {rate / base_rate:10.2f} {us:15.0f} {us / base_rtt:10.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rtts", type=int, default=200)
    a = p.parse_args()
    asyncio.run(main(a.mib, a.runs, a.rtts))
