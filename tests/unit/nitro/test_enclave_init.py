"""enclave-init: its pure pieces, the loopback set-up in a real network namespace, and the
control session as the parent sees it (Unix-socket transport, in process)."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar.nitro.bridge import PARENT_CID, PORT_ANY, UnixTransport
from sidecar.nitro.config import CONTROL_PORT, INBOUND_PORT, EnclaveConfig, Route, decode, encode
from sidecar.nitro.enclave_init import (
    EnclaveInitSettings,
    agent_command,
    envoy_xds_address,
    extra_addresses,
    hosts_lines,
    ifreq_address,
    ifreq_flags,
    run_enclave_init,
)
from tests.integration.envoy_harness import free_port

CFG = EnclaveConfig(
    workload="shop/web-0",
    control_plane_url="https://cp.svc:8443",
    xds="cp.svc:18000",
    trust_domain="mesh.example",
    routes=(
        Route("api", "cp.svc", 8443, 50000),
        Route("peer-0", "10.0.0.7", 15006, 50001),
        Route("peer-1", "127.0.0.1", 15007, 50002),
    ),
    inbound_address="10.0.0.5",
    inbound_port=15006,
    ca_bundle_pem="",
    token="t",
)


def test_ifreq_layout() -> None:
    flags = ifreq_flags("lo", 0x41)
    assert (
        len(flags) == 32 and flags[:3] == b"lo\0" and struct.unpack_from("H", flags, 16) == (0x41,)
    )
    addr = ifreq_address("lo:1", "10.0.0.5")
    family, port, ip = struct.unpack_from("HH4s", addr, 16)
    assert (family, port, ip) == (socket.AF_INET, 0, bytes([10, 0, 0, 5]))
    with pytest.raises(Exception, match="only IPv4"):
        ifreq_address("lo:1", "fd00::1")


def test_addresses_hosts_and_agent_command(tmp_path: Path) -> None:
    assert extra_addresses(CFG) == ["10.0.0.5", "10.0.0.7"]  # not 127.0.0.1 (loopback)
    named = replace(CFG, routes=(*CFG.routes, Route("xds", "cp.svc", 18000, 50003)))
    assert envoy_xds_address(named) == ("127.0.0.1", 18000)  # the route's loopback listener
    assert envoy_xds_address(replace(CFG, xds="10.0.0.9:18000")) == ("10.0.0.9", 18000)
    assert hosts_lines(CFG.routes) == ["127.0.0.1 cp.svc"]
    s = EnclaveInitSettings(UnixTransport(tmp_path, 16), (), tmp_path, nsm_device="/dev/nsm",
                            attestmesh_command=("attestmesh",))  # fmt: skip
    cmd = agent_command(s, CFG, tmp_path / "root.pem", tmp_path / "sds.sock")
    assert cmd[:2] == ["attestmesh", "agent"]
    assert cmd[cmd.index("--tee") + 1] == "nitro"
    assert cmd[cmd.index("--device") + 1] == "/dev/nsm"
    assert cmd[cmd.index("--token-file") + 1] == str(tmp_path / "token")
    assert cmd[cmd.index("--workload") + 1] == "shop/web-0"


NETNS_PROBE = r"""
import json, socket
from sidecar.nitro.enclave_init import add_loopback_address, loopback_up
out = {}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=1)
except OSError as exc:
    out["before"] = exc.errno
loopback_up()
add_loopback_address("10.1.2.3", 1)
srv = socket.create_server(("10.1.2.3", 0))
c = socket.create_connection(srv.getsockname(), timeout=2)
out["pod_ip_reachable"] = srv.accept()[0] is not None
try:
    socket.create_connection(("10.1.2.4", 80), timeout=1)
except OSError as exc:
    out["neighbour"] = exc.errno
print(json.dumps(out))
"""


def test_loopback_and_pod_address_in_a_fresh_network_namespace() -> None:
    """What enclave-init does first, for real: a new network namespace has loopback down; after
    loopback_up and add_loopback_address the pod IP is served on loopback as a /32 (the
    neighbour address is not routed to loopback)."""
    out = subprocess.run(
        ["unshare", "--net", "--map-root-user", sys.executable, "-c", NETNS_PROBE],
        capture_output=True, text=True, timeout=30, check=False,
        cwd=Path(__file__).resolve().parents[3],
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    import errno

    assert result["before"] == errno.ENETUNREACH  # loopback down: nothing routes
    assert result["pod_ip_reachable"] is True
    assert result["neighbour"] == errno.ENETUNREACH


async def test_enclave_needs_a_pinned_root(tmp_path: Path) -> None:
    s = EnclaveInitSettings(UnixTransport(tmp_path, 16), (), tmp_path, setup_network=False)
    assert await run_enclave_init(s, asyncio.Event()) == 2


async def test_control_session_one_parent_and_a_bad_config_ends_the_enclave(
    tmp_path: Path,
) -> None:
    ca = tmp_path / "root.pem"
    ca.write_text("pinned")
    s = EnclaveInitSettings(UnixTransport(tmp_path, 16), (), tmp_path / "run", ca_bundle=ca,
                            setup_network=False)  # fmt: skip
    enclave = asyncio.create_task(run_enclave_init(s, asyncio.Event()))
    parent = UnixTransport(tmp_path, PARENT_CID)
    async with asyncio.timeout(10):
        while not (tmp_path / f"16-{CONTROL_PORT}.sock").exists():
            await asyncio.sleep(0.02)
    r, w = await parent.connect(16, CONTROL_PORT)
    assert decode(await r.readline()) == {"type": "hello", "version": 1}
    r2, w2 = await parent.connect(16, CONTROL_PORT)  # a second session is refused
    assert await asyncio.wait_for(r2.read(), 5) == b""
    bad = {**CFG.to_message(), "inbound_address": "not-an-ip"}
    w.write(encode(bad))
    assert await asyncio.wait_for(enclave, 10) == 1
    w.close()
    w2.close()


async def test_stop_before_the_parent_connects_exits_cleanly(tmp_path: Path) -> None:
    ca = tmp_path / "root.pem"
    ca.write_text("pinned")
    s = EnclaveInitSettings(UnixTransport(tmp_path, 16), (), tmp_path / "run", ca_bundle=ca,
                            setup_network=False)  # fmt: skip
    stop = asyncio.Event()
    enclave = asyncio.create_task(run_enclave_init(s, stop))
    await asyncio.sleep(0.2)
    stop.set()
    assert await asyncio.wait_for(enclave, 5) == 0


async def test_enclave_bridges_reports_and_follows_the_token(tmp_path: Path) -> None:
    """enclave-init in process up to its agent (a stand-in process that never serves SDS):
    the outbound route listens on loopback and reaches the parent's vsock port, the inbound
    vsock port reaches the enclave's inbound address, status says not attested, a token update
    is written for the agent, and stop ends everything with 0."""
    ca = tmp_path / "root.pem"
    ca.write_text("pinned")
    run = tmp_path / "run"
    parent = UnixTransport(tmp_path, PARENT_CID)

    async def upper(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write((await r.read()).upper())
        w.close()

    api_server, api_vport = await parent.listen(PORT_ANY, upper)  # the parent's "api" bridge
    inbound = await asyncio.start_server(upper, "127.0.0.1", 0)  # the enclave's Envoy inbound
    route_port, inbound_port = free_port(), inbound.sockets[0].getsockname()[1]
    cfg = EnclaveConfig(
        "shop/web-0", f"https://127.0.0.1:{route_port}", f"127.0.0.1:{route_port + 1}",
        "mesh.example", (Route("api", "127.0.0.1", route_port, api_vport),),
        "127.0.0.1", inbound_port, "", token="first",
    )  # fmt: skip
    s = EnclaveInitSettings(
        UnixTransport(tmp_path, 16), (), run, ca_bundle=ca, setup_network=False,
        attestmesh_command=(sys.executable, "-c", "import time; time.sleep(60)"),
    )  # fmt: skip
    stop = asyncio.Event()
    enclave = asyncio.create_task(run_enclave_init(s, stop))
    try:
        async with asyncio.timeout(10):
            while not (tmp_path / f"16-{CONTROL_PORT}.sock").exists():
                await asyncio.sleep(0.02)
        r, w = await parent.connect(16, CONTROL_PORT)
        assert decode(await r.readline())["type"] == "hello"
        w.write(encode(cfg.to_message()))
        status = decode(await asyncio.wait_for(r.readline(), 10))
        assert status == {"type": "status", "attested": False, "not_after": None, "serial": None}
        assert (run / "token").read_text() == "first"
        assert stat.S_IMODE((run / "token").stat().st_mode) == 0o600
        # outbound: loopback TCP in the enclave -> the parent's vsock port
        rd, wr = await asyncio.open_connection("127.0.0.1", route_port)
        wr.write(b"attest me")
        wr.write_eof()
        assert await asyncio.wait_for(rd.read(), 5) == b"ATTEST ME"
        wr.close()
        # inbound: the enclave's vsock INBOUND_PORT -> its inbound address
        rd, wr = await parent.connect(16, INBOUND_PORT)
        wr.write(b"mesh call")
        wr.write_eof()
        assert await asyncio.wait_for(rd.read(), 5) == b"MESH CALL"
        wr.close()
        w.write(encode({"type": "token", "token": "second"}))
        async with asyncio.timeout(5):
            while (run / "token").read_text() != "second":
                await asyncio.sleep(0.02)
        stop.set()
        assert await asyncio.wait_for(enclave, 15) == 0
        w.close()
    finally:
        stop.set()
        api_server.close()
        inbound.close()


async def test_a_component_exiting_ends_the_enclave_non_zero(tmp_path: Path) -> None:
    ca = tmp_path / "root.pem"
    ca.write_text("pinned")
    parent = UnixTransport(tmp_path, PARENT_CID)
    port = free_port()
    cfg = EnclaveConfig("shop/web-0", f"https://127.0.0.1:{port}", f"127.0.0.1:{port}",
                        "mesh.example", (), "127.0.0.1", free_port(), "")  # fmt: skip
    s = EnclaveInitSettings(
        UnixTransport(tmp_path, 16), (), tmp_path / "run", ca_bundle=ca, setup_network=False,
        attestmesh_command=(sys.executable, "-c", "raise SystemExit(3)"),
    )  # fmt: skip
    enclave = asyncio.create_task(run_enclave_init(s, asyncio.Event()))
    async with asyncio.timeout(10):
        while not (tmp_path / f"16-{CONTROL_PORT}.sock").exists():
            await asyncio.sleep(0.02)
    r, w = await parent.connect(16, CONTROL_PORT)
    await r.readline()
    w.write(encode(cfg.to_message()))
    assert await asyncio.wait_for(enclave, 15) == 1  # the agent died: the enclave ends
    rest = await asyncio.wait_for(r.read(), 5)  # its session closed (EOF, no timeout)...
    assert all(decode(line)["type"] == "status" for line in rest.splitlines())  # after status
    w.close()
