"""Attestation clients for bench_scale, run as a worker process (``python -m
benchmarks.scale_attest PLATFORM_KEY CA_BUNDLE URL``): the agent's protocol over the HTTPS API
(challenge -> sim evidence bound to a fresh key -> CSR -> /v1/attest), one JSON command per
stdin line, one JSON answer per stdout line.

As ``sidecar.agent`` does, a workload's next attestation binds the ``next_nonce`` its last
answer carried (one request per attestation in steady state); it asks ``/v1/challenge`` only
when it holds none, the one it holds is about to expire, or the server refused it (a nonce
error: then once more with a challenge). ``load`` answers how many of each it sent.

Also drives OpenBao's ``pki/sign/<role>`` the same way (CSRs from the same pool of keys), so both
issuers are loaded by identical client processes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import ssl
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from benchmarks.scale_ads import run
from certs.binding import expected_report_data
from certs.evidence import sim
from sidecar.agent import build_csr

MEASUREMENT = bytes.fromhex("a1" * 48)
# An offered nonce this close to its expiry is not used (the request could arrive after it).
NONCE_MARGIN = timedelta(seconds=2)


class Refused(RuntimeError):
    """The API answered with an error status."""

    def __init__(self, what: str, status: int, body: Any) -> None:
        super().__init__(f"{what} {status}: {body}")
        self.status = status
        self.error = body.get("error") if isinstance(body, dict) else None


class AttestWorker:
    def __init__(self) -> None:
        key_path, ca_path, self.url = sys.argv[1], sys.argv[2], sys.argv[3].rstrip("/")
        # "-": no simulated platform (the worker only drives OpenBao)
        platform = (
            serialization.load_pem_private_key(Path(key_path).read_bytes(), None)
            if key_path != "-"
            else ec.generate_private_key(ec.SECP256R1())
        )
        assert isinstance(platform, ec.EllipticCurvePrivateKey)
        self.platform = platform
        self.ssl = ssl.create_default_context(cafile=ca_path)
        self.session: aiohttp.ClientSession | None = None
        # Keys and CSRs made ahead, outside the measured loops, so that the client processes
        # (which share the machine with the server) spend as little CPU as possible per request;
        # evidence is still made per request: it binds the server's fresh nonce.
        self.keys = [self._key() for _ in range(64)]
        self.next_key = itertools.cycle(self.keys)
        # workload -> (the nonce its last answer offered, base64; its expiry): taken as used
        self.offered: dict[str, tuple[str, datetime]] = {}
        self.challenges = 0  # /v1/challenge requests sent (the rest bound an offered nonce)

    @staticmethod
    def _key() -> tuple[bytes, str, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        spki = key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return spki, build_csr(key).decode(), pem

    def _session(self, limit: int) -> aiohttp.ClientSession:
        """One keep-alive session per worker (connections are reused, as an agent's are)."""
        if self.session is None:
            self.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1024, ssl=self.ssl),
                timeout=aiohttp.ClientTimeout(total=120),
            )
        return self.session

    async def attest(
        self, session: aiohttp.ClientSession, workload: str, token: str, fresh: bool = False
    ) -> Any:
        """One attestation; ``fresh``: a new key (for certificates that are kept and used).
        Binds the nonce the workload's last answer offered when it holds a live one."""
        spki, csr, key_pem = self._key() if fresh else next(self.next_key)
        headers = {"Authorization": f"Bearer {token}"}
        held = self.offered.pop(workload, None)
        if held is not None and held[1] - NONCE_MARGIN > datetime.now(UTC):
            try:
                data = await self._attest(session, workload, headers, spki, csr, held[0])
            except Refused as exc:
                if not str(exc.error).startswith("nonce_"):
                    raise
                # (replaced, dropped, or the server restarted): a challenge, as the agent does
            else:
                return data, key_pem
        async with session.post(self.url + "/v1/challenge", json={}, headers=headers) as r:
            challenge = await r.json(content_type=None)
            if r.status != 200:
                raise Refused("challenge", r.status, challenge)
        self.challenges += 1
        data = await self._attest(session, workload, headers, spki, csr, challenge["nonce"])
        return data, key_pem

    async def _attest(
        self,
        session: aiohttp.ClientSession,
        workload: str,
        headers: dict[str, str],
        spki: bytes,
        csr: str,
        nonce_b64: str,
    ) -> Any:
        nonce = base64.b64decode(nonce_b64)
        report = sim.build_report(
            self.platform, report_data=expected_report_data(nonce, spki), measurement=MEASUREMENT
        )
        body = {
            "workload": workload,
            "tee": "sim",
            "evidence": base64.b64encode(report).decode(),
            "collateral": {},
            "csr": csr,
            "nonce": nonce_b64,
        }
        async with session.post(self.url + "/v1/attest", json=body, headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise Refused("attest", r.status, data)
        offered, expires = data.get("next_nonce"), data.get("next_nonce_expires_at")
        if isinstance(offered, str) and isinstance(expires, str):
            self.offered[workload] = (offered, datetime.fromisoformat(expires))
        return data

    async def attest_all(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Attest every item once; save the chain and key of those with a ``save`` path."""
        session = self._session(int(cmd["concurrency"]))
        sem = asyncio.Semaphore(int(cmd["concurrency"]))
        errors: list[str] = []
        cpu: list[float] = []

        async def one(item: dict[str, Any]) -> None:
            async with sem:
                try:
                    t0 = time.monotonic()
                    data, key_pem = await self.attest(
                        session, item["workload"], item["token"], fresh=True
                    )
                    cpu.append(time.monotonic() - t0)
                except (aiohttp.ClientError, RuntimeError, TimeoutError, KeyError) as exc:
                    errors.append(f"{item['workload']}: {exc!r}")
                    return
                if item.get("save"):
                    base = Path(item["save"])
                    base.with_suffix(".chain.pem").write_text(data["certificate_chain"])
                    base.with_suffix(".key.pem").write_bytes(key_pem)

        await asyncio.gather(*(one(i) for i in cmd["items"]))
        return {
            "ok": len(cmd["items"]) - len(errors),
            "errors": errors[:5],
            "n_errors": len(errors),
            "wall": cpu,
        }

    async def load(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """``concurrency`` loops attesting round-robin over ``items`` until ``duration`` s.

        A workload the server rate-limits (429: it attests too often) leaves the rotation;
        the run ends early when none is left (``seconds`` is then the time until it ended)."""
        c = int(cmd["concurrency"])
        session = self._session(c)
        pool: list[dict[str, Any]] = list(cmd["items"])
        turn = 0
        start = float(cmd.get("start_at", time.monotonic()))  # CLOCK_MONOTONIC: system-wide
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        end = start + float(cmd["duration"])
        done = limited = 0
        errors: list[str] = []
        cpu0 = time.process_time()
        challenges0 = self.challenges
        kind = cmd.get("kind", "attest")

        async def loop_() -> None:
            nonlocal done, limited, turn
            while time.monotonic() < end and pool:
                turn = (turn + 1) % len(pool)
                item = pool[turn]
                try:
                    if kind == "attest":
                        await self.attest(session, item["workload"], item["token"])
                    else:
                        await self.bao_sign(session, cmd)
                    done += 1
                except Refused as exc:
                    if exc.status != 429:
                        errors.append(repr(exc))
                        await asyncio.sleep(0.05)
                        continue
                    limited += 1
                    with contextlib.suppress(ValueError):
                        pool.remove(item)
                except (aiohttp.ClientError, RuntimeError, TimeoutError, KeyError) as exc:
                    errors.append(repr(exc))
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop_() for _ in range(c)))
        return {
            "done": done,
            "seconds": time.monotonic() - start,
            "n_errors": len(errors),
            "errors": errors[:3],
            "rate_limited": limited,
            "pool_exhausted": not pool,
            "client_cpu": time.process_time() - cpu0,
            "challenges": self.challenges - challenges0,
        }

    async def bao_sign(self, session: aiohttp.ClientSession, cmd: dict[str, Any]) -> None:
        _, csr, _ = next(self.next_key)
        body = {"csr": csr, "common_name": "w.bench.local", "ttl": "1h"}
        headers = {"X-Vault-Token": cmd["bao_token"]}
        async with session.post(cmd["bao_url"], json=body, headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status != 200 or "certificate" not in data.get("data", {}):
                raise RuntimeError(f"bao sign {r.status}: {data}")

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["cmd"] == "attest_all":
            return await self.attest_all(cmd)
        if cmd["cmd"] == "load":
            return await self.load(cmd)
        if cmd["cmd"] == "close":
            if self.session is not None:
                await self.session.close()
            return {}
        raise ValueError(cmd["cmd"])


if __name__ == "__main__":
    run(AttestWorker)
