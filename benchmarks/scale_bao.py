"""OpenBao PKI as bench_scale's peer: ``bao server`` with durable raft storage on loopback (not
``-dev`` in-memory), TLS on its listener like our API, initialised and unsealed, a PKI mount with
an EC P-256 root and a role; clients call ``pki/sign/<role>`` with a fresh CSR each time."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import ipaddress
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from benchmarks.scale_proc import CpuMeter, find_bao


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return cert_path, key_path


@dataclass
class Bao:
    proc: subprocess.Popen[bytes]
    url: str
    token: str
    ca: Path

    @property
    def sign_url(self) -> str:
        return f"{self.url}/v1/pki/sign/bench"

    def meter(self) -> CpuMeter:
        return CpuMeter(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def start_bao(workdir: Path, port: int, cluster_port: int) -> Bao:
    """Start, initialise and unseal OpenBao, and set up its PKI; the caller stops it."""
    (workdir / "raft").mkdir(parents=True, exist_ok=True)
    cert, key = self_signed(workdir)
    url = f"https://127.0.0.1:{port}"
    config = workdir / "bao.hcl"
    config.write_text(
        f"""
storage "raft" {{
  path    = "{workdir / "raft"}"
  node_id = "bench"
}}
listener "tcp" {{
  address       = "127.0.0.1:{port}"
  cluster_address = "127.0.0.1:{cluster_port}"
  tls_cert_file = "{cert}"
  tls_key_file  = "{key}"
}}
api_addr      = "{url}"
cluster_addr  = "https://127.0.0.1:{cluster_port}"
disable_mlock = true
ui            = false
log_level     = "warn"
"""
    )
    log = (workdir / "bao.log").open("ab")
    proc = subprocess.Popen(  # noqa: ASYNC220 (a long-running server, not awaited)
        [str(find_bao()), "server", "-config", str(config)],
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    import ssl

    ctx = ssl.create_default_context(cafile=str(cert))
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=ctx), timeout=aiohttp.ClientTimeout(total=30)
        ) as s:

            async def call(method: str, path: str, body: Any = None, token: str = "") -> Any:
                headers = {"X-Vault-Token": token} if token else {}
                async with s.request(method, url + path, json=body, headers=headers) as r:
                    text = await r.text()
                    if r.status >= 400:
                        raise RuntimeError(f"bao {method} {path}: {r.status} {text[:300]}")
                    return await r.json(content_type=None) if text.strip() else {}

            end = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"bao server exited: {(workdir / 'bao.log').read_text()}")
                try:
                    await call("GET", "/v1/sys/seal-status")
                    break
                except (aiohttp.ClientError, RuntimeError):
                    if time.monotonic() > end:
                        raise
                    await asyncio.sleep(0.1)
            init = await call("POST", "/v1/sys/init", {"secret_shares": 1, "secret_threshold": 1})
            token = init["root_token"]
            await call(
                "POST", "/v1/sys/unseal", {"key": (init.get("keys_base64") or init["keys"])[0]}
            )
            while True:  # raft: wait for this node to be the active leader
                with contextlib.suppress(aiohttp.ClientError, RuntimeError):
                    async with s.get(url + "/v1/sys/health") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > end:
                    raise RuntimeError("bao never became active")
                await asyncio.sleep(0.1)
            await call(
                "POST",
                "/v1/sys/mounts/pki",
                {"type": "pki", "config": {"max_lease_ttl": "87600h"}},
                token,
            )
            await call(
                "POST",
                "/v1/pki/root/generate/internal",
                {"common_name": "bench root", "key_type": "ec", "key_bits": 256, "ttl": "8760h"},
                token,
            )
            await call(
                "POST",
                "/v1/pki/roles/bench",
                {
                    "allow_any_name": True,
                    "enforce_hostnames": False,
                    "key_type": "any",
                    "max_ttl": "24h",
                },
                token,
            )
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    return Bao(proc, url, token, cert)
