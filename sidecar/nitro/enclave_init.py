"""``attestmesh enclave-init``: the entrypoint of a Nitro enclave image.

An enclave has no network and no disk, only vsock to its parent (CID 3). In order:

1. bring up loopback (and put on it every non-loopback address it must listen on: the pod IP
   for the inbound listener, peers named by IP);
2. listen on its vsock control port; the parent connects once ``nitro-cli run-enclave``
   returned (one session: a second connection is refused); say hello, receive the
   configuration (``config.EnclaveConfig``). The mesh root is pinned in the image
   (``--ca-bundle``, measured into PCR2 with the rest of the image): the parent is outside the
   enclave, and a root it chose would let it stand in for the control plane and the peers. Only
   ``--accept-parent-ca`` (experiments) takes the parent's copy instead;
3. bridge each outbound destination from loopback TCP (its own address and port, hostnames
   mapped to 127.0.0.1 in the hosts file) to vsock toward the parent, and the inbound vsock
   port to the Envoy inbound listener;
4. start the agent (``--tee nitro``, /dev/nsm), wait for its certificate, then Envoy (bootstrap
   rendered here) and the application;
5. supervise: when any of them exits, or the parent's control session closes, stop the
   others and exit non-zero (the enclave ends, and the parent sees it and restarts it).
   Meanwhile report the agent's status to the parent every ``STATUS_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from certs.errors import AttestmeshError
from sidecar.nitro.bridge import (
    PARENT_CID,
    Bridge,
    BridgeError,
    Transport,
    dial_tcp,
    dial_vsock,
    is_ip,
    listen_tcp,
    listen_vsock,
    parse_host_port,
    peer_cid,
)
from sidecar.nitro.config import (
    CONTROL_PORT,
    INBOUND_PORT,
    PROTOCOL_VERSION,
    ControlError,
    EnclaveConfig,
    Route,
    Status,
    decode,
    encode,
    parse_config,
)

log = logging.getLogger(__name__)

STATUS_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 60.0
SDS_TIMEOUT_S = 180.0
STOP_GRACE_S = 5.0

# Linux ioctls on an AF_INET socket with a struct ifreq (16-byte name + 16-byte union)
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
SIOCSIFADDR = 0x8916
SIOCSIFNETMASK = 0x891C
IFF_UP = 0x1
_IFREQ = struct.Struct("16s16s")


def ifreq_flags(name: str, flags: int = 0) -> bytes:
    return _IFREQ.pack(name.encode(), struct.pack("H14x", flags))


def ifreq_address(name: str, address: str) -> bytes:
    """An ifreq holding an IPv4 ``sockaddr_in`` (an IPv6 address would need netlink)."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        raise ControlError("control_invalid", f"{address!r}: only IPv4 addresses") from None
    sockaddr = struct.pack("HH4s8x", socket.AF_INET, 0, ip.packed)
    return _IFREQ.pack(name.encode(), sockaddr)


def loopback_up(name: str = "lo") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        current = fcntl.ioctl(s, SIOCGIFFLAGS, ifreq_flags(name))
        flags = struct.unpack_from("H", current, 16)[0]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, ifreq_flags(name, flags | IFF_UP))


def add_loopback_address(address: str, alias: int) -> None:
    """Put ``address`` on ``lo:<alias>`` as a /32 and bring it up."""
    name = f"lo:{alias}"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCSIFADDR, ifreq_address(name, address))
        fcntl.ioctl(s, SIOCSIFNETMASK, ifreq_address(name, "255.255.255.255"))
        fcntl.ioctl(s, SIOCSIFFLAGS, ifreq_flags(name, IFF_UP))


def extra_addresses(config: EnclaveConfig) -> list[str]:
    """Addresses the enclave listens on that loopback does not already have."""
    wanted = [config.inbound_address, *(r.listen_host for r in config.routes)]
    out: list[str] = []
    for a in wanted:
        ip = ipaddress.ip_address(a)
        if not ip.is_loopback and not ip.is_unspecified and a not in out:
            out.append(a)
    return out


def hosts_lines(routes: Sequence[Route]) -> list[str]:
    """Hosts-file lines mapping each destination named by hostname to loopback."""
    names = sorted({r.host for r in routes if not is_ip(r.host)})
    return [f"127.0.0.1 {n}" for n in names]


@dataclass(frozen=True, slots=True)
class EnclaveInitSettings:
    transport: Transport
    app: tuple[str, ...]
    run_dir: Path
    ca_bundle: Path | None = None  # pinned in the image; None only with --accept-parent-ca
    nsm_device: str | None = None
    hosts_file: Path | None = None
    setup_network: bool = True
    attestmesh_command: tuple[str, ...] = (sys.executable, "-m", "attestmesh.cli")
    envoy_log_level: str = "warning"
    accept_parent_ca: bool = False


def _from_parent(peername: object) -> bool:
    """Inside an enclave only the parent (CID 3) can reach a vsock port; checked anyway."""
    cid = peer_cid(peername)
    return cid is None or cid == PARENT_CID


class _Sessions:
    """The control listener's handler: the first connection is the session, later ones are
    closed at once."""

    def __init__(self) -> None:
        self.first: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = (
            asyncio.get_running_loop().create_future()
        )
        self.refused = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.first.done():
            self.refused += 1
            writer.transport.abort()
            return
        self.first.set_result((reader, writer))


def agent_command(s: EnclaveInitSettings, cfg: EnclaveConfig, ca: Path, sds: Path) -> list[str]:
    cmd = [
        *s.attestmesh_command, "agent", "--control-plane", cfg.control_plane_url,
        "--workload", cfg.workload, "--ca-bundle", str(ca), "--sds-socket", str(sds),
        "--tee", "nitro",
    ]  # fmt: skip
    if cfg.token is not None:
        cmd += ["--token-file", str(s.run_dir / "token")]
    if s.nsm_device:
        cmd += ["--device", s.nsm_device]
    return cmd


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


async def _sds_status(sds: Path) -> Status:
    from sidecar.sds import check_sds

    try:
        leaf = await check_sds(sds, now=datetime.now(UTC), timeout_s=2.0)
    except AttestmeshError:
        return Status(False)
    return Status(True, leaf.not_valid_after_utc.timestamp(), f"{leaf.serial_number:x}"[:40])


async def _stop_all(procs: Sequence[asyncio.subprocess.Process]) -> None:
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
    try:
        async with asyncio.timeout(STOP_GRACE_S):
            await asyncio.gather(*(p.wait() for p in procs))
    except TimeoutError:
        for p in procs:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
        await asyncio.gather(*(p.wait() for p in procs))


async def _receive_config(
    s: EnclaveInitSettings, stop: asyncio.Event
) -> tuple[EnclaveConfig, asyncio.StreamReader, asyncio.StreamWriter, asyncio.AbstractServer]:
    sessions = _Sessions()
    control, _ = await s.transport.listen(CONTROL_PORT, sessions.handle)
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await _first_of(sessions.first, stop)
            reader, writer = await sessions.first
        writer.write(encode({"type": "hello", "version": PROTOCOL_VERSION}))
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            msg = decode(await reader.readline())
        if msg["type"] != "config":
            raise ControlError("control_invalid", "expected config")
        return parse_config(msg), reader, writer, control
    except BaseException:
        control.close()
        if sessions.first.done() and not sessions.first.cancelled():
            sessions.first.result()[1].transport.abort()
        raise


async def _first_of(future: asyncio.Future[Any], stop: asyncio.Event) -> None:
    waiter = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([future, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
    if stop.is_set() and not future.done():
        raise asyncio.CancelledError


async def run_enclave_init(s: EnclaveInitSettings, stop: asyncio.Event) -> int:
    """Run the enclave until a component fails (1), the parent goes away (1) or ``stop`` (0)."""
    if s.ca_bundle is None and not s.accept_parent_ca:
        log.error("no --ca-bundle pinned in the image (or --accept-parent-ca)")
        return 2
    if s.setup_network:
        loopback_up()
    try:
        cfg, reader, writer, control = await _receive_config(s, stop)
    except asyncio.CancelledError:
        return 0
    except (ControlError, ValueError, TimeoutError, ConnectionError) as exc:
        log.error("no valid configuration from the parent: %s", exc)
        return 1
    s.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if s.setup_network:
        for i, address in enumerate(extra_addresses(cfg), start=1):
            add_loopback_address(address, i)
    if s.hosts_file is not None and (lines := hosts_lines(cfg.routes)):
        with s.hosts_file.open("a") as f:
            f.write("".join(f"{line}\n" for line in lines))
    ca = s.ca_bundle
    if ca is None:
        log.warning("trusting the mesh root the parent sent (--accept-parent-ca)")
        ca = s.run_dir / "root.pem"
        _write_private(ca, cfg.ca_bundle_pem)
    if cfg.token is not None:
        _write_private(s.run_dir / "token", cfg.token)

    servers: list[asyncio.AbstractServer] = [control]
    bridges: list[Bridge] = []
    try:
        for route in cfg.routes:
            bridge = Bridge(route.name, dial_vsock(s.transport, PARENT_CID, route.vsock_port))
            bridges.append(bridge)
            servers.append(await listen_tcp(route.listen_host, route.port, bridge))
        inbound = Bridge(
            "inbound", dial_tcp(cfg.inbound_address, cfg.inbound_port), admit=_from_parent
        )
        bridges.append(inbound)
        servers.append((await listen_vsock(s.transport, INBOUND_PORT, inbound))[0])
    except BridgeError as exc:
        log.error("cannot bridge: %s", exc.detail)
        for server in servers:
            server.close()
        writer.transport.abort()
        return 1

    procs: list[asyncio.subprocess.Process] = []
    names: dict[int, str] = {}
    sds = s.run_dir / "sds.sock"
    lost = asyncio.Event()

    async def read_control() -> None:
        with contextlib.suppress(ConnectionError, ValueError):
            while line := await reader.readline():
                try:
                    msg = decode(line)
                except ControlError:
                    continue
                token = msg.get("token")
                if msg["type"] == "token" and isinstance(token, str) and token:
                    _write_private(s.run_dir / "token", token)
        lost.set()

    async def report() -> None:
        with contextlib.suppress(ConnectionError):
            while True:
                status = await _sds_status(sds) if sds.exists() else Status(False)
                writer.write(encode(status.to_message()))
                await writer.drain()
                await asyncio.sleep(STATUS_EVERY_S)

    async def spawn(name: str, cmd: Sequence[str]) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.DEVNULL)
        procs.append(proc)
        names[proc.pid] = name
        log.info("started %s (pid %d)", name, proc.pid)
        return proc

    tasks = [asyncio.create_task(read_control()), asyncio.create_task(report())]
    code = 1
    try:
        agent = await spawn("agent", agent_command(s, cfg, ca, sds))
        async with asyncio.timeout(SDS_TIMEOUT_S):
            while not (await _sds_status(sds) if sds.exists() else Status(False)).attested:
                if agent.returncode is not None or stop.is_set() or lost.is_set():
                    break
                await asyncio.sleep(0.2)
        if agent.returncode is None and not stop.is_set() and not lost.is_set():
            await _start_envoy(s, cfg, ca, sds, spawn)
            if s.app:
                await spawn("app", s.app)
        waits = [asyncio.create_task(p.wait()) for p in procs]
        waits += [asyncio.create_task(stop.wait()), asyncio.create_task(lost.wait())]
        _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        if stop.is_set():
            code = 0
        elif lost.is_set():
            log.error("the parent's control connection closed")
        else:
            for p in procs:
                if p.returncode is not None:
                    log.error("%s exited with status %d", names[p.pid], p.returncode)
    except TimeoutError:
        log.error("the agent served no certificate within %.0fs", SDS_TIMEOUT_S)
    finally:
        for t in tasks:
            t.cancel()
        await _stop_all(procs)
        for server in servers:
            server.close()
        for bridge in bridges:
            await bridge.close()
        writer.transport.abort()
    return code


def envoy_xds_address(cfg: EnclaveConfig) -> tuple[str, int]:
    """Where the enclave's Envoy connects for ADS: the loopback listener of the xDS route (a
    hostname is not resolved: Envoy's resolver need not read the hosts file, and its xDS TLS
    checks the control plane's SPIFFE ID, not a host name)."""
    host, port = parse_host_port(cfg.xds)
    for route in cfg.routes:
        if (route.host, route.port) == (host, port):
            return route.listen_host, route.port
    return host, port


Spawn = Callable[[str, Sequence[str]], Awaitable[asyncio.subprocess.Process]]


async def _start_envoy(
    s: EnclaveInitSettings, cfg: EnclaveConfig, ca: Path, sds: Path, spawn: Spawn
) -> None:
    from sidecar.bootstrap import ControlPlaneAddress, XdsTls, build_bootstrap
    from sidecar.envoy_proc import envoy_command
    from xds.resources import control_plane_spiffe_id

    boot = build_bootstrap(
        cfg.workload,
        ControlPlaneAddress(*envoy_xds_address(cfg)),
        sds,
        cfg.envoy_admin_port,
        xds_tls=XdsTls(ca, control_plane_spiffe_id(cfg.trust_domain)),
    )
    path = s.run_dir / "envoy.json"
    path.write_text(json.dumps(boot))
    await spawn("envoy", envoy_command(path, s.envoy_log_level))


def run(s: EnclaveInitSettings) -> int:
    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await run_enclave_init(s, stop)

    return asyncio.run(main())
