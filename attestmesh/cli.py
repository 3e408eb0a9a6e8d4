"""``attestmesh``: the command line. Settings are read here, once, and passed down."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from certs.errors import AttestmeshError, PolicyError

_LOCAL_ONLY = {"policy": "--policy", "mesh_policy": "--mesh-policy", "workloads": "--workloads"}
_KUBE_ONLY = {
    "kubeconfig": "--kubeconfig",
    "namespace": "--namespace",
    "identity": "--identity",
    "lease_name": "--lease-name",
    "service_name": "--service-name",
    "webhook_host": "--webhook-host",
    "webhook_port": "--webhook-port",
    "webhook_cert": "--webhook-cert",
    "webhook_key": "--webhook-key",
    "webhook_configuration": "--webhook-configuration",
    "probe_host": "--probe-host",
    "probe_port": "--probe-port",
    "sidecar_image": "--sidecar-image",
    "envoy_image": "--envoy-image",
    "inject_attest_gpus": "--inject-attest-gpus",
    "inject_control_plane_policy": "--inject-control-plane-policy",
}


def _check_mode(args: argparse.Namespace) -> None:
    """Mode-specific flags: every misuse is reported at once."""
    problems: list[str] = []
    if args.kubernetes:
        for attr, flag in _LOCAL_ONLY.items():
            if getattr(args, attr) is not None:
                problems.append(
                    f"{flag} is for local mode; with --kubernetes policies come from "
                    "AttestationPolicy and MeshPolicy resources and workloads from pods"
                )
        if (args.webhook_cert is None) != (args.webhook_key is None):
            problems.append("--webhook-cert and --webhook-key go together")
        if args.webhook_port == 0 and (args.webhook_cert or args.webhook_configuration):
            problems.append("--webhook-port 0 disables the webhook; drop its other flags")
        if args.inject_control_plane_policy is not None:
            from sidecar.inject import is_configmap_name

            if not is_configmap_name(args.inject_control_plane_policy):
                problems.append(
                    f"--inject-control-plane-policy {args.inject_control_plane_policy!r} is "
                    "not a ConfigMap name"
                )
    else:
        if args.policy is None:
            problems.append("--policy is required in local mode (or run with --kubernetes)")
        for attr, flag in _KUBE_ONLY.items():
            if getattr(args, attr) is not None:
                problems.append(f"{flag} needs --kubernetes")
    if problems:
        raise PolicyError(problems)


def _controlplane(args: argparse.Namespace) -> int:
    from attestmesh.metrics import Metrics
    from attestmesh.serve import (
        ControlPlaneSettings,
        Hooks,
        default_attest_processes,
        run_control_plane,
    )

    _check_mode(args)
    kube_settings = None
    server_names: tuple[str, ...] = ("localhost",)
    if args.kubernetes:
        import dataclasses
        import os
        import socket

        from attestmesh.kube_mode import KubeSettings
        from sidecar.inject import InjectConfig

        namespace = args.namespace or "attestmesh-system"
        service = args.service_name or "attestmesh-controlplane"
        inject = InjectConfig(
            control_plane_url=f"https://{service}.{namespace}.svc:{args.api_port}",
            xds_address=f"{service}.{namespace}.svc:{args.xds_port}",
            secret_url=f"https://{service}.{namespace}.svc:{args.secret_port}",
            control_plane_namespace=namespace,
        )
        if args.sidecar_image:
            inject = dataclasses.replace(inject, agent_image=args.sidecar_image)
        if args.envoy_image:
            inject = dataclasses.replace(inject, envoy_image=args.envoy_image)
        if args.inject_attest_gpus:
            inject = dataclasses.replace(inject, attest_gpus=True)
        if args.inject_control_plane_policy:
            inject = dataclasses.replace(
                inject, control_plane_policy=args.inject_control_plane_policy
            )
        kube_settings = KubeSettings(
            namespace=namespace,
            identity=args.identity or os.environ.get("POD_NAME") or socket.gethostname(),
            lease_name=args.lease_name or "attestmesh-controlplane-leader",
            service_name=service,
            webhook_host=args.webhook_host or "0.0.0.0",
            webhook_port=None if args.webhook_port == 0 else (args.webhook_port or 9443),
            webhook_cert=args.webhook_cert,
            webhook_key=args.webhook_key,
            webhook_configuration=args.webhook_configuration,
            probe_host=args.probe_host or "0.0.0.0",
            probe_port=args.probe_port,
            resync=timedelta(minutes=5),
            inject=inject,
        )
        server_names = (*kube_settings.service_dns_names(), "localhost")
        if args.kbs_port is not None:  # KBS clients come through their own Service
            kbs = dataclasses.replace(kube_settings, service_name=f"{service}-kbs")
            server_names = (*server_names, *kbs.service_dns_names())

    from attestmesh import cp_attest
    from attestmesh.listen import limits_from_args
    from attestmesh.secret_release import settings_from_args as secret_settings_from_args

    try:
        listen = limits_from_args(args)
    except ValueError as exc:
        raise AttestmeshError("usage", str(exc)) from None
    if args.attest_processes is not None and not 0 <= args.attest_processes <= 64:
        raise AttestmeshError("usage", "--attest-processes must be between 0 and 64")
    settings = ControlPlaneSettings(
        listen=listen,
        state_dir=args.state_dir,
        policy_file=args.policy,
        mesh_policy_file=args.mesh_policy,
        registrations_file=args.workloads,
        allow_unauthenticated_registrations=args.allow_unauthenticated_registrations,
        attest_burst=args.attest_burst,
        attest_refill=timedelta(seconds=args.attest_refill),
        attest_processes=default_attest_processes()
        if args.attest_processes is None
        else args.attest_processes,
        trust_domain=args.trust_domain,
        host=args.host,
        api_port=args.api_port,
        xds_port=args.xds_port,
        ops_port=args.ops_port,
        sim_platform_keys=tuple(args.sim_platform_key or ()),
        roots_dir=args.roots,
        xds_plaintext=args.xds_plaintext,
        ads_transport=args.ads_transport,
        amd_kds_url=args.amd_kds_url,
        intel_pcs_url=args.intel_pcs_url,
        intel_root_ca_crl_url=args.intel_root_ca_crl_url,
        server_names=server_names,
        store=args.store,
        secrets=secret_settings_from_args(args),
        self_attestation=cp_attest.self_source_from_args(args),
        ca_key_store=args.ca_key_store,
    )

    async def main() -> None:
        metrics = Metrics()
        hooks: Hooks | None = None
        if kube_settings is not None:
            from attestmesh.controlplane.secrets import SecretPolicies
            from attestmesh.kube_mode import KubeMode, connect

            kube = connect(args.kubeconfig, kube_settings.request_timeout)
            hooks = KubeMode(
                kube,
                kube_settings,
                metrics,
                state_dir=settings.state_dir,
                secret_policies=SecretPolicies() if settings.secrets is not None else None,
            ).hooks()
        # SIGTERM (a pod's deletion) shuts down cleanly: the leader hands its Lease over
        # instead of leaving the other replicas to wait for it to expire
        import signal

        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await run_control_plane(settings, stop, metrics=metrics, hooks=hooks)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        return 0
    return 0


def _agent(args: argparse.Namespace) -> int:
    from attestmesh.agent_cmd import run_agent

    return run_agent(args)


def _bootstrap(args: argparse.Namespace) -> int:
    from attestmesh.serve import control_plane_spiffe_id
    from sidecar.bootstrap import (
        XdsProtocol,
        XdsTls,
        build_bootstrap,
        control_plane_addresses,
        render_bootstrap,
    )

    try:  # several replicas: host:port,host:port (each an endpoint of the ADS cluster)
        addresses = control_plane_addresses(args.xds)
    except ValueError as exc:
        raise AttestmeshError("usage", f"--xds must be host:port[,host:port...]: {exc}") from None
    if args.xds_ca is None and not args.xds_plaintext:
        raise AttestmeshError(
            "usage", "--xds-ca FILE (the mesh root bundle) is required unless --xds-plaintext"
        )
    tls = None
    if args.xds_ca is not None:
        server_id = args.xds_server_id or control_plane_spiffe_id(args.trust_domain)
        tls = XdsTls(args.xds_ca, server_id)
    text = render_bootstrap(
        build_bootstrap(
            args.node,
            addresses,
            args.sds_socket,
            args.admin_port,
            xds_tls=tls,
            xds_protocol=XdsProtocol(args.xds_protocol),
        )
    )
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


def _demo(args: argparse.Namespace) -> int:
    import signal

    from attestmesh.demo import run_demo

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # as Ctrl-C: stop every process the demo started

    signal.signal(signal.SIGTERM, terminated)
    try:
        return asyncio.run(run_demo(args.workdir, hold=args.hold))
    except KeyboardInterrupt:
        print("interrupted; every process the demo started was stopped", file=sys.stderr)
        return 130


def _ops_token(args: argparse.Namespace) -> str | None:
    """The control plane's ops token: --ops-token-file, else <--state-dir>/ops-token."""
    path: Path | None = args.ops_token_file
    if path is None and args.state_dir is not None:
        path = args.state_dir / "ops-token"
    if path is None:
        return None
    try:
        token = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AttestmeshError(
            "ops_token_unreadable",
            f"cannot read the ops token at {path} ({exc.__class__.__name__}); --state-dir must "
            "be the running control plane's",
        ) from None
    if not token:
        raise AttestmeshError("ops_token_unreadable", f"{path} is empty")
    return token


def _admin(args: argparse.Namespace, method: str, path: str, body: Any = None) -> Any:
    url = f"http://127.0.0.1:{args.ops_port}{path}"
    token = _ops_token(args)
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 (loopback URL)
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        if exc.code == 401:
            how = "was refused" if token is not None else "is required"
            raise AttestmeshError(
                "ops_unauthenticated",
                f"the control plane's ops token {how}: pass --state-dir (the control plane's) "
                "or --ops-token-file",
            ) from None
        raise AttestmeshError("admin_error", f"{exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise AttestmeshError(
            "control_plane_unreachable", f"no control plane ops endpoint at {url}: {exc.reason}"
        ) from None


def _quarantine(args: argparse.Namespace) -> int:
    if args.action == "list":
        items = _admin(args, "GET", "/v1/admin/workloads?status=quarantined")
        if args.json:
            print(json.dumps(items, indent=2))
        elif not items:
            print("no workload is quarantined")
        for w in items if not args.json else []:
            q = w["quarantine"]
            print(f"{w['name']}\t{w['spiffe_id']}\t{q['at']}\t{q['trigger']}\t{q['reason']}")
        return 0
    if not args.name:
        raise AttestmeshError("usage", f"quarantine {args.action} needs a workload NAME")
    if args.action == "release":
        out = _admin(args, "POST", f"/v1/admin/workloads/{args.name}/release", {})
        print(
            f"{args.name}: {out['status']} "
            f"({'released' if out['changed'] else 'was not quarantined'}); "
            "certificates flow again after a fresh successful attestation"
        )
        return 0
    out = _admin(
        args, "POST", f"/v1/admin/workloads/{args.name}/quarantine", {"reason": args.reason}
    )
    print(f"{args.name}: {out['status']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attestmesh", description="Attested service mesh")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    cp = sub.add_parser("controlplane", help="run the control plane (attestation API, xDS, ops)")
    cp.add_argument("--state-dir", type=Path, required=True, help="CA and SQLite state live here")
    cp.add_argument(
        "--ca-key-store",
        help="where the CA's private keys live: file (default, in --state-dir) or a PKCS#11 "
        "URI (RFC 7512), e.g. 'pkcs11:token=ca?module-path=/usr/lib/softhsm/libsofthsm2.so"
        "&pin-source=file:/etc/attestmesh/pin': keys generated in and never leaving the token",
    )
    cp.add_argument(
        "--store",
        default=os.environ.get("ATTESTMESH_STORE") or None,
        help="the state store: a postgresql:// URL (several replicas share it) or a SQLite file "
        "path; default: $ATTESTMESH_STORE, else <state-dir>/state.sqlite3. Prefer the "
        "environment variable for a URL with a password (argv is visible to every local user)",
    )
    cp.add_argument(
        "--policy", type=Path, help="AttestationPolicy YAML file (local mode, required)"
    )
    cp.add_argument("--mesh-policy", type=Path, help="MeshPolicy YAML file (local mode)")
    cp.add_argument("--workloads", type=Path, help="workload registrations YAML (local mode)")
    cp.add_argument(
        "--allow-unauthenticated-registrations",
        action="store_true",
        help="start although a --workloads entry has no tokenSha256 (anyone reaching the API "
        "could attest in its name; experiments only)",
    )
    cp.add_argument(
        "--attest-burst",
        type=int,
        default=8,
        help="attestations one workload may make at once; then one more per "
        "--attest-refill seconds (default 8; an agent needs about 2 an hour)",
    )
    cp.add_argument("--attest-refill", type=float, default=60.0, help="seconds (default 60)")
    cp.add_argument(
        "--attest-processes",
        type=int,
        default=None,
        help="worker processes that verify evidence and sign certificates (default: one fewer "
        "than the cores, at most 4; 0: threads of the control plane's process). With a CA key in "
        "a PKCS#11 token each worker signs through a session of its own",
    )
    cp.add_argument("--trust-domain", default="attestmesh.local")
    cp.add_argument("--host", default="127.0.0.1")
    cp.add_argument("--api-port", type=int, default=8443)
    cp.add_argument("--xds-port", type=int, default=18000)
    cp.add_argument("--ops-port", type=int, default=9090)
    cp.add_argument("--roots", type=Path, help="directory overriding the bundled vendor roots")
    cp.add_argument(
        "--xds-plaintext",
        action="store_true",
        help="serve xDS without TLS (loopback experiments only; default: mutual TLS)",
    )
    cp.add_argument(
        "--ads-transport",
        choices=("lean", "grpclib"),
        default="lean",
        help="the xDS port's HTTP/2: lean (our own, default) or grpclib (the fallback)",
    )
    cp.add_argument("--amd-kds-url", help="AMD KDS base URL (fetch VCEKs and chains, cached)")
    cp.add_argument("--intel-pcs-url", help="Intel PCS base URL (TCB info, QE identity, CRLs)")
    cp.add_argument("--intel-root-ca-crl-url", help="where the Intel SGX Root CA CRL is served")
    cp.add_argument(
        "--sim-platform-key",
        type=Path,
        action="append",
        help="PEM public key of a simulated platform; enables the sim verifier (tests/demo only)",
    )
    from attestmesh.secret_release import add_arguments as add_secret_arguments

    add_secret_arguments(cp)
    from attestmesh import cp_attest

    cp_attest.add_self_arguments(cp)
    k = cp.add_argument_group(
        "Kubernetes mode",
        "policies from AttestationPolicy/MeshPolicy resources, workloads from injected pods, "
        "agent identity by TokenReview, quarantine as pod label/condition/Event/eviction",
    )
    k.add_argument("--kubernetes", action="store_true", help="run in Kubernetes mode")
    k.add_argument(
        "--kubeconfig", type=Path, help="kubeconfig file (default: the in-cluster service account)"
    )
    k.add_argument("--namespace", help="the control plane's namespace (default attestmesh-system)")
    k.add_argument("--identity", help="this replica's Lease identity (default $POD_NAME/hostname)")
    k.add_argument("--lease-name", help="leader-election Lease (attestmesh-controlplane-leader)")
    k.add_argument("--service-name", help="the control plane's Service (attestmesh-controlplane)")
    k.add_argument("--webhook-host", help="injection webhook address (default 0.0.0.0)")
    k.add_argument("--webhook-port", type=int, help="injection webhook port (9443; 0: off)")
    k.add_argument("--webhook-cert", type=Path, help="webhook serving cert (default: mesh CA)")
    k.add_argument("--webhook-key", type=Path, help="key of --webhook-cert")
    k.add_argument(
        "--webhook-configuration",
        help="MutatingWebhookConfiguration whose caBundle to set to the mesh CA",
    )
    k.add_argument("--probe-host", help="metrics/health listener address (default 0.0.0.0)")
    k.add_argument("--probe-port", type=int, help="/metrics, /healthz, /readyz (no admin API)")
    k.add_argument("--sidecar-image", help="image of the injected agent")
    k.add_argument("--envoy-image", help="image of the injected Envoy")
    k.add_argument(
        "--inject-attest-gpus",
        action="store_const",
        const=True,
        help="injected sev-snp/tdx agents attach the pod's nvidia.com/gpu GPUs (--gpus)",
    )
    k.add_argument(
        "--inject-control-plane-policy",
        metavar="CONFIGMAP",
        help="injected agents check the control plane against the AttestationPolicy in this "
        "ConfigMap (key policy.yaml, in the pod's namespace) before sending evidence",
    )
    from attestmesh.listen import add_arguments as add_listen_arguments

    add_listen_arguments(cp)
    cp.set_defaults(func=_controlplane)

    from attestmesh.agent_cmd import add_agent_parser

    add_agent_parser(sub).set_defaults(func=_agent)

    b = sub.add_parser("bootstrap", help="render the Envoy bootstrap for a sidecar")
    b.add_argument("--node", required=True, help="the workload (registration) name")
    b.add_argument(
        "--xds",
        required=True,
        help="control plane ADS address host:port, or several replicas: host:port,host:port",
    )
    b.add_argument("--sds-socket", type=Path, required=True, help="the agent's SDS Unix socket")
    b.add_argument("--admin-port", type=int, default=15000)
    b.add_argument("--xds-ca", type=Path, help="mesh root bundle (PEM) to verify the control plane")
    b.add_argument(
        "--xds-server-id", help="the control plane's SPIFFE ID (default from the domain)"
    )
    b.add_argument("--trust-domain", default="attestmesh.local")
    b.add_argument(
        "--xds-plaintext", action="store_true", help="no TLS to the control plane (loopback only)"
    )
    b.add_argument(
        "--xds-protocol",
        choices=("delta", "sotw"),
        default="delta",
        help="ADS variant: incremental (delta, default) or state-of-the-world",
    )
    b.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    b.set_defaults(func=_bootstrap)

    d = sub.add_parser("demo", help="frontend <-> backend over attested mTLS, then a quarantine")
    d.add_argument("--workdir", type=Path, help="keep state and Envoy logs here (default: temp)")
    d.add_argument("--hold", action="store_true", help="keep the mesh running until Ctrl-C")
    d.set_defaults(func=_demo)

    q = sub.add_parser("quarantine", help="list, add or release quarantined workloads")
    q.add_argument("action", choices=["list", "add", "release"])
    q.add_argument("name", nargs="?")
    q.add_argument("--reason", default="operator command")
    q.add_argument("--ops-port", type=int, default=9090, help="control plane ops port")
    q.add_argument(
        "--state-dir", type=Path, help="the control plane's state directory (reads ops-token)"
    )
    q.add_argument("--ops-token-file", type=Path, help="file holding the ops token")
    q.add_argument("--json", action="store_true")
    q.set_defaults(func=_quarantine)

    from attestmesh import inspect_cmd, lint, status_cmd, verify_cmd

    verify_cmd.add_parser(sub)
    inspect_cmd.add_parser(sub)
    cp_attest.add_parser(sub)
    status_cmd.add_parser(sub)
    lint.add_parser(sub).set_defaults(func=lint.run)
    from attestmesh import nitro_cmd  # enclave-init, nitro-parent, policy from-eif

    nitro_cmd.add_parsers(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # `verify` gives exit status 2 to invalid evidence; its usage errors are 3.
        command = next((a for a in argv if not a.startswith("-")), None)
        if exc.code == 2 and command == "verify":
            raise SystemExit(3) from None
        raise
    quiet = args.command in ("demo", "verify", "lint", "bootstrap", "quarantine", "inspect")
    quiet = quiet or args.command in ("verify-controlplane", "status")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except PolicyError as exc:
        print("attestmesh: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    except AttestmeshError as exc:
        print(f"attestmesh: {exc.reason}: {exc.detail}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
