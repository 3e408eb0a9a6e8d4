"""``attestmesh agent``: the sidecar agent process (agent loop + local SDS for Envoy)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from certs.errors import AttestmeshError
from sidecar.agent import Agent, EvidenceSource, SimEvidenceSource, client_ssl_context
from sidecar.collectors import DEVICE_TEES, device_source
from sidecar.sds import LocalSds, check_sds, start_sds
from sidecar.secrets import FanOut, SecretFetcher, start_socket

log = logging.getLogger(__name__)


def add_agent_parser(sub: Any) -> argparse.ArgumentParser:
    a: argparse.ArgumentParser = sub.add_parser(
        "agent", help="run the sidecar agent: attest, serve the cert to Envoy"
    )
    # required unless --check (checked in run_agent: argparse cannot make them conditional)
    a.add_argument("--control-plane", help="attestation API URL, https://host:port (required)")
    a.add_argument("--workload", help="this workload's registration name (required)")
    a.add_argument("--ca-bundle", type=Path, help="mesh root CA bundle, PEM (required)")
    a.add_argument(
        "--sds-socket", type=Path, required=True, help="Unix socket Envoy reads SDS from"
    )
    a.add_argument(
        "--check",
        action="store_true",
        help="probe instead of running: exit 0 when --sds-socket serves a currently valid "
        "certificate, 1 otherwise (the injected agent's startup probe)",
    )
    a.add_argument(
        "--check-timeout", type=float, default=2.0, help="--check: seconds to wait for it"
    )
    a.add_argument(
        "--token-file", type=Path, help="identity token (projected SA token / join token)"
    )
    a.add_argument(
        "--tee",
        choices=["sim", *DEVICE_TEES],
        help="(required) sim (local runs), sev-snp (/dev/sev-guest), tsm (configfs-tsm: SNP "
        "or TDX), nitro (/dev/nsm), sgx (Gramine /dev/attestation)",
    )
    a.add_argument("--device", type=Path, help="override the TEE device path")
    a.add_argument("--sim-platform-key", type=Path, help="sim: the simulated platform private key")
    a.add_argument("--sim-measurement", help="sim: the measurement to report (96 hex chars)")
    g = a.add_argument_group("secrets", "secrets released by SecretPolicy (OpenBao), sealed")
    g.add_argument("--secret", action="append", help="secret to fetch: name or namespace/name")
    g.add_argument("--secret-url", help="the control plane's secret port, https://host:8444")
    g.add_argument("--secret-dir", type=Path, help="write <dir>/<secret>/<key> (memory volume)")
    g.add_argument("--secret-socket", type=Path, help="serve GET /v1/secrets/<name> here")
    g.add_argument("--secret-poll", type=float, default=30.0, help="seconds between checks")
    g.add_argument(
        "--secret-file-mode", type=lambda v: int(v, 8), default=0o400, help="octal (0400)"
    )
    from attestmesh.cp_attest import add_gate_arguments

    add_gate_arguments(a)
    a.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="attach this many NVIDIA confidential GPUs (NVIDIA attestation SDK) to the CVM's "
        "evidence (sev-snp, tsm), each bound to the same challenge",
    )
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


_REQUIRED = (
    ("control_plane", "--control-plane"),
    ("workload", "--workload"),
    ("ca_bundle", "--ca-bundle"),
    ("tee", "--tee"),
)


def check_agent_args(args: argparse.Namespace) -> None:
    """The flags a running agent needs (``--check`` needs only ``--sds-socket``)."""
    if args.check:
        return
    missing = [flag for attr, flag in _REQUIRED if getattr(args, attr) is None]
    if missing:
        raise AttestmeshError("usage", f"agent needs {', '.join(missing)} (unless --check)")


def _check(args: argparse.Namespace) -> int:
    try:
        leaf = asyncio.run(
            check_sds(args.sds_socket, now=datetime.now(UTC), timeout_s=args.check_timeout)
        )
    except AttestmeshError as exc:
        print(f"attestmesh agent --check: {exc.detail}", file=sys.stderr)
        return 1
    print(f"serving {leaf.subject.rfc4514_string() or 'a certificate'} until "
          f"{leaf.not_valid_after_utc.isoformat()}")  # fmt: skip
    return 0


async def _secret_fetcher(
    args: argparse.Namespace, bundle: bytes
) -> tuple[SecretFetcher | None, Any]:
    if not args.secret:
        return None, None
    if not args.secret_url or not (args.secret_dir or args.secret_socket):
        raise AttestmeshError(
            "usage", "--secret needs --secret-url and --secret-dir and/or --secret-socket"
        )
    fetcher = SecretFetcher(
        url=args.secret_url,
        workload=args.workload,
        secrets=args.secret,
        bundle_pem=bundle,
        directory=args.secret_dir,
        tls_dir=(args.secret_dir or args.secret_socket.parent) / ".tls",
        poll_s=args.secret_poll,
        file_mode=args.secret_file_mode,
    )
    runner = await start_socket(fetcher, args.secret_socket) if args.secret_socket else None
    return fetcher, runner


def run_agent(args: argparse.Namespace) -> int:
    check_agent_args(args)
    if args.check:
        return _check(args)
    source = _source(args)
    if args.gpus:
        from sidecar.gpu import GpuAttachedSource, nvidia_sdk_gpus

        source = GpuAttachedSource(source, nvidia_sdk_gpus(args.gpus))
    bundle = args.ca_bundle.read_bytes()
    from attestmesh.cp_attest import gate_from_args

    gate = gate_from_args(args, bundle)  # --control-plane-policy: no evidence to an unverified one
    if gate is not None:
        source = gate.guard(source)

    def token() -> str | None:
        return args.token_file.read_text().strip() if args.token_file else None

    async def main() -> None:
        sds = LocalSds()
        server = await start_sds(sds, args.sds_socket)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        fetcher, socket_runner = await _secret_fetcher(args, bundle)
        gate_task = None
        if gate is not None:
            if not await gate.refresh():
                assert gate.last_error is not None
                log.error("control plane not verified: %s", gate.last_error)
            gate_task = asyncio.create_task(gate.run(stop))
        agent = Agent(
            url=args.control_plane,
            workload=args.workload,
            source=source,
            sink=sds if fetcher is None else FanOut(sds, fetcher),
            ssl_context=client_ssl_context(bundle),
            token=token,
        )
        try:
            if fetcher is None:
                await agent.run(stop)
            else:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(agent.run(stop))
                    tg.create_task(fetcher.run(stop))
        finally:
            if gate_task is not None:
                gate_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await gate_task
            if socket_runner is not None:
                await socket_runner.cleanup()
            server.close()
            await server.wait_closed()
            with contextlib.suppress(OSError):
                args.sds_socket.unlink()

    asyncio.run(main())
    return 0
