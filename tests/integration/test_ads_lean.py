"""The lean ADS transport (xds.adsconn on listen.start_h2, as the control plane serves it) over
real mutual TLS, against hostile and broken clients: each gets a clear error, is counted
(``on_refused``) and is closed, while a well-behaved stream on another connection keeps being
served. Clients are raw HTTP/2 (h2's client, or hand-made frames)."""

from __future__ import annotations

import asyncio
import ssl
import struct
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.demo import free_port
from attestmesh.listen import ListenLimits, start_h2
from attestmesh.metrics import Metrics
from attestmesh.serve import ControlPlaneSettings, _load_server_cert, _xds_tls
from certs.ca import CertificateAuthority
from tests.component.test_ads_mtls import client_context
from tests.unit.xds.meshfixture import TD, TRUST, allow, attested, reg, two_workloads
from xds.adsconn import LeanAds
from xds.build import Packer, build_snapshots
from xds.cache import SnapshotCache
from xds.h2conn import PREFACE
from xds.resources import ADS_SERVICE, TypeUrl
from xds.server import AdsServer, PeerIdentity, warm
from xds.state import MeshState

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.config.core.v3 import Node
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
        DiscoveryRequest,
        DiscoveryResponse,
    )

SOTW = f"/{ADS_SERVICE}/StreamAggregatedResources"
DELTA = f"/{ADS_SERVICE}/DeltaAggregatedResources"


@dataclass
class Plane:
    port: int
    ca: CertificateAuthority
    tmp: Path
    cache: SnapshotCache
    metrics: Metrics
    refused: list[str] = field(default_factory=list)
    allowed: set[str] = field(default_factory=lambda: {"frontend", "backend"})

    def ctx(self, sa: str | None = "frontend") -> ssl.SSLContext:
        return client_context(self.ca, self.tmp, sa)


@asynccontextmanager
async def plane(tmp: Path, **limits: Any) -> AsyncIterator[Plane]:
    warm()
    ca = CertificateAuthority.load_or_create(tmp / "ca", TD, datetime.now(UTC))
    tls = _xds_tls(ca)
    _load_server_cert(
        [tls], ca, ControlPlaneSettings(state_dir=tmp, trust_domain=TD), datetime.now(UTC)
    )
    state = two_workloads()
    cache = SnapshotCache()
    cache.set_snapshots(
        build_snapshots(state, [allow("backend", "frontend")], TRUST, packer=Packer())
    )
    p = Plane(free_port(), ca, tmp, cache, Metrics())

    def authorize(node: str, peer: PeerIdentity) -> bool:
        return node in p.allowed and any(u.endswith(f"/sa/{node}") for u in peer.uris)

    lean = LeanAds(AdsServer(cache, p.metrics, authorize=authorize))
    await start_h2(
        lean, "127.0.0.1", p.port, ssl=tls, limits=ListenLimits(**limits),
        on_refused=lambda _name, reason: p.refused.append(str(reason)),
    )  # fmt: skip
    try:
        yield p
    finally:
        lean.close()
        await lean.wait_closed()


class Client(asyncio.Protocol):
    """A raw HTTP/2 client: h2 for the well-formed parts, ``raw`` for the rest."""

    def __init__(self, **settings: int) -> None:
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.settings = settings
        self.transport: asyncio.Transport | None = None
        self.events: list[Any] = []
        self.raw_in = bytearray()
        self.changed = asyncio.Event()
        self.lost = asyncio.Event()
        self.h2_failed: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def start(self) -> None:
        self.conn.initiate_connection()
        if self.settings:
            self.conn.update_settings(
                {getattr(h2.settings.SettingCodes, k): v for k, v in self.settings.items()}
            )
        self.flush()

    def data_received(self, data: bytes) -> None:
        self.raw_in += data
        if self.h2_failed is None:
            try:
                self.events += self.conn.receive_data(data)
            except Exception as exc:
                self.h2_failed = exc
        self.changed.set()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set()
        self.changed.set()

    def flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def raw(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def call(self, path: str, *extra: tuple[bytes, bytes]) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(
            sid,
            [
                (b":method", b"POST"), (b":scheme", b"https"), (b":path", path.encode()),
                (b":authority", b"cp"), (b"content-type", b"application/grpc"),
                (b"te", b"trailers"), *extra,
            ],
        )  # fmt: skip
        self.flush()
        return sid

    def send(self, sid: int, message: bytes, end: bool = False) -> None:
        self.conn.send_data(
            sid, b"\x00" + struct.pack(">I", len(message)) + message, end_stream=end
        )
        self.flush()

    async def until(self, check: Any, within: float = 5.0) -> Any:
        async with asyncio.timeout(within):
            while True:
                got = check()
                if got:
                    return got
                self.changed.clear()
                await self.changed.wait()

    def messages(self, sid: int) -> list[bytes]:
        data = b"".join(
            e.data
            for e in self.events
            if isinstance(e, h2.events.DataReceived) and e.stream_id == sid
        )
        out, i = [], 0
        while i + 5 <= len(data):
            n = struct.unpack(">I", data[i + 1 : i + 5])[0]
            out.append(data[i + 5 : i + 5 + n])
            i += 5 + n
        return out

    def status(self, sid: int) -> dict[bytes, bytes] | None:
        for e in self.events:
            if isinstance(e, h2.events.TrailersReceived) and e.stream_id == sid:
                return dict(e.headers)
            if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid:
                headers = dict(e.headers)
                if b"grpc-status" in headers:
                    return headers
        return None

    def raw_frames(self) -> list[tuple[int, int, bytes]]:
        """(type, stream, payload) of every frame received (h2 may have stopped parsing)."""
        out, i, data = [], 0, bytes(self.raw_in)
        while i + 9 <= len(data):
            n = data[i] << 16 | data[i + 1] << 8 | data[i + 2]
            if i + 9 + n > len(data):
                break
            sid = struct.unpack(">I", data[i + 5 : i + 9])[0]
            out.append((data[i + 3], sid, data[i + 9 : i + 9 + n]))
            i += 9 + n
        return out

    def goaway(self) -> int | None:
        for kind, _, payload in self.raw_frames():
            if kind == 7:
                return int(struct.unpack(">I", payload[4:8])[0])
        return None


async def connect(
    p: Plane, sa: str | None = "frontend", start: bool = True, **settings: int
) -> Client:
    client = Client(**settings)
    loop = asyncio.get_running_loop()
    await loop.create_connection(
        lambda: client, "127.0.0.1", p.port, ssl=p.ctx(sa), server_hostname="localhost"
    )
    if start:
        client.start()
    return client


def sotw(
    node: str | None = "frontend", type_url: TypeUrl = TypeUrl.CLUSTER, nonce: str = ""
) -> bytes:
    return bytes(
        DiscoveryRequest(
            type_url=type_url, node=Node(id=node) if node else None, response_nonce=nonce
        )
    )


async def healthy_stream(p: Plane) -> tuple[Client, int]:
    """A well-behaved SotW stream that has its first CDS response."""
    c = await connect(p)
    sid = c.call(SOTW)
    c.send(sid, sotw())
    await c.until(lambda: c.messages(sid))
    return c, sid


async def still_served(c: Client, sid: int) -> None:
    """The healthy stream answers a new subscription after the hostile one was dealt with."""
    before = len(c.messages(sid))
    c.send(sid, bytes(DiscoveryRequest(type_url=TypeUrl.LISTENER)))
    await c.until(lambda: len(c.messages(sid)) > before)


async def test_a_stream_is_served_and_acks_wake_nothing(tmp_path: Path) -> None:
    async with plane(tmp_path) as p:
        c, sid = await healthy_stream(p)
        resp = DiscoveryResponse.parse(c.messages(sid)[0])
        assert resp.type_url == TypeUrl.CLUSTER and resp.resources
        c.send(sid, sotw(None, nonce=resp.nonce) + b"")  # the ACK
        await asyncio.sleep(0.2)
        assert len(c.messages(sid)) == 1
        assert p.metrics.xds_streams._value.get() == 1  # type: ignore[attr-defined]
        c.conn.end_stream(sid)
        c.flush()
        status = await c.until(lambda: c.status(sid))
        assert status[b"grpc-status"] == b"0"
        await asyncio.sleep(0.1)
        assert p.metrics.xds_streams._value.get() == 0  # type: ignore[attr-defined]


async def test_delta_stream_over_the_lean_transport(tmp_path: Path) -> None:
    async with plane(tmp_path) as p:
        c = await connect(p)
        sid = c.call(DELTA)
        c.send(
            sid, bytes(DeltaDiscoveryRequest(type_url=TypeUrl.CLUSTER, node=Node(id="frontend")))
        )
        await c.until(lambda: c.messages(sid))
        resp = DeltaDiscoveryResponse.parse(c.messages(sid)[0])
        assert resp.type_url == TypeUrl.CLUSTER and resp.resources and resp.nonce


async def test_a_foreign_node_is_permission_denied_and_the_connection_closed(
    tmp_path: Path,
) -> None:
    async with plane(tmp_path) as p:
        c = await connect(p, sa="frontend")
        sid = c.call(SOTW)
        c.send(sid, sotw("backend"))
        status = await c.until(lambda: c.status(sid))
        assert status[b"grpc-status"] == b"7"
        assert b"does not identify node" in status[b"grpc-message"]
        await asyncio.wait_for(c.lost.wait(), 3)


async def test_a_revoked_stream_gets_its_final_configuration_then_permission_denied(
    tmp_path: Path,
) -> None:
    async with plane(tmp_path) as p:
        c, sid = await healthy_stream(p)
        cds = DiscoveryResponse.parse(c.messages(sid)[0])
        c.send(sid, sotw(None, nonce=cds.nonce))  # the ACK (SotW answers an open request only)
        c.send(sid, bytes(DiscoveryRequest(type_url=TypeUrl.LISTENER)))
        await c.until(lambda: len(c.messages(sid)) == 2)
        lds = DiscoveryResponse.parse(c.messages(sid)[1])
        assert lds.type_url == TypeUrl.LISTENER
        c.send(sid, bytes(DiscoveryRequest(type_url=TypeUrl.LISTENER, response_nonce=lds.nonce)))
        await asyncio.sleep(0.1)
        before = len(c.messages(sid))
        p.allowed.discard("frontend")  # e.g. its certificate was revoked by a quarantine
        # its configuration changes as the revocation lands (here: it may call nothing more)
        state = attested(
            attested(MeshState(TD), reg("frontend", 15001), 1), reg("backend", 15002), 2
        )
        built = build_snapshots(state, [], TRUST, packer=Packer())
        p.cache.set_snapshot("frontend", built["frontend"])
        status = await c.until(lambda: c.status(sid))
        assert status[b"grpc-status"] == b"7"
        assert b"no longer identifies" in status[b"grpc-message"]
        # that configuration went out once, before the status: an honest Envoy applies it
        final = [DiscoveryResponse.parse(m) for m in c.messages(sid)[before:]]
        (clusters,) = [r for r in final if r.type_url == TypeUrl.CLUSTER]
        assert len(clusters.resources) < len(cds.resources)


async def test_missing_node_undecodable_request_and_unknown_method(tmp_path: Path) -> None:
    async with plane(tmp_path) as p:
        c = await connect(p)
        a = c.call(SOTW)
        c.send(a, sotw(None))
        b = c.call(DELTA)
        c.send(b, b"\x0a\xff\xff")  # a length-delimited field longer than the message
        d = c.call(f"/{ADS_SERVICE}/Nope")
        await c.until(lambda: all(c.status(s) for s in (a, b, d)))
        assert c.status(a)[b"grpc-status"] == b"3"  # type: ignore[index]
        assert c.status(b)[b"grpc-status"] == b"3"  # type: ignore[index]
        assert c.status(d)[b"grpc-status"] == b"12"  # type: ignore[index]
        assert p.refused.count("invalid_request") == 1
        c2, sid2 = await healthy_stream(p)  # the connection and the server serve on
        await still_served(c2, sid2)


async def test_grpc_timeout_is_honoured(tmp_path: Path) -> None:
    async with plane(tmp_path) as p:
        c = await connect(p)
        sid = c.call(SOTW, (b"grpc-timeout", b"300m"))
        c.send(sid, sotw())
        await c.until(lambda: c.messages(sid))
        status = await c.until(lambda: c.status(sid), within=3)
        assert status[b"grpc-status"] == b"4"


@pytest.mark.parametrize(
    ("name", "payload", "code", "reason"),
    [
        ("bad preface", b"GET / HTTP/1.1\r\nHost: cp\r\n\r\n", 1, "protocol_error"),
        (
            "oversized frame",
            PREFACE
            + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            + b"\x01\x00\x00\x00\x00\x00\x00\x00\x01",
            6,
            "protocol_error",
        ),
        (
            "header flood",
            PREFACE
            + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            + b"".join(
                [b"\x00\x10\x00\x01\x00\x00\x00\x00\x01" + b"\x00" * 4096]
                + [b"\x00\x10\x00\x09\x00\x00\x00\x00\x01" + b"\x00" * 4096] * 8
            ),
            11,
            "flood",
        ),
        (
            "ping flood",
            PREFACE
            + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            + (b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"p" * 8) * 2000,
            11,
            "flood",
        ),
        (
            "window overflow",
            PREFACE
            + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            + b"\x00\x00\x04\x08\x00\x00\x00\x00\x00\x7f\xff\xff\xff",
            3,
            "protocol_error",
        ),
    ],
)
async def test_hostile_connections_get_goaway_are_counted_and_closed(
    tmp_path: Path, name: str, payload: bytes, code: int, reason: str
) -> None:
    async with plane(tmp_path) as p:
        good, sid = await healthy_stream(p)
        bad = await connect(p, start=False)
        bad.h2_failed = RuntimeError("raw client")  # parse what comes back by hand
        bad.raw(payload)
        await asyncio.wait_for(bad.lost.wait(), 5)
        assert bad.goaway() == code, name
        assert p.refused == [reason], name
        await still_served(good, sid)


async def test_a_stream_left_silent_is_ended_and_counted(tmp_path: Path) -> None:
    async with plane(tmp_path, header_timeout=0.3) as p:
        c = await connect(p)
        sid = c.call(SOTW)  # and never a request
        status = await c.until(lambda: c.status(sid))
        assert status[b"grpc-status"] == b"4"
        assert p.refused == ["header_timeout"]


async def test_a_connection_with_no_stream_is_closed_by_the_idle_timeout(tmp_path: Path) -> None:
    async with plane(tmp_path, idle_timeout=0.5) as p:
        c = await connect(p)
        await asyncio.wait_for(c.lost.wait(), 3)
        assert p.refused == ["idle_timeout"]


async def test_a_zero_window_is_honoured_and_blocks_only_that_stream(tmp_path: Path) -> None:
    async with plane(tmp_path) as p:
        good, good_sid = await healthy_stream(p)
        c = await connect(p, INITIAL_WINDOW_SIZE=0)
        await c.until(lambda: any(isinstance(e, h2.events.SettingsAcknowledged) for e in c.events))
        sid = c.call(SOTW)
        c.send(sid, sotw())
        await asyncio.sleep(0.3)
        assert not c.messages(sid), "nothing beyond the peer's window"
        assert any(isinstance(e, h2.events.ResponseReceived) for e in c.events)
        await still_served(good, good_sid)
        c.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        c.flush()
        await c.until(lambda: c.messages(sid))
        assert DiscoveryResponse.parse(c.messages(sid)[0]).resources


async def test_streams_beyond_the_limit_are_refused(tmp_path: Path) -> None:
    async with plane(tmp_path, max_streams_per_connection=1) as p:
        c = await connect(p)
        await c.until(lambda: c.conn.remote_settings.max_concurrent_streams == 1)
        first = c.call(SOTW)
        c.send(first, sotw())
        await c.until(lambda: c.messages(first))
        # h2 would not open a second stream: send its HEADERS by hand (literals only, so the
        # server's HPACK table stays in step with h2's encoder)
        block = b"\x83" + b"\x04" + bytes([len(SOTW)]) + SOTW.encode()  # POST; :path literal
        c.raw(b"\x00" + struct.pack(">H", len(block)) + b"\x01\x04" + struct.pack(">I", 3) + block)
        refused = (3, 3, struct.pack(">I", 7))  # RST_STREAM(REFUSED_STREAM) on stream 3
        await c.until(lambda: refused in c.raw_frames())
        assert p.refused == []  # a refused stream is not an attack by itself


async def test_a_stalled_tls_handshake_is_closed_and_counted(tmp_path: Path) -> None:
    async with plane(tmp_path, handshake_timeout=0.5) as p:
        good, sid = await healthy_stream(p)
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello's start
        async with asyncio.timeout(3):
            assert await reader.read() == b""  # closed by the server
        writer.close()
        assert p.refused == ["handshake_timeout"]
        await still_served(good, sid)


async def test_unknown_methods_are_answered_briefly_and_a_burst_of_them_is_a_flood(
    tmp_path: Path,
) -> None:
    """A 3 KB :path costs the client one byte of HPACK per stream once indexed; the answer
    must not repeat it (it did: ~3 KB of grpc-message per 13-byte HEADERS frame), and streams
    opened only to be refused are budgeted like other control frames."""
    async with plane(tmp_path) as p:
        good, good_sid = await healthy_stream(p)
        c = await connect(p)
        long = f"/{ADS_SERVICE}/" + "x" * 3000
        one = c.call(long)
        status = await c.until(lambda: c.status(one))
        assert status[b"grpc-status"] == b"12"
        assert len(status[b"grpc-message"]) < 200, len(status[b"grpc-message"])

        bad = await connect(p, start=False)
        bad.h2_failed = RuntimeError("raw client")
        enc = hpack.Encoder()
        fields = [
            (":method", "POST"), (":scheme", "https"), (":path", long), (":authority", "cp"),
            ("content-type", "application/grpc"),
        ]  # fmt: skip
        burst = b"".join(
            struct.pack(">I", len(block := enc.encode(fields)))[1:]
            + b"\x01\x05"  # HEADERS, END_STREAM | END_HEADERS
            + struct.pack(">I", sid)
            + block
            for sid in range(1, 6000, 2)
        )
        bad.raw(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + burst)
        await asyncio.wait_for(bad.lost.wait(), 10)
        assert bad.goaway() == 11
        assert p.refused == ["flood"]
        assert len(bad.raw_in) < 400_000, len(bad.raw_in)  # before: ~9 MB for 3,000 streams
        await still_served(good, good_sid)


async def test_a_request_left_incomplete_is_closed_by_the_body_timeout(tmp_path: Path) -> None:
    """A stream that starts a request and never finishes it held its bytes (up to a message,
    4 MiB) for as long as the connection lived; now the listener's body timeout ends it."""
    async with plane(tmp_path, body_timeout=0.5) as p:
        good, good_sid = await healthy_stream(p)
        c = await connect(p)
        sid = c.call(SOTW)
        c.send(sid, sotw())
        await c.until(lambda: c.messages(sid))  # a live ADS stream (BUSY: no timeout)
        c.conn.send_data(sid, b"\x00" + struct.pack(">I", 1000) + b"x" * 10)  # and then stalls
        c.flush()
        await asyncio.wait_for(c.lost.wait(), 3)
        assert p.refused == ["body_timeout"]
        await asyncio.sleep(0.7)  # the healthy stream, its requests complete, is left alone
        await still_served(good, good_sid)
        assert p.refused == ["body_timeout"]


async def test_after_a_foreign_node_no_new_stream_is_served_and_nothing_is_echoed_at_length(
    tmp_path: Path,
) -> None:
    """The refused node id is the client's: its answer repeats at most 96 characters of it, and
    the connection closes (a moment later: no GOAWAY first, which made Envoy's reconnect
    backoff grow while its workload was quarantined; tests/integration/test_restart)."""
    async with plane(tmp_path) as p:
        c = await connect(p, sa="frontend")
        sid = c.call(SOTW)
        c.send(sid, sotw("backend" + "\x00" * 5000))
        status = await c.until(lambda: c.status(sid))
        assert status[b"grpc-status"] == b"7"
        assert len(status[b"grpc-message"]) < 500, len(status[b"grpc-message"])  # was ~20 KB
        await asyncio.wait_for(c.lost.wait(), 3)
