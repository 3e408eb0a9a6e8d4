"""The Nitro Enclaves commands: ``attestmesh enclave-init`` (the enclave image's entrypoint),
``attestmesh nitro-parent`` (the injected pod-side container) and ``attestmesh policy from-eif``
(nitro-cli's measurements -> an AttestationPolicy). Thin: parse flags, build the settings of
``sidecar.nitro``, run."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from certs.errors import AttestmeshError
from certs.policy import parse_policies

log = logging.getLogger(__name__)


def add_parsers(sub: Any) -> None:
    e = sub.add_parser("enclave-init", help="Nitro enclave entrypoint: bridges, agent, Envoy, app")
    e.add_argument(
        "--transport", default="vsock", help="vsock (default) or unix:DIR (tests: socket files)"
    )
    e.add_argument("--cid", type=int, default=16, help="unix transport: this enclave's CID")
    e.add_argument("--ca-bundle", type=Path, help="mesh root pinned in the image (PEM)")
    e.add_argument(
        "--accept-parent-ca",
        action="store_true",
        help="without --ca-bundle: trust the root the parent sends (experiments only: the "
        "parent could then stand in for the control plane)",
    )
    e.add_argument("--nsm-device", help="the NSM device for the agent (default /dev/nsm)")
    e.add_argument("--run-dir", type=Path, default=Path("/run/attestmesh"))
    e.add_argument("--hosts-file", type=Path, help="append hostname routes here (/etc/hosts)")
    e.add_argument(
        "--no-network-setup",
        action="store_true",
        help="do not bring up loopback or add addresses (already done, or no privilege)",
    )
    e.add_argument(
        "--attestmesh-command",
        help="how to run attestmesh inside the image (default: this Python's attestmesh.cli)",
    )
    e.add_argument("--envoy-log-level", default="warning")
    e.add_argument("app", nargs=argparse.REMAINDER, help="-- the application command")
    e.set_defaults(func=run_enclave_init)

    p = sub.add_parser("nitro-parent", help="launch and supervise the enclave, bridge vsock")
    p.add_argument("--eif", type=Path, required=True, help="the enclave image file")
    p.add_argument("--granted-cpus", type=int, required=True, help="enclave CPUs the pod holds")
    p.add_argument(
        "--granted-memory-mib", type=int, required=True, help="hugepages the pod holds, MiB"
    )
    p.add_argument(
        "--hugetlb-limit-file",
        type=Path,
        default=Path("/sys/fs/cgroup/hugetlb.1GB.max"),
        help="cgroup v2 hugepages limit: caps --granted-memory-mib when smaller",
    )
    p.add_argument("--cpu-count", type=int, help="enclave CPUs (default: all granted)")
    p.add_argument("--memory-mib", type=int, help="enclave memory (default: all granted)")
    p.add_argument("--enclave-cid", type=int, help="fixed CID (default: nitro-cli picks)")
    p.add_argument("--workload", required=True, help="the registration name")
    p.add_argument("--control-plane", required=True, help="attestation API URL (https)")
    p.add_argument("--xds", required=True, help="control plane ADS address host:port")
    p.add_argument("--trust-domain", default="attestmesh.local")
    p.add_argument("--ca-bundle", type=Path, help="mesh root (sent for --accept-parent-ca)")
    p.add_argument("--token-file", type=Path, help="the pod's projected token")
    p.add_argument("--peer", action="append", default=[], help="a mesh peer host:port")
    p.add_argument("--inbound-address", required=True, help="the pod IP (enclave's listener)")
    p.add_argument("--inbound-port", type=int, required=True, help="the inbound mesh port")
    p.add_argument("--inbound-listen", default="0.0.0.0", help="parent's inbound listener")
    p.add_argument("--envoy-admin-port", type=int, default=15000)
    p.add_argument("--ready-host", default="0.0.0.0")
    p.add_argument("--ready-port", type=int, default=15021)
    p.add_argument("--grace", type=float, default=25.0, help="seconds to end the enclave")
    p.add_argument("--boot-timeout", type=float, default=120.0)
    p.add_argument("--backoff-initial", type=float, default=1.0)
    p.add_argument("--backoff-max", type=float, default=60.0)
    p.add_argument("--nitro-cli", default="nitro-cli", help="the nitro-cli command")
    p.add_argument("--transport", default="vsock", help="vsock (default) or unix:DIR (tests)")
    p.set_defaults(func=run_nitro_parent)

    pol = sub.add_parser("policy", help="AttestationPolicy helpers")
    psub = pol.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    f = psub.add_parser(
        "from-eif", help="nitro-cli build-enclave / describe-eif output -> AttestationPolicy"
    )
    f.add_argument("measurements", type=Path, help="the JSON nitro-cli printed ('-': stdin)")
    f.add_argument("--name", required=True, help="the policy's name")
    f.add_argument("--namespace", default="default")
    f.add_argument(
        "--service-account", action="append", required=True, help="selected (repeatable)"
    )
    f.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    f.set_defaults(func=run_policy_from_eif)


def policy_from_measurements(
    output: str, *, name: str, namespace: str, service_accounts: list[str]
) -> str:
    """The AttestationPolicy YAML admitting exactly the enclave whose PCR0/1/2 nitro-cli
    printed; parsed back with the control plane's own parser before it is returned."""
    from sidecar.nitro.nitrocli import parse_measurements

    pcrs = parse_measurements(output)
    doc = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "selector": {"serviceAccounts": service_accounts},
            "allowedTees": ["nitro"],
            "referenceValues": {"nitro": {k: [v] for k, v in sorted(pcrs.items())}},
        },
    }
    text = yaml.safe_dump(doc, sort_keys=False)
    parse_policies([yaml.safe_load(text)])  # PolicyError names every problem
    return text


def run_policy_from_eif(args: argparse.Namespace) -> int:
    try:
        raw = sys.stdin.read() if str(args.measurements) == "-" else args.measurements.read_text()
    except OSError as exc:
        raise AttestmeshError("usage", f"{args.measurements}: {exc.strerror or exc}") from None
    text = policy_from_measurements(
        raw, name=args.name, namespace=args.namespace, service_accounts=args.service_account
    )
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _command(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    parts = tuple(shlex.split(text))
    if not parts:
        raise AttestmeshError("usage", "an empty command")
    return parts


def run_enclave_init(args: argparse.Namespace) -> int:
    from sidecar.nitro.bridge import transport_from_spec
    from sidecar.nitro.enclave_init import EnclaveInitSettings, run

    app = list(args.app)
    if app and app[0] == "--":
        app = app[1:]
    settings = EnclaveInitSettings(
        transport=transport_from_spec(args.transport, args.cid),
        app=tuple(app),
        run_dir=args.run_dir,
        ca_bundle=args.ca_bundle,
        nsm_device=args.nsm_device,
        hosts_file=args.hosts_file,
        setup_network=not args.no_network_setup,
        envoy_log_level=args.envoy_log_level,
        accept_parent_ca=args.accept_parent_ca,
    )
    if (command := _command(args.attestmesh_command)) is not None:
        from dataclasses import replace

        settings = replace(settings, attestmesh_command=command)
    return run(settings)


def run_nitro_parent(args: argparse.Namespace) -> int:
    from sidecar.nitro.bridge import PARENT_CID, transport_from_spec
    from sidecar.nitro.config import (
        Backoff,
        EnclaveConfig,
        build_routes,
        check_config,
        control_plane_destinations,
        hugetlb_limit_mib,
        size_enclave,
    )
    from sidecar.nitro.nitrocli import NitroCli, run_enclave_args
    from sidecar.nitro.parent import Parent, ParentSettings

    granted_mib = args.granted_memory_mib
    try:  # the kernel's view of the grant wins when it is smaller than the flag
        limit = hugetlb_limit_mib(args.hugetlb_limit_file.read_text())
    except FileNotFoundError:
        limit = None
    if limit is not None and limit < granted_mib:
        log.warning("%s allows %d MiB of hugepages, not %d", args.hugetlb_limit_file, limit,
                    granted_mib)  # fmt: skip
        granted_mib = limit
    size = size_enclave(
        granted_cpus=args.granted_cpus,
        granted_memory_mib=granted_mib,
        cpu_count=args.cpu_count,
        memory_mib=args.memory_mib,
    )
    routes = build_routes(control_plane_destinations(args.control_plane, args.xds, args.peer))
    ca_pem = args.ca_bundle.read_text() if args.ca_bundle else ""
    config = EnclaveConfig(
        workload=args.workload,
        control_plane_url=args.control_plane,
        xds=args.xds,
        trust_domain=args.trust_domain,
        routes=routes,
        inbound_address=args.inbound_address,
        inbound_port=args.inbound_port,
        ca_bundle_pem=ca_pem,
        envoy_admin_port=args.envoy_admin_port,
    )
    check_config(config)  # a bad flag fails here, not in every enclave boot
    if not args.eif.is_file():
        raise AttestmeshError("usage", f"{args.eif}: no enclave image file")
    settings = ParentSettings(
        run_args=tuple(run_enclave_args(args.eif, size, cid=args.enclave_cid)),
        config=config,
        token_file=args.token_file,
        inbound_listen=args.inbound_listen,
        ready_host=args.ready_host,
        ready_port=args.ready_port,
        grace_s=args.grace,
        boot_timeout_s=args.boot_timeout,
        backoff=Backoff(args.backoff_initial, args.backoff_max),
    )
    parent = Parent(
        settings,
        NitroCli(_command(args.nitro_cli) or ("nitro-cli",)),
        transport_from_spec(args.transport, PARENT_CID),
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await parent.run(stop)

    asyncio.run(main())
    return 0
