"""The injected containers run commands the real ``attestmesh`` CLI accepts.

For every TEE: mutate a pod, apply the patch, expand ``$(VAR)`` from each container's env as the
kubelet does, and hand the commands to ``attestmesh.cli.build_parser()``; every file a command
names must be provided by one of that container's mounts. The bootstrap command is run for real
through ``attestmesh.cli.main`` (the mounted paths mapped to temporary files) and the file it
writes is checked with ``envoy --mode validate``. The agent's startup probe (``attestmesh agent
--check``) is run against a real SDS socket, before and after it serves a certificate.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trustme
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from attestmesh.agent_cmd import _source, check_agent_args
from attestmesh.cli import build_parser
from attestmesh.cli import main as cli_main
from attestmesh.serve import control_plane_spiffe_id
from certs.errors import AttestmeshError
from sidecar.agent import SimEvidenceSource
from sidecar.inject import (
    AGENT_CONTAINER,
    BOOTSTRAP_CONTAINER,
    ENVOY_CONTAINER,
    SDS_SOCKET,
    TRUST_BUNDLE,
    TRUST_CONFIGMAP,
    Decision,
    InjectConfig,
    SimInjection,
    mutate,
)
from sidecar.sds import LocalSds, check_sds, start_sds
from tests.integration.envoy_harness import validate_config
from tests.unit.inject.jsonpatch import apply_patch
from xds.kube import workload_name

MEASUREMENT = "a1" * 48
CFG = InjectConfig(
    trust_domain="mesh.example",
    sim=SimInjection(MEASUREMENT),
    xds_address="attestmesh-controlplane.attestmesh-system.svc:18000",
)
NS, NAME = "shop", "web-7d9f-x2k4q"
# nitro: no agent in the pod (it runs in the enclave): tests/unit/nitro/test_inject_nitro.py
AGENT_TEES = {"sim": "sim", "sev-snp": "sev-snp", "tdx": "tsm", "sgx": "sgx"}


def injected_pod(tee: str, cfg: InjectConfig = CFG) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "labels": {"attestmesh.dev/inject": "enabled"},
            "annotations": {"attestmesh.dev/tee": tee},
        },
        "spec": {
            "serviceAccountName": "web",
            "containers": [{"name": "app", "image": "web:1", "ports": [{"containerPort": 8080}]}],
        },
    }
    result = mutate(pod, {}, cfg)
    assert result.decision is Decision.INJECTED, result.message
    out: dict[str, Any] = apply_patch(pod, [dict(op) for op in result.patch])
    return out


def containers(pod: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    spec = pod["spec"]
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec["containers"]]}


def kubelet_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet resolves it (values and metadata fieldRefs)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in ("metadata.name", "metadata.namespace"), path
            env[e["name"]] = pod["metadata"][path.split(".")[1]]
    return env


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args: $$ escapes, unknown names stay as is."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _REF.sub(one, arg)


def command(pod: Mapping[str, Any], name: str) -> list[str]:
    c = containers(pod)[name]
    env = kubelet_env(pod, c)
    argv = [expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
    assert not any("$(" in a for a in argv), argv
    return argv


def probe_command(pod: Mapping[str, Any], name: str) -> list[str]:
    # the kubelet does NOT expand $(VAR) in exec probes: the probe must not need it
    argv: list[str] = containers(pod)[name]["startupProbe"]["exec"]["command"]
    assert not any("$(" in a for a in argv), argv
    return argv


def mounted(pod: Mapping[str, Any], container: str, path: str) -> dict[str, Any]:
    """The volume providing ``path`` in ``container``; the file itself must be projected."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for m in containers(pod)[container].get("volumeMounts", []):
        prefix = m["mountPath"].rstrip("/") + "/"
        if not path.startswith(prefix):
            continue
        rel, vol = path[len(prefix) :], volumes[m["name"]]
        if "configMap" in vol or "secret" in vol:
            items = (vol.get("configMap") or vol.get("secret"))["items"]
            assert rel in [i["path"] for i in items], f"{path}: not projected by {m['name']}"
        elif "projected" in vol:
            paths = [s["serviceAccountToken"]["path"] for s in vol["projected"]["sources"]]
            assert rel in paths, f"{path}: not projected by {m['name']}"
        else:
            assert "emptyDir" in vol
        return {**vol, "readOnly": m.get("readOnly", False)}
    raise AssertionError(f"{container}: nothing mounted at {path}")


def cli(argv: list[str]) -> Any:
    assert argv[0] == "attestmesh", argv
    return build_parser().parse_args(argv[1:])


@pytest.mark.parametrize("tee", list(AGENT_TEES))
def test_injected_agent_command_is_accepted_by_the_cli(tee: str) -> None:
    pod = injected_pod(tee)
    args = cli(command(pod, AGENT_CONTAINER))
    check_agent_args(args)
    assert args.command == "agent" and not args.check
    assert args.workload == workload_name(NS, NAME)  # = the registration name
    assert args.control_plane == CFG.control_plane_url
    assert args.tee == AGENT_TEES[tee]
    trust = mounted(pod, AGENT_CONTAINER, str(args.ca_bundle))
    assert trust["configMap"]["name"] == TRUST_CONFIGMAP and trust["readOnly"]
    token = mounted(pod, AGENT_CONTAINER, str(args.token_file))
    assert token["projected"]["sources"][0]["serviceAccountToken"]["audience"] == "attestmesh"
    assert "emptyDir" in mounted(pod, ENVOY_CONTAINER, str(args.sds_socket))
    assert str(args.sds_socket) == SDS_SOCKET
    if tee == "sim":
        secret = mounted(pod, AGENT_CONTAINER, str(args.sim_platform_key))
        assert secret["secret"]["secretName"] == "attestmesh-sim-platform" and secret["readOnly"]
        assert args.sim_measurement == MEASUREMENT
    else:
        assert args.sim_platform_key is None and args.sim_measurement is None

    probe = cli(probe_command(pod, AGENT_CONTAINER))
    check_agent_args(probe)
    assert probe.command == "agent" and probe.check and probe.sds_socket == args.sds_socket


def test_injected_sim_agent_builds_its_evidence_source(tmp_path: Path) -> None:
    args = cli(command(injected_pod("sim"), AGENT_CONTAINER))
    key = tmp_path / "platform-key.pem"
    key.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    args.sim_platform_key = key  # the Secret's file, here
    source = _source(args)
    assert isinstance(source, SimEvidenceSource)
    assert source.measurement == bytes.fromhex(MEASUREMENT)


def test_agent_without_its_flags_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["agent", "--sds-socket", "/nonexistent/sds.sock", "--tee", "sim"]) == 2
    err = capsys.readouterr().err
    assert "--control-plane" in err and "--workload" in err and "--ca-bundle" in err


@pytest.mark.parametrize("tee", list(AGENT_TEES))
def test_injected_bootstrap_command_is_accepted_by_the_cli(tee: str) -> None:
    pod = injected_pod(tee)
    argv = command(pod, BOOTSTRAP_CONTAINER)
    args = cli(argv)
    assert args.command == "bootstrap"
    assert args.node == workload_name(NS, NAME)  # Envoy node id = registration name
    assert args.xds == CFG.xds_address and not args.xds_plaintext
    assert args.trust_domain == CFG.trust_domain
    assert args.admin_port == CFG.envoy_admin_port
    assert str(args.xds_ca) == TRUST_BUNDLE
    trust = mounted(pod, BOOTSTRAP_CONTAINER, str(args.xds_ca))
    assert trust["configMap"]["name"] == TRUST_CONFIGMAP and trust["readOnly"]
    # Envoy reads the CA file and the bootstrap at run time: both mounted there too
    assert mounted(pod, ENVOY_CONTAINER, str(args.xds_ca))["readOnly"]
    out = mounted(pod, BOOTSTRAP_CONTAINER, str(args.output))
    assert "emptyDir" in out and not out["readOnly"]
    envoy = containers(pod)[ENVOY_CONTAINER]["command"]
    assert envoy[envoy.index("-c") + 1] == str(args.output)
    assert "emptyDir" in mounted(pod, ENVOY_CONTAINER, str(args.output))
    # the sds socket Envoy dials is the one the agent serves
    agent = cli(command(pod, AGENT_CONTAINER))
    assert args.sds_socket == agent.sds_socket


def run_bootstrap(pod: Mapping[str, Any], tmp: Path) -> dict[str, Any]:
    """Run the injected bootstrap command via attestmesh.cli.main, mounts mapped into ``tmp``;
    return the bootstrap it wrote (paths mapped back, as Envoy in the pod would see them)."""
    argv = command(pod, BOOTSTRAP_CONTAINER)
    args = cli(argv)
    ca = trustme.CA()
    local = {
        str(args.xds_ca): tmp / "root.pem",
        str(args.output): tmp / "bootstrap.json",
        str(args.sds_socket): tmp / "sds.sock",
    }
    local[str(args.xds_ca)].write_bytes(ca.cert_pem.bytes())
    assert cli_main([str(local.get(a, a)) for a in argv[1:]]) == 0
    text = local[str(args.output)].read_text()
    doc: dict[str, Any] = json.loads(text)
    return doc


def test_bootstrap_written_by_the_injected_command(tmp_path: Path) -> None:
    doc = run_bootstrap(injected_pod("sev-snp"), tmp_path)
    assert doc["node"]["id"] == workload_name(NS, NAME)
    admin = doc["admin"]["address"]["socket_address"]
    assert admin == {"address": "127.0.0.1", "port_value": CFG.envoy_admin_port}  # loopback only
    (xds,) = [c for c in doc["static_resources"]["clusters"] if "transport_socket" in c]
    tls = xds["transport_socket"]["typed_config"]["common_tls_context"]
    validation = tls["validation_context"]
    assert validation["trusted_ca"]["filename"] == str(tmp_path / "root.pem")
    server_id = control_plane_spiffe_id(CFG.trust_domain)  # the xDS server Envoy accepts
    assert validation["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"exact": server_id}}
    ]
    assert server_id.startswith("spiffe://mesh.example/")


def test_injected_bootstrap_passes_envoy_validate_with_an_ip_xds_address(
    tmp_path: Path,
) -> None:
    cfg = InjectConfig(trust_domain="mesh.example", xds_address="10.96.12.34:18000")
    run_bootstrap(injected_pod("tdx", cfg), tmp_path)
    result = validate_config(tmp_path / "bootstrap.json")
    assert result.returncode == 0, result.stderr[-2000:]


def test_injected_bootstrap_passes_envoy_validate_with_the_service_name(
    tmp_path: Path,
) -> None:
    run_bootstrap(injected_pod("tdx"), tmp_path)
    result = validate_config(tmp_path / "bootstrap.json")
    assert result.returncode == 0, result.stderr[-2000:]


# --- the agent's startup probe against a real SDS socket --------------------------------------


def self_signed(now: datetime, days: int = 1) -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "web")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem


@pytest.fixture
async def sds() -> AsyncIterator[tuple[LocalSds, Path]]:
    d = Path(tempfile.mkdtemp(prefix="sds-", dir="/tmp"))  # short: Unix socket path limit
    server = None
    try:
        local = LocalSds()
        server = await start_sds(local, d / "sds.sock")
        yield local, d / "sds.sock"
    finally:
        if server is not None:
            server.close()
            await server.wait_closed()
        shutil.rmtree(d, ignore_errors=True)


async def test_agent_check_probe_waits_for_a_valid_certificate(
    sds: tuple[LocalSds, Path],
) -> None:
    local, path = sds
    now = datetime.now(UTC)
    probe = ["agent", "--check", "--sds-socket", str(path), "--check-timeout", "0.3"]
    # not attested yet: nothing served, the probe fails (exit 1) within its timeout
    with pytest.raises(AttestmeshError) as exc:
        await check_sds(path, now=now, timeout_s=0.3)
    assert exc.value.reason == "sds_not_ready"
    assert await asyncio.to_thread(cli_main, probe) == 1

    chain, key = self_signed(now)
    local.update(chain, key)
    leaf = await check_sds(path, now=now, timeout_s=2)
    assert leaf.public_bytes(serialization.Encoding.PEM) == chain
    assert await asyncio.to_thread(cli_main, probe) == 0  # the exact probe the pod runs
    # a certificate no longer valid does not count
    with pytest.raises(AttestmeshError, match="expired"):
        await check_sds(path, now=now + timedelta(days=2), timeout_s=2)


async def test_agent_check_without_a_socket_fails(tmp_path: Path) -> None:
    with pytest.raises(AttestmeshError) as exc:
        await check_sds(tmp_path / "none.sock", now=datetime.now(UTC), timeout_s=1)
    assert exc.value.reason == "sds_not_ready"
    argv = ["agent", "--check", "--sds-socket", str(tmp_path / "none.sock")]
    assert await asyncio.to_thread(cli_main, argv) == 1
