"""A lean ADS client for bench_scale: many mTLS gRPC streams (HTTP/2 over TLS, one connection per
stream, as one Envoy holds one ADS connection), each ACKing what it is sent the way Envoy does.

Run as a worker process: ``python -m benchmarks.scale_ads`` reads one JSON command per line on
stdin and answers one JSON line per command on stdout (see ``Worker.handle``). Only the wire is
used: a hand-rolled protobuf codec for the few xDS fields a client needs (the subscription names
are found in the resources, as Envoy finds them: EDS names in EDS clusters, RDS names in HTTP
connection managers, SDS names in transport sockets whose secrets come over ADS).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import ssl
import sys
import tempfile
import time
from asyncio import sslproto
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events

CDS = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
EDS = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LDS = "type.googleapis.com/envoy.config.listener.v3.Listener"
RDS = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
SDS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
WILDCARD = (CDS, LDS)
NAMED = (EDS, RDS, SDS)
_SVC = "/envoy.service.discovery.v3.AggregatedDiscoveryService/"
PATHS = {"sotw": _SVC + "StreamAggregatedResources", "delta": _SVC + "DeltaAggregatedResources"}
_HCM = "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_TLS = ("DownstreamTlsContext", "UpstreamTlsContext")
EDS_TYPE = 3  # Cluster.DiscoveryType.EDS

# -- protobuf wire format: just enough ---------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _ld(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _s(num: int, text: str) -> bytes:
    return _ld(num, text.encode()) if text else b""


def fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): ints for varints, bytes for length-delimited."""
    i, n = 0, len(buf)
    while i < n:
        key, shift = 0, 0
        while True:
            b = buf[i]
            i += 1
            key |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, shift = 0, 0
            while True:
                b = buf[i]
                i += 1
                v |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            yield num, wt, v
        elif wt == 2:
            ln, shift = 0, 0
            while True:
                b = buf[i]
                i += 1
                ln |= (b & 0x7F) << shift
                shift += 7
                if b < 0x80:
                    break
            yield num, wt, buf[i : i + ln]
            i += ln
        elif wt == 1:
            yield num, wt, buf[i : i + 8]
            i += 8
        elif wt == 5:
            yield num, wt, buf[i : i + 4]
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wt}")


def _get(buf: bytes, num: int) -> list[Any]:
    return [v for n, _, v in fields(buf) if n == num]


def _first(buf: bytes, num: int, default: Any = b"") -> Any:
    for n, _, v in fields(buf):
        if n == num:
            return v
    return default


def _node(node_id: str) -> bytes:
    return _s(1, node_id) + _s(2, "bench-scale")


def sotw_request(
    node: str | None, type_url: str, version: str, names: list[str], nonce: str
) -> bytes:
    return (
        _s(1, version)
        + (_ld(2, _node(node)) if node else b"")
        + b"".join(_s(3, n) for n in names)
        + _s(4, type_url)
        + _s(5, nonce)
    )


def delta_request(
    node: str | None, type_url: str, sub: list[str], unsub: list[str], nonce: str
) -> bytes:
    return (
        (_ld(1, _node(node)) if node else b"")
        + _s(2, type_url)
        + b"".join(_s(3, n) for n in sub)
        + b"".join(_s(4, n) for n in unsub)
        + _s(6, nonce)
    )


def _any_value(any_bytes: bytes) -> tuple[str, bytes]:
    return _first(any_bytes, 1).decode(), _first(any_bytes, 2)


def _sds_names_in_tls(common: bytes) -> set[str]:
    """Names of secrets a CommonTlsContext takes from ADS (not from a local SDS server)."""
    configs = list(_get(common, 6)) + list(_get(common, 7))
    for combined in _get(common, 8):
        configs += _get(combined, 2)
    out = set()
    for sds in configs:
        source = _first(sds, 2)
        if source and _get(source, 3):  # ConfigSource.ads
            out.add(_first(sds, 1).decode())
    return out


def _sds_names_in_socket(socket: bytes) -> set[str]:
    url, value = _any_value(_first(socket, 3))
    if not url.endswith(_TLS):
        return set()
    return _sds_names_in_tls(_first(value, 1))


def cluster_refs(cluster: bytes) -> tuple[str, str | None, set[str]]:
    """(name, EDS name or None, ADS secret names) of a Cluster."""
    name = _first(cluster, 1).decode()
    eds = None
    if _first(cluster, 2, 0) == EDS_TYPE:
        eds = _first(_first(cluster, 3), 2).decode() or name
    secrets = set()
    for socket in _get(cluster, 24):
        secrets |= _sds_names_in_socket(socket)
    return name, eds, secrets


def listener_refs(listener: bytes) -> tuple[set[str], set[str]]:
    """(RDS names, ADS secret names) of a Listener."""
    routes: set[str] = set()
    secrets: set[str] = set()
    for chain in _get(listener, 3):
        for flt in _get(chain, 3):
            url, value = _any_value(_first(flt, 4))
            if url.endswith(_HCM):
                for rds in _get(value, 3):
                    routes.add(_first(rds, 2).decode())
        for socket in _get(chain, 6):
            secrets |= _sds_names_in_socket(socket)
    return routes, secrets


def healthy_endpoints(cla: bytes) -> set[tuple[str, int]]:
    """Endpoints of a ClusterLoadAssignment not marked UNHEALTHY (2), DRAINING (3) or TIMEOUT."""
    out = set()
    for locality in _get(cla, 2):
        for lb in _get(locality, 2):
            if _first(lb, 2, 0) in (2, 3, 4):
                continue
            sock = _first(_first(_first(lb, 1), 1), 1)
            out.add((_first(sock, 2).decode(), int(_first(sock, 3, 0))))
    return out


# -- one stream ----------------------------------------------------------------------------------


@dataclass
class _Type:
    names: set[str] = field(default_factory=set)  # subscribed (named types)
    held: dict[str, bytes] = field(default_factory=dict)  # resource name -> packed resource
    version: str = ""
    nonce: str = ""
    answered: bool = False  # a response came after the latest subscription change


class Stream(asyncio.Protocol):
    """One Envoy's ADS connection: one HTTP/2 connection over mTLS, one gRPC stream."""

    def __init__(self, worker: Worker, node: str, caller: bool) -> None:
        self.w = worker
        self.node = node
        self.caller = caller
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.transport: asyncio.Transport | None = None
        self.sid = 0
        self.buf = bytearray()
        self.types: dict[str, _Type] = {t: _Type() for t in (*WILDCARD, *NAMED)}
        self.sent_node = False
        self.closed: str | None = None
        self.responses = 0
        # quarantine tracking
        self.marked = False
        self.had_victim = False
        self.done_at: float | None = None
        self.post_mark = 0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        c = self.conn
        c.initiate_connection()
        c.increment_flow_control_window(16 * 1024 * 1024)
        self.sid = c.get_next_available_stream_id()
        c.send_headers(
            self.sid,
            [
                (b":method", b"POST"),
                (b":scheme", b"https"),
                (b":path", PATHS[self.w.protocol].encode()),
                (b":authority", b"localhost"),
                (b"content-type", b"application/grpc"),
                (b"te", b"trailers"),
            ],
        )
        c.increment_flow_control_window(16 * 1024 * 1024, stream_id=self.sid)
        for t in WILDCARD:
            self._request(t)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.closed is None:
            self.closed = f"connection lost: {exc!r}"
        self.w.lost(self)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except Exception as exc:  # a protocol error ends this stream only
            self.closed = f"h2: {exc!r}"
            if self.transport:
                self.transport.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.DataReceived):
                self.buf += ev.data
                self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                self._frames()
            elif isinstance(ev, h2.events.TrailersReceived | h2.events.StreamReset):
                self.closed = f"stream ended: {ev!r}"
            elif isinstance(ev, h2.events.ConnectionTerminated):
                self.closed = f"connection terminated: {ev!r}"
        self._flush()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def _send(self, msg: bytes) -> None:
        self.conn.send_data(self.sid, b"\x00" + len(msg).to_bytes(4, "big") + msg)

    def _frames(self) -> None:
        buf = self.buf
        while len(buf) >= 5:
            ln = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + ln:
                return
            msg = bytes(buf[5 : 5 + ln])
            del buf[: 5 + ln]
            if self.w.protocol == "delta":
                self._on_delta(msg)
            else:
                self._on_sotw(msg)

    # requests
    def _node_once(self) -> str | None:
        if self.sent_node:
            return None
        self.sent_node = True
        return self.node

    def _request(self, type_url: str, sub: list[str] = (), unsub: list[str] = ()) -> None:  # type: ignore[assignment]
        st = self.types[type_url]
        if self.w.protocol == "delta":
            self._send(delta_request(self._node_once(), type_url, list(sub), list(unsub), ""))
        else:
            names = sorted(st.names) if type_url in NAMED else []
            self._send(sotw_request(self._node_once(), type_url, st.version, names, st.nonce))

    def _ack(self, type_url: str) -> None:
        st = self.types[type_url]
        if self.w.protocol == "delta":
            self._send(delta_request(self._node_once(), type_url, [], [], st.nonce))
        else:
            names = sorted(st.names) if type_url in NAMED else []
            self._send(sotw_request(self._node_once(), type_url, st.version, names, st.nonce))

    def _subscriptions(self) -> None:
        """Named subscriptions follow what the wildcard resources reference, as in Envoy."""
        eds: set[str] = set()
        rds: set[str] = set()
        sds: set[str] = set()
        cache = self.w.refs
        for key, raw in self.types[CDS].held.items():
            ref = cache.get((CDS, key, raw))
            if ref is None:
                _, e, s = cluster_refs(raw)
                ref = cache[(CDS, key, raw)] = ({e} if e else set(), set(), s)
            eds |= ref[0]
            sds |= ref[2]
        for key, raw in self.types[LDS].held.items():
            ref = cache.get((LDS, key, raw))
            if ref is None:
                r, s = listener_refs(raw)
                ref = cache[(LDS, key, raw)] = (set(), r, s)
            rds |= ref[1]
            sds |= ref[2]
        if len(cache) > 50_000:
            cache.clear()
        for t, want in ((SDS, sds), (EDS, eds), (RDS, rds)):
            st = self.types[t]
            if want != st.names:
                sub, unsub = sorted(want - st.names), sorted(st.names - want)
                st.names = set(want)
                st.answered = not want
                for n in unsub:
                    st.held.pop(n, None)
                if self.w.protocol == "delta":
                    if sub or unsub:
                        self._request(t, sub, unsub)
                else:
                    self._request(t)

    # responses
    def _on_sotw(self, msg: bytes) -> None:
        version, type_url, nonce = "", "", ""
        resources: list[bytes] = []
        for num, _, v in fields(msg):
            if num == 1:
                version = v.decode()
            elif num == 2:
                resources.append(_first(v, 2))
            elif num == 4:
                type_url = v.decode()
            elif num == 5:
                nonce = v.decode()
        st = self.types.get(type_url)
        if st is None:
            return
        st.version, st.nonce, st.answered = version, nonce, True
        st.held = {_first(r, 1).decode(): r for r in resources}  # field 1: name / cluster_name
        self._after(type_url)

    def _on_delta(self, msg: bytes) -> None:
        type_url, nonce = "", ""
        added: list[tuple[str, bytes]] = []
        removed: list[str] = []
        for num, _, v in fields(msg):
            if num == 2:
                name, packed = "", b""
                for n2, _, v2 in fields(v):
                    if n2 == 3:
                        name = v2.decode()
                    elif n2 == 2:
                        packed = _first(v2, 2)
                added.append((name, packed))
            elif num == 4:
                type_url = v.decode()
            elif num == 5:
                nonce = v.decode()
            elif num == 6:
                removed.append(v.decode())
        st = self.types.get(type_url)
        if st is None:
            return
        st.nonce, st.answered = nonce, True
        for name, packed in added:
            st.held[name] = packed
        for name in removed:
            st.held.pop(name, None)
        self._after(type_url)

    def _after(self, type_url: str) -> None:
        self.responses += 1
        self.w.sent[type_url] = self.w.sent.get(type_url, 0) + 1
        self._ack(type_url)
        if type_url in WILDCARD:
            self._subscriptions()
        if self.marked:
            self.post_mark += 1
            if (
                self.done_at is None
                and self.caller
                and (not self.had_victim or not self.victim_present())
            ):
                self._flush()  # the ACK is on the wire when the change counts as taken
                self.done_at = time.monotonic()
                self.w.taken()

    def synced(self) -> bool:
        return all(self.types[t].answered for t in WILDCARD) and all(
            self.types[t].answered or not self.types[t].names for t in NAMED
        )

    def victim_present(self) -> bool:
        victim = self.w.victim
        return any(victim in healthy_endpoints(raw) for raw in self.types[EDS].held.values())


def load_leaf_only(ctx: ssl.SSLContext, chain_file: str, key_file: str) -> None:
    """Load the first certificate of the PEM chain in ``chain_file`` (the leaf) and its key,
    as ``sidecar.sds.leaf_pem`` cuts it for the ADS cluster's ``workload-leaf-cert``."""
    chain = Path(chain_file).read_bytes()
    end = chain.find(_PEM_END)
    leaf = chain if end < 0 else chain[: end + len(_PEM_END)] + b"\n"
    fd, path = tempfile.mkstemp(suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(leaf)
        ctx.load_cert_chain(path, key_file)
    finally:
        Path(path).unlink()


_PEM_END = b"-----END CERTIFICATE-----"


# -- the worker ---------------------------------------------------------------------------------


class Worker:
    def __init__(self) -> None:
        self.protocol = "delta"
        self.streams: list[Stream] = []
        self.refs: dict[tuple[str, str, bytes], tuple[set[str], set[str], set[str]]] = {}
        self.victim: tuple[str, int] = ("", 0)
        self.remaining = 0
        self.all_taken = asyncio.Event()
        self.contexts: dict[tuple[str, str], ssl.SSLContext] = {}
        self.lost_count = 0
        self.sent: dict[str, int] = {}  # responses received, by type URL

    def lost(self, stream: Stream) -> None:
        self.lost_count += 1

    def taken(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            self.all_taken.set()

    def _ctx(self, ca: str, cert: str, key: str) -> ssl.SSLContext:
        """A client context presenting what a sidecar's Envoy presents to the control plane:
        the leaf of the chain in ``cert`` alone (``workload-leaf-cert``)."""
        ctx = self.contexts.get((cert, key))
        if ctx is None:
            ctx = ssl.create_default_context(cafile=ca)
            load_leaf_only(ctx, cert, key)
            ctx.set_alpn_protocols(["h2"])
            self.contexts[(cert, key)] = ctx
        return ctx

    async def open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.protocol = cmd["protocol"]
        loop = asyncio.get_running_loop()
        sem = asyncio.Semaphore(int(cmd.get("concurrency", 64)))
        errors: list[str] = []

        async def one(spec: dict[str, Any]) -> None:
            async with sem:
                stream = Stream(self, spec["node"], bool(spec["caller"]))
                ctx = self._ctx(cmd["ca"], spec["cert"], spec["key"])
                try:
                    await asyncio.wait_for(
                        loop.create_connection(
                            lambda: stream,
                            cmd["host"],
                            cmd["port"],
                            ssl=ctx,
                            server_hostname="localhost",
                            local_addr=(spec["src"], 0),
                        ),
                        timeout=float(cmd.get("timeout", 60)),
                    )
                    self.streams.append(stream)
                except (OSError, TimeoutError, ssl.SSLError) as exc:
                    if len(errors) < 5:
                        errors.append(f"{spec['node']}: {exc!r}")
                    else:
                        errors.append("")

        await asyncio.gather(*(one(s) for s in cmd["streams"]))
        return {"opened": len(self.streams), "errors": len(errors), "error_samples": errors[:5]}

    async def wait_synced(self, cmd: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + float(cmd["timeout"])
        while True:
            synced = sum(1 for s in self.streams if s.synced())
            closed = sum(1 for s in self.streams if s.closed)
            if synced + closed >= len(self.streams) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        samples = [s.closed for s in self.streams if s.closed][:3]
        return {
            "synced": synced,
            "closed": closed,
            "total": len(self.streams),
            "closed_samples": samples,
        }

    def mark(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.victim = (cmd["victim"][0], int(cmd["victim"][1]))
        had = 0
        callers = 0
        self.all_taken.clear()
        for s in self.streams:
            s.marked, s.done_at, s.post_mark = True, None, 0
            s.had_victim = s.caller and s.victim_present()
            had += s.had_victim
            callers += s.caller
        self.remaining = callers
        if callers == 0:
            self.all_taken.set()
        return {"callers": callers, "had_victim": had}

    async def wait_taken(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.all_taken.wait(), float(cmd["timeout"]))
        times = [s.done_at for s in self.streams if s.caller and s.done_at is not None]
        callers = [s for s in self.streams if s.caller]
        return {
            "callers": len(callers),
            "taken": len(times),
            "last": max(times) if times else None,
            "first": min(times) if times else None,
            "victim_still_present": sum(1 for s in callers if s.victim_present()),
            "noncallers_touched": sum(1 for s in self.streams if not s.caller and s.post_mark),
            "closed": sum(1 for s in self.streams if s.closed),
        }

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "open":
            return await self.open(cmd)
        if op == "wait_synced":
            return await self.wait_synced(cmd)
        if op == "mark":
            return self.mark(cmd)
        if op == "wait_taken":
            return await self.wait_taken(cmd)
        if op == "stats":  # responses received so far, by short type name
            return {t.rsplit(".", 1)[-1]: n for t, n in self.sent.items()}
        if op == "close":
            for s in self.streams:
                if s.transport is not None:
                    s.transport.abort()
            return {"closed": len(self.streams)}
        raise ValueError(f"unknown command {op!r}")


def xds_server_context(
    root_pem: str, server_cert: str, server_key: str, intermediates_pem: str | None = None
) -> ssl.SSLContext:
    """The server side of the control plane's ADS port, as ``attestmesh.serve._xds_tls`` makes
    it (the same options; the mesh root as the only trust anchor, plus ``intermediates_pem``
    when given, as the control plane's store holds its live intermediates) with its serving
    certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=root_pem)
    if intermediates_pem is not None:
        ctx.load_verify_locations(cafile=intermediates_pem)
    ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    ctx.num_tickets = 0
    ctx.options |= ssl.OP_NO_RENEGOTIATION
    ctx.load_cert_chain(server_cert, server_key)
    return ctx


def handshake_floor_ms(
    server: ssl.SSLContext, client: ssl.SSLContext, rounds: int = 100
) -> tuple[float, float]:
    """Median CPU (this thread's) of the server side of one mTLS handshake and of reading the
    peer certificate, in process over a socketpair, as ``attestmesh.listen._SocketTLS`` does
    it (``SSLContext._wrap_socket``): ECDHE, the server's signature, parsing and verifying
    the client's chain and its CertificateVerify, with no event loop, HTTP/2 or xDS. The
    floor under the CPU per new mTLS stream. Returns (median, minimum) in ms."""
    import socket

    costs: list[float] = []
    for _ in range(rounds):
        a, b = socket.socketpair()
        cli: ssl.SSLSocket | None = None
        try:
            a.setblocking(False)
            b.setblocking(False)
            srv = server._wrap_socket(a, True, None)  # type: ignore[attr-defined]
            cli = client.wrap_socket(b, server_hostname="localhost", do_handshake_on_connect=False)
            spent = 0.0
            done_s = done_c = False
            for _step in range(50):
                if not done_c:
                    try:
                        cli.do_handshake()
                        done_c = True
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        pass
                if not done_s:
                    t0 = time.thread_time()
                    try:
                        srv.do_handshake()
                        srv.getpeercert(True)
                        done_s = True
                    except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                        pass
                    spent += time.thread_time() - t0
                if done_s and done_c:
                    break
            else:
                raise RuntimeError("the in-process handshake did not complete")
            costs.append(spent * 1e3)
        finally:
            if cli is not None:
                cli.close()  # it holds b's descriptor now
            a.close()
            b.close()
    costs.sort()
    return costs[len(costs) // 2], costs[0]


def raise_nofile() -> int:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def serve_commands(handle: Any) -> None:
    """One JSON command per stdin line -> one JSON answer per stdout line, until EOF."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 28)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        cmd = json.loads(line)
        try:
            out = await handle(cmd)
        except Exception as exc:
            out = {"error": repr(exc)}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        if cmd.get("cmd") == "close":
            return


def run(handle_factory: Any) -> None:
    raise_nofile()
    try:
        import uvloop  # type: ignore[import-not-found]

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run

    async def main() -> None:
        await serve_commands(handle_factory().handle)

    runner(main())


if __name__ == "__main__":
    # client side only: a small TLS read buffer per connection (asyncio's default is 256 KiB)
    sslproto.SSLProtocol.max_size = 16 * 1024
    run(Worker)
