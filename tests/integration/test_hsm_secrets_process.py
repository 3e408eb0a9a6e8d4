"""The real ``attestmesh controlplane`` process with ``--ca-key-store pkcs11:`` (a real SoftHSM2
token) and ``--secret-policy`` against a real OpenBao (``bao server -dev``): an agent attests
over the API (its certificate signed by the token's intermediate), fetches a secret over the
mutual-TLS secret port, sealed to its key, and the same secret over the KBS port (a client
written from the KBS protocol description); a SIGKILL and restart keeps the same root (the keys
stay in the token, the state directory holds references only) and the next release works."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import GOOD, NAMES, free_port, join_token, write_config
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.secrets import FanOut, SecretFetcher
from tests.bao_harness import start_bao
from tests.component.test_kbs import KbsClient
from tests.integration.test_attest_processes import ops_metric
from tests.softhsm_harness import init_token
from tests.unit.test_sealing import _decrypt_jwe

pytestmark = pytest.mark.integration


class Sink:
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        self.chain = cert_chain_pem


async def _start(
    args: list[str], log: Path, ops_port: int, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, stdin=subprocess.DEVNULL, env=env)
    async with asyncio.timeout(30), aiohttp.ClientSession() as session:
        while True:
            assert proc.poll() is None, log.read_text()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{ops_port}/healthz") as r:
                    if r.status == 200:
                        return proc
            await asyncio.sleep(0.05)


async def test_hsm_ca_and_secret_release_through_the_real_process(tmp_path: Path) -> None:
    import os

    token = init_token(tmp_path / "hsm")
    env = {**os.environ, "SOFTHSM2_CONF": str(token.conf)}
    bao = await start_bao(tmp_path / "bao")
    proc: subprocess.Popen[bytes] | None = None
    try:
        await bao.kv_put("demo/db", {"password": "pw-from-bao"})
        bao_token = tmp_path / "bao-token"
        bao_token.write_text(bao.root_token)
        platform = ec.generate_private_key(ec.SECP256R1())
        pub = tmp_path / "sim.pub.pem"
        pub.write_bytes(
            platform.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        ports = {
            n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES
        }
        tokens = {n: join_token(n) for n in NAMES}
        s = write_config(tmp_path, ports, pub, tokens)
        policy = {
            "apiVersion": "attestmesh.dev/v1alpha1",
            "kind": "SecretPolicy",
            "metadata": {"name": "demo", "namespace": "default"},
            "spec": {
                "secrets": [
                    {
                        "name": "db",
                        "kv": {"mount": "secret", "path": "demo/db"},
                        "kbsResource": "demo/key/db",
                    }
                ],
                "rules": [{"from": [{"serviceAccount": "backend"}], "secrets": ["db"]}],
            },
        }
        (tmp_path / "secrets.yaml").write_text(yaml.safe_dump(policy))
        secret_port, kbs_port = free_port(), free_port()
        args = [
            sys.executable, "-m", "attestmesh.cli", "controlplane",
            "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
            "--mesh-policy", str(s.mesh_policy_file), "--workloads", str(s.registrations_file),
            "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
            "--ops-port", str(s.ops_port), "--sim-platform-key", str(pub),
            "--ca-key-store", token.uri,
            "--secret-policy", str(tmp_path / "secrets.yaml"), "--secret-port", str(secret_port),
            "--openbao-url", bao.url, "--openbao-token-file", str(bao_token),
            "--kbs-port", str(kbs_port), "--attest-processes", "1",
        ]  # fmt: skip
        log = tmp_path / "controlplane.log"
        proc = await _start(args, log, s.ops_port, env)
        async with aiohttp.ClientSession() as session, asyncio.timeout(30):
            # its worker process signs through a session of its own with the token's key
            while await ops_metric(session, s.ops_port, "attestmesh_attest_worker_processes") < 1:
                await asyncio.sleep(0.05)
        root_pem = (s.state_dir / "ca" / "root.pem").read_bytes()
        for name in ("root.key", "intermediate.key"):
            assert (s.state_dir / "ca" / name).read_text().startswith("pkcs11:id=")

        async def attest_and_fetch(name: str) -> SecretFetcher:
            fetcher = SecretFetcher(
                url=f"https://127.0.0.1:{secret_port}",
                workload=name,
                secrets=["db"],
                bundle_pem=root_pem,
                directory=tmp_path / name / "secrets",
                tls_dir=tmp_path / name / "tls",
            )
            sink = Sink()
            agent = Agent(
                url=f"https://127.0.0.1:{s.api_port}/",
                workload=name,
                source=SimEvidenceSource(platform, GOOD),
                sink=FanOut(sink, fetcher),
                ssl_context=client_ssl_context(root_pem),
                token=lambda: tokens[name],
                timeout_s=10.0,
            )
            async with aiohttp.ClientSession() as session:
                await agent.attest_once(session)
                await fetcher.fetch_all(session)
            leaf, inter = x509.load_pem_x509_certificates(sink.chain)
            leaf.verify_directly_issued_by(inter)
            inter.verify_directly_issued_by(x509.load_pem_x509_certificate(root_pem))
            return fetcher

        await attest_and_fetch("backend")
        assert (tmp_path / "backend" / "secrets" / "db" / "password").read_text() == "pw-from-bao"
        async with aiohttp.ClientSession() as session:
            signed = 'attestmesh_attest_crypto_total{where="process"}'
            assert await ops_metric(session, s.ops_port, signed) == 1
        frontend = await attest_and_fetch("frontend")
        assert frontend.last_error["db"].reason == "not_allowed"
        assert not (tmp_path / "frontend" / "secrets" / "db").exists()

        # the same secret over the KBS resource protocol, as a CoCo image pull would fetch it
        kbs = KbsClient(f"https://localhost:{kbs_port}", root_pem, platform)
        try:
            _, challenge = await kbs.auth()
            status, problem = await kbs.attest("backend", kbs.evidence(challenge["nonce"], GOOD))
            assert status == 200, problem
            status, jwe = await kbs.resource("demo/key/db")
        finally:
            await kbs.close()
        assert status == 200
        assert json.loads(_decrypt_jwe(jwe, kbs.tee_key)) == {"password": "pw-from-bao"}

        proc.kill()
        proc.wait(10)
        await bao.kv_put("demo/db", {"password": "pw-rotated"})
        proc = await _start(args, log, s.ops_port, env)
        assert (s.state_dir / "ca" / "root.pem").read_bytes() == root_pem
        await attest_and_fetch("backend")
        assert (tmp_path / "backend" / "secrets" / "db" / "password").read_text() == "pw-rotated"
        assert "pw-from-bao" not in log.read_text() and "pw-rotated" not in log.read_text()
        assert bao.root_token not in log.read_text()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        bao.stop()
