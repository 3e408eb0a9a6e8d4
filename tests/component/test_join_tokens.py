"""Local mode: join tokens are required (issue 8 item 3). A registrations file with an entry
that has no ``tokenSha256`` (anyone who reaches the API could attest, or fail an attestation, in
its name) is a start-up error of the real ``attestmesh controlplane`` process, unless
``--allow-unauthenticated-registrations`` says so explicitly."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import GOOD, NAMES, free_port, join_token, write_config
from attestmesh.serve import ControlPlaneSettings
from certs.binding import expected_report_data
from sidecar.agent import SimEvidenceSource, build_csr, client_ssl_context

PLATFORM = ec.generate_private_key(ec.SECP256R1())


def configure(
    tmp_path: Path, *, tokenless: tuple[str, ...]
) -> tuple[ControlPlaneSettings, dict[str, str]]:
    """The demo's configuration (policy, mesh policy, registrations with join tokens), with
    ``tokenSha256`` removed from the ``tokenless`` entries."""
    pub = tmp_path / "sim.pub.pem"
    pub.write_bytes(
        PLATFORM.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    ports = {n: {k: free_port() for k in ("inbound", "app", "outbound", "admin")} for n in NAMES}
    tokens = {n: join_token(n) for n in NAMES}
    settings = write_config(tmp_path, ports, pub, tokens)
    assert settings.registrations_file is not None
    doc = yaml.safe_load(settings.registrations_file.read_text())
    for item in doc["workloads"]:
        assert item["tokenSha256"] == hashlib.sha256(tokens[item["name"]].encode()).hexdigest()
        if item["name"] in tokenless:
            del item["tokenSha256"]
    settings.registrations_file.write_text(yaml.safe_dump(doc))
    return settings, tokens


def argv(s: ControlPlaneSettings, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "attestmesh.cli", "controlplane",
        "--state-dir", str(s.state_dir), "--policy", str(s.policy_file),
        "--mesh-policy", str(s.mesh_policy_file), "--workloads", str(s.registrations_file),
        "--api-port", str(s.api_port), "--xds-port", str(s.xds_port),
        "--ops-port", str(s.ops_port), "--sim-platform-key", str(s.sim_platform_keys[0]),
        *extra,
    ]  # fmt: skip


def test_a_tokenless_registration_refuses_start_up(tmp_path: Path) -> None:
    settings, _ = configure(tmp_path, tokenless=("backend",))
    proc = subprocess.run(argv(settings), capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[:2] == [
        "attestmesh: invalid configuration:",
        f"  - {settings.registrations_file}: registration backend has no tokenSha256 (anyone "
        "who reaches the API could attest, or fail an attestation, in its name); give it a join "
        "token or pass --allow-unauthenticated-registrations",
    ]
    assert "frontend" not in proc.stderr  # it has its token
    assert not settings.state_dir.exists()  # refused before any state was opened


async def attest(
    session: aiohttp.ClientSession, s: ControlPlaneSettings, bundle: bytes, workload: str,
    token: str | None,
) -> tuple[int, dict[str, object]]:  # fmt: skip
    url = f"https://127.0.0.1:{s.api_port}"
    ssl = client_ssl_context(bundle)
    async with session.post(url + "/v1/challenge", json={}, ssl=ssl) as resp:
        nonce = base64.b64decode((await resp.json())["nonce"])
    key = ec.generate_private_key(ec.SECP256R1())
    spki = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    evidence = SimEvidenceSource(PLATFORM, GOOD).collect(
        expected_report_data(nonce, spki), nonce=nonce, spki=spki
    )
    body = {
        "workload": workload,
        "tee": evidence.tee,
        "evidence": base64.b64encode(evidence.evidence).decode(),
        "csr": build_csr(key).decode(),
        "nonce": base64.b64encode(nonce).decode(),
    }
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(url + "/v1/attest", json=body, ssl=ssl, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_the_flag_starts_it_and_tokens_still_bind_the_others(tmp_path: Path) -> None:
    settings, tokens = configure(tmp_path, tokenless=("backend",))
    log = tmp_path / "controlplane.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv(settings, "--allow-unauthenticated-registrations"),
            stdout=out,
            stderr=out,
            stdin=subprocess.DEVNULL,
        )
    try:
        async with asyncio.timeout(30), aiohttp.ClientSession() as session:
            while True:
                assert proc.poll() is None, log.read_text()
                with contextlib.suppress(aiohttp.ClientError):
                    url = f"http://127.0.0.1:{settings.ops_port}/healthz"
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.05)
            text = log.read_text()
            assert "registration backend has no tokenSha256 (allowed by " in text
            assert "registration frontend has no tokenSha256" not in text

            bundle = (settings.state_dir / "ca" / "root.pem").read_bytes()
            # what the flag allows: the tokenless entry attests without a token
            status, body = await attest(session, settings, bundle, "backend", None)
            assert status == 200, body
            # the others still need their own join token
            for token in (None, tokens["backend"], "guess"):
                status, body = await attest(session, settings, bundle, "frontend", token)
                assert (status, body["error"]) == (401, "identity_invalid"), body
            status, body = await attest(session, settings, bundle, "frontend", tokens["frontend"])
            assert status == 200, body
    finally:
        proc.terminate()
        proc.wait(10)
