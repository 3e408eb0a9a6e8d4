"""Memory per connection and per mTLS ADS stream, CPU per new mTLS stream, measured on a real
``attestmesh controlplane`` process (VmRSS and utime+stime from /proc/<pid>).

Hostile kinds (no credentials): plain TCP to xDS (no byte), a TLS handshake started with a
real ClientHello and stalled, a partial HTTP header, a dripped body, a silent TLS connection
after the handshake. Legitimate: idle mTLS ADS streams, one per connection, each opened with
the certificate of a workload that attested through the API, sent one DiscoveryRequest and
given its first response. Each kind runs in a fresh control plane process.

Run: python -m benchmarks.bench_connections [--hostile N] [--streams N] [--kinds k1,k2]
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.sslproto
import contextlib
import gc
import os
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import h2.config
import h2.connection
import h2.events
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.demo import NAMES, free_port, join_token, write_config
from attestmesh.serve import ControlPlaneSettings
from benchmarks.scale_ads import handshake_floor_ms, xds_server_context
from sidecar.agent import Agent, AgentCertificate, SimEvidenceSource, client_ssl_context

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import DiscoveryRequest

GOOD = bytes.fromhex("a1" * 48)  # the measurement demo's policy admits
ADS_PATH = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"
CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
HOSTILE_KINDS = ("tcp_xds", "tls_stalled", "partial_header", "dripped_body", "idle_tls")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def lean_client_tls_buffers() -> None:
    """This process is the client of thousands of TLS connections: give each the 16 KiB read
    buffer instead of asyncio's 256 KiB (allocating 2,000 x 256 KiB is what slows opening them
    down). Client side only: the control plane runs in its own process."""
    asyncio.sslproto.SSLProtocol.max_size = 16 * 1024


def raise_fd_limit(want: int) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


@dataclass
class ControlPlaneProcess:
    root: Path
    flags: Sequence[str] = ()
    settings: ControlPlaneSettings | None = None
    proc: subprocess.Popen[bytes] | None = None
    platform: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1())
    )
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def s(self) -> ControlPlaneSettings:
        assert self.settings is not None
        return self.settings

    async def start(self) -> None:
        pub = self.root / "sim.pub.pem"
        pub.write_bytes(
            self.platform.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        ports = {n: {k: free_port() for k in ("inbound", "app", "outbound")} for n in NAMES}
        self.tokens = {n: join_token(n) for n in NAMES}
        s = self.settings = write_config(self.root, ports, pub, self.tokens)
        args = [
            sys.executable, "-m", "attestmesh.cli", "controlplane",
            "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
            "--mesh-policy", str(s.mesh_policy_file), "--workloads", str(s.registrations_file),
            "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
            "--ops-port", str(s.ops_port), "--sim-platform-key", str(s.sim_platform_keys[0]),
            *self.flags,
        ]  # fmt: skip
        self.proc = self._spawn(args)
        async with asyncio.timeout(60), aiohttp.ClientSession() as session:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError((self.root / "controlplane.log").read_text())
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(f"http://127.0.0.1:{s.ops_port}/healthz") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(0.05)

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / "controlplane.log").open("ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def bundle(self) -> bytes:
        return (self.s.state_dir / "ca" / "root.pem").read_bytes()

    async def attest(self, name: str = "frontend", source: str = "127.0.0.1") -> AgentCertificate:
        """One attestation through the real API (sim TEE), as the agent does it."""

        class Sink:
            def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
                pass

        token = self.tokens[name]
        agent = Agent(
            url=f"https://127.0.0.1:{self.s.api_port}",
            workload=name,
            source=SimEvidenceSource(self.platform, GOOD),
            sink=Sink(),
            ssl_context=client_ssl_context(self.bundle()),
            token=lambda: token,
        )
        conn = aiohttp.TCPConnector(local_addr=(source, 0))
        async with aiohttp.ClientSession(connector=conn) as session:
            return await agent.attest_once(session)


@contextlib.asynccontextmanager
async def control_plane(flags: Sequence[str] = ()) -> AsyncIterator[ControlPlaneProcess]:
    with tempfile.TemporaryDirectory(prefix="bench-conn-") as tmp:
        cp = ControlPlaneProcess(Path(tmp), flags)
        try:
            await cp.start()
            yield cp
        finally:
            cp.stop()


# -- hostile connections -------------------------------------------------------------------------


@dataclass
class Held:
    """One hostile connection; ``closed_at`` is when the server closed it (monotonic)."""

    writer: asyncio.StreamWriter
    opened_at: float
    closed_at: float | None = None
    task: asyncio.Task[None] | None = None


def client_hello(server_name: str = "localhost") -> bytes:
    """A real ClientHello (fresh random and key share), from a client that goes no further."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = _HELLO.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


def _insecure_client_tls() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


_HELLO = _insecure_client_tls()


async def _watch(held: Held, reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(OSError, ssl.SSLError):
        while await reader.read(4096):
            pass
    held.closed_at = time.monotonic()


async def _drip(held: Held, every_s: float) -> None:
    with contextlib.suppress(OSError, ssl.SSLError):
        while held.closed_at is None and not held.writer.is_closing():
            await asyncio.sleep(every_s)
            held.writer.write(b"x")


async def open_hostile(
    kind: str, cp: ControlPlaneProcess, n: int, sources: Sequence[str], concurrency: int = 200
) -> list[Held]:
    """``n`` hostile connections of ``kind`` from ``sources`` (round robin)."""
    s = cp.s
    port = s.xds_port if kind == "tcp_xds" else s.api_port
    tls = _insecure_client_tls() if kind in ("partial_header", "dripped_body", "idle_tls") else None
    held: list[Held] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            src = sources[i % len(sources)]
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=tls, server_hostname="localhost" if tls else None,
                local_addr=(src, 0),
            )  # fmt: skip
            h = Held(writer, time.monotonic())
            if kind == "tls_stalled":
                writer.write(client_hello())
            elif kind == "partial_header":
                writer.write(b"POST /v1/attest HTTP/1.1\r\nHost: localhost\r\nX-Partial: ")
            elif kind == "dripped_body":
                writer.write(
                    b"POST /v1/attest HTTP/1.1\r\nHost: localhost\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 65536\r\n\r\n{"
                )
                h.task = asyncio.create_task(_drip(h, 1.0))
            h_watch = asyncio.create_task(_watch(h, reader))
            h.task = h.task or h_watch
            held.append(h)

    await asyncio.gather(*(one(i) for i in range(n)))
    return held


async def close_all(held: Sequence[Held]) -> None:
    for h in held:
        if h.task is not None:
            h.task.cancel()
        h.writer.transport.abort()
    await asyncio.sleep(0.2)


async def settle_rss(pid: int, wait_s: float = 1.0) -> int:
    await asyncio.sleep(wait_s)
    return rss_kb(pid)


# -- idle mTLS ADS streams -------------------------------------------------------------------------


def _grpc_frame(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


class AdsStreams:
    """Blocking h2 clients (lean on the client side, so 10,000 fit in this process): one TLS
    connection and one StreamAggregatedResources stream each, held idle after the first
    response."""

    def __init__(self, port: int, cert: AgentCertificate, bundle: bytes, workdir: Path) -> None:
        (workdir / "ads.pem").write_bytes(cert.chain_pem)
        (workdir / "ads.key").write_bytes(cert.key_pem)
        ctx = ssl.create_default_context(cadata=bundle.decode())
        ctx.load_cert_chain(workdir / "ads.pem", workdir / "ads.key")
        ctx.set_alpn_protocols(["h2"])
        self.ctx = ctx
        self.port = port
        self.node = "frontend"
        self.held: list[ssl.SSLSocket] = []
        self.request = _grpc_frame(
            bytes(DiscoveryRequest(type_url=CLUSTER, node=Node(id=self.node)))
        )

    def open(self, n: int) -> None:
        for _ in range(n):
            self.held.append(self._one())

    def _one(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        sock = self.ctx.wrap_socket(raw, server_hostname="localhost")
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(
            1,
            [
                (":method", "POST"), (":scheme", "https"), (":path", ADS_PATH),
                (":authority", "localhost"), ("content-type", "application/grpc"),
                ("te", "trailers"),
            ],
        )  # fmt: skip
        conn.send_data(1, self.request)
        sock.sendall(conn.data_to_send())
        while True:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError("the control plane closed an ADS stream")
            events = conn.receive_data(data)
            out = conn.data_to_send()
            if out:
                sock.sendall(out)
            for ev in events:
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id == 1:
                    return sock
                if isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                    raise RuntimeError(f"ADS stream ended: {ev}")

    def close(self) -> None:
        for sock in self.held:
            with contextlib.suppress(OSError):
                sock.close()
        self.held.clear()


# -- measurements ----------------------------------------------------------------------------------

SOURCES = tuple(f"127.0.0.{i}" for i in range(2, 10))


async def measure_hostile(kind: str, n: int) -> tuple[float, float]:
    """(KB per connection, seconds of one legitimate attestation while they are held)."""
    async with control_plane() as cp:
        await cp.attest()  # warm: the first attestation loads what later ones reuse
        before = await settle_rss(cp.pid)
        held = await open_hostile(kind, cp, n, SOURCES)
        after = await settle_rss(cp.pid, 0.5)
        t0 = time.perf_counter()
        await cp.attest()
        took = time.perf_counter() - t0
        alive = sum(1 for h in held if h.closed_at is None)
        await close_all(held)
    if alive < n:
        print(f"  ({kind}: only {alive} of {n} still open at the measurement)", flush=True)
    return (after - before) * 1.024 / max(alive, 1), took


async def measure_streams(n: int, extra: Sequence[str] = ()) -> tuple[float, float, float]:
    """(KB per idle mTLS ADS stream, CPU ms per new stream, the TLS handshake's floor of that
    CPU in ms: ``scale_ads.handshake_floor_ms`` with the same certificates) at ``n`` streams."""
    flags = ["--max-connections", str(n + 100), "--max-connections-per-source", str(n + 100)]
    flags += ["--connect-burst-per-source", str(n + 100)]  # the n streams come from one source
    flags += extra
    async with control_plane(flags) as cp:
        cert = await cp.attest()
        streams = AdsStreams(cp.s.xds_port, cert, cp.bundle(), cp.root)
        await asyncio.to_thread(streams.open, 20)  # warm caches and the allocator
        before = await settle_rss(cp.pid)
        cpu0 = cpu_s(cp.pid)
        await asyncio.to_thread(streams.open, n)
        cpu1 = cpu_s(cp.pid)
        after = await settle_rss(cp.pid)
        streams.close()
        state = cp.s.state_dir
        server = xds_server_context(
            str(state / "ca" / "root.pem"), str(state / "tls" / "server.pem"),
            str(state / "tls" / "server.key"),
        )  # fmt: skip
        floor, _ = await asyncio.to_thread(handshake_floor_ms, server, streams.ctx)
    return (after - before) * 1.024 / n, (cpu1 - cpu0) * 1000 / n, floor


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--hostile", type=int, default=2000, help="connections per hostile kind")
    p.add_argument("--streams", type=int, default=1000, help="idle mTLS ADS streams")
    p.add_argument("--kinds", default=",".join(HOSTILE_KINDS))
    p.add_argument("--cp-args", default="", help="extra controlplane flags for the stream run")
    args = p.parse_args(argv)
    raise_fd_limit(2 * (args.hostile + args.streams) + 1000)
    lean_client_tls_buffers()

    async def run() -> None:
        print(f"{'what':<44}{'measured':>12}  target", flush=True)
        for kind in [k for k in args.kinds.split(",") if k]:
            kb, took = await measure_hostile(kind, args.hostile)
            print(f"{kind + ': KB per connection':<44}{kb:>12.1f}", flush=True)
            print(f"{'  attestation while held (s)':<44}{took:>12.3f}  <= 1", flush=True)
        if args.streams:
            kb, ms, floor = await measure_streams(args.streams, args.cp_args.split())
            n = args.streams
            print(f"{f'idle mTLS ADS stream: KB each (N={n})':<44}{kb:>12.1f}  <= 30", flush=True)
            print(f"{f'new mTLS ADS stream: CPU ms (N={n})':<44}{ms:>12.2f}  <= 2", flush=True)
            print(f"{'  of which the TLS handshake alone (floor)':<44}{floor:>12.2f}", flush=True)

    asyncio.run(run())
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
