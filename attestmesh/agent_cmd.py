"""``attestmesh agent``: the sidecar agent process (agent loop + local SDS for Envoy)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import AttestmeshError
from sidecar.agent import Agent, EvidenceSource, SimEvidenceSource, client_ssl_context
from sidecar.collectors import DEVICE_TEES, device_source
from sidecar.sds import LocalSds, start_sds

log = logging.getLogger(__name__)


def add_agent_parser(sub: Any) -> argparse.ArgumentParser:
    a: argparse.ArgumentParser = sub.add_parser(
        "agent", help="run the sidecar agent: attest, serve the cert to Envoy"
    )
    a.add_argument("--control-plane", required=True, help="attestation API URL, https://host:port")
    a.add_argument("--workload", required=True, help="this workload's registration name")
    a.add_argument("--ca-bundle", type=Path, required=True, help="mesh root CA bundle (PEM)")
    a.add_argument(
        "--sds-socket", type=Path, required=True, help="Unix socket Envoy reads SDS from"
    )
    a.add_argument(
        "--token-file", type=Path, help="identity token (projected SA token / join token)"
    )
    a.add_argument(
        "--tee",
        choices=["sim", *DEVICE_TEES],
        required=True,
        help="sim (local runs), sev-snp (/dev/sev-guest), tsm (configfs-tsm: SNP or TDX), "
        "nitro (/dev/nsm), sgx (Gramine /dev/attestation)",
    )
    a.add_argument("--device", type=Path, help="override the TEE device path")
    a.add_argument("--sim-platform-key", type=Path, help="sim: the simulated platform private key")
    a.add_argument("--sim-measurement", help="sim: the measurement to report (96 hex chars)")
    return a


def _source(args: argparse.Namespace) -> EvidenceSource:
    if args.tee == "sim":
        if not args.sim_platform_key or not args.sim_measurement:
            raise AttestmeshError(
                "usage", "--tee sim needs --sim-platform-key and --sim-measurement"
            )
        key = serialization.load_pem_private_key(args.sim_platform_key.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise AttestmeshError("usage", "the sim platform key must be an EC private key")
        try:
            measurement = bytes.fromhex(args.sim_measurement)
        except ValueError:
            raise AttestmeshError("usage", "--sim-measurement must be hex") from None
        if len(measurement) != 48:
            raise AttestmeshError("usage", "--sim-measurement must be 48 bytes (96 hex chars)")
        return SimEvidenceSource(key, measurement)
    return device_source(args.tee, args.device)


def run_agent(args: argparse.Namespace) -> int:
    source = _source(args)
    bundle = args.ca_bundle.read_bytes()

    def token() -> str | None:
        return args.token_file.read_text().strip() if args.token_file else None

    async def main() -> None:
        sds = LocalSds()
        server = await start_sds(sds, args.sds_socket)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        agent = Agent(
            url=args.control_plane,
            workload=args.workload,
            source=source,
            sink=sds,
            ssl_context=client_ssl_context(bundle),
            token=token,
        )
        try:
            await agent.run(stop)
        finally:
            server.close()
            await server.wait_closed()
            with contextlib.suppress(OSError):
                args.sds_socket.unlink()

    asyncio.run(main())
    return 0
