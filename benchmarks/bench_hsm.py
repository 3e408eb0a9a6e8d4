"""Attested issuance with the CA key in a PKCS#11 token (SoftHSM2) against the file key, in the
same run: two control planes, identical but for ``key_store``, each attesting sim workloads end
to end in process (nonce, evidence verify, appraisal, leaf signed by the intermediate, state
persisted to SQLite with group commit, as ``attestmesh controlplane`` runs). Rounds alternate
file / token; each round runs ``--n`` attestations from ``--concurrency`` tasks and reports
attestations per second (wall time) and CPU per attestation; the figures are medians over
``--rounds``, and the target (token >= 0.8x file) is judged on the median of the per-round
ratios (both stores run back to back in each round, so each ratio sees one machine load).

    .venv/bin/python -m benchmarks.bench_hsm [--n 150] [--rounds 9] [--concurrency 8]
        [--sign-key session|token]

It also reports what one signature costs inside the control plane (wall and thread CPU time
around the token call, GIL waits included), beside the same signature measured alone;
``--sign-key token`` signs with the token object instead of its session copy (the cost the
copy removes: SoftHSM's file store re-reads a token object on every use).

Needs SoftHSM2 (Debian package softhsm2, installed by .ci/run); the token lives in a temporary
directory."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.utils import Buffer

from attestmesh.controlplane import AttestationLimiter, ControlPlane
from attestmesh.metrics import Metrics
from benchmarks.bench_attest import GOOD, WORKLOADS, NullPublisher
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, spki_der
from certs.evidence import sim
from certs.issuance import AttestRequest
from certs.keystore import FILE_KEYS, FileKeyStore, KeyStore, Pkcs11KeyStore, open_key_store
from certs.policy import parse_policies
from sidecar.agent import build_csr
from tests.softhsm_harness import init_token
from xds.state import Endpoint, MeshState, Registration
from xds.store import GroupCommitStore, SqliteStore

TARGET = 0.8


def make_cp(root: Path, key_store: KeyStore, platform: ec.EllipticCurvePrivateKey) -> ControlPlane:
    policy = parse_policies(
        [
            {
                "apiVersion": "attestmesh.dev/v1alpha1",
                "kind": "AttestationPolicy",
                "metadata": {"name": "p"},
                "spec": {
                    "selector": {"serviceAccounts": [f"w{i}" for i in range(WORKLOADS)]},
                    "allowedTees": ["sim"],
                    "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
                },
            }
        ]
    )
    verifier = sim.SimVerifier([platform.public_key()])
    cp = ControlPlane(
        state=MeshState("bench.local"),
        store=GroupCommitStore(SqliteStore(root / "s.sqlite3")),  # as the control plane runs
        ca=CertificateAuthority.load_or_create(
            root / "ca", "bench.local", datetime.now(UTC), key_store=key_store
        ),
        verifiers={verifier.tee: verifier},
        policies=policy,
        mesh_policies=(),
        metrics=Metrics(),
        publisher=NullPublisher(),
        clock=lambda: datetime.now(UTC),
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
        limiter=AttestationLimiter(burst=10**9),
    )
    cp.register(
        [
            Registration(
                f"w{i}", "default", f"w{i}", f"w{i}", Endpoint("127.0.0.1", 20000 + i), 30000 + i
            )
            for i in range(WORKLOADS)
        ]
    )
    return cp


def requests(cp: ControlPlane, platform: ec.EllipticCurvePrivateKey, n: int) -> list[AttestRequest]:
    """Prepared outside the timed part: the agent's side (key, evidence, CSR) is not the CA's."""
    out = []
    for i in range(n):
        key = ec.generate_private_key(ec.SECP256R1())
        nonce, _ = cp.challenge()
        evidence = sim.build_report(
            platform,
            report_data=expected_report_data(nonce, spki_der(key.public_key())),
            measurement=GOOD,
        )
        out.append(AttestRequest(f"w{i % WORKLOADS}", "sim", evidence, build_csr(key), nonce))
    return out


async def round_rate(
    cp: ControlPlane, reqs: list[AttestRequest], concurrency: int
) -> tuple[float, float]:
    """(attestations per second of wall time, CPU seconds of this process per attestation:
    every thread, SoftHSM's signing included, as it runs in process)."""
    queue = list(reversed(reqs))

    async def worker() -> None:
        while queue:
            await cp.attest(queue.pop(), None)

    t0, c0 = time.perf_counter(), time.process_time()
    async with asyncio.TaskGroup() as tg:
        for _ in range(concurrency):
            tg.create_task(worker())
    await cp.flushed()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return len(reqs) / wall, cpu / len(reqs)


class SignTimer:
    """Wall and thread-CPU time of every token signature (``Pkcs11KeyStore.sign_digest``)."""

    def __init__(self, store: Pkcs11KeyStore | None) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        if store is None:
            return  # filled by TimedFileKey
        inner = store.sign_digest

        def timed(handle: object, digest: bytes) -> bytes:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(handle, digest)
            finally:
                self.wall.append(time.perf_counter() - t0)
                self.cpu.append(time.thread_time() - c0)

        store.sign_digest = timed  # type: ignore[method-assign]

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()

    def medians_us(self) -> tuple[float, float]:
        return statistics.median(self.wall) * 1e6, statistics.median(self.cpu) * 1e6


class TimedFileKey(ec.EllipticCurvePrivateKey):
    """A file key whose signatures are timed like ``SignTimer``'s (``--time-file-key``: the
    file key's signature then goes through Python as the token's does)."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, timer: SignTimer) -> None:
        self._key, self._timer = key, timer

    def sign(self, data: Buffer, signature_algorithm: ec.EllipticCurveSignatureAlgorithm) -> bytes:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return self._key.sign(data, signature_algorithm)
        finally:
            self._timer.wall.append(time.perf_counter() - t0)
            self._timer.cpu.append(time.thread_time() - c0)

    def public_key(self) -> ec.EllipticCurvePublicKey:
        return self._key.public_key()

    @property
    def curve(self) -> ec.EllipticCurve:
        return self._key.curve

    @property
    def key_size(self) -> int:
        return self._key.key_size

    def exchange(self, algorithm: ec.ECDH, peer_public_key: ec.EllipticCurvePublicKey) -> bytes:
        return self._key.exchange(algorithm, peer_public_key)

    def private_numbers(self) -> ec.EllipticCurvePrivateNumbers:
        return self._key.private_numbers()

    def private_bytes(self, encoding: Any, format: Any, encryption_algorithm: Any) -> bytes:
        return self._key.private_bytes(encoding, format, encryption_algorithm)

    def __copy__(self) -> TimedFileKey:
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> TimedFileKey:
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TimedFileKey) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)


class TimedFileKeys(FileKeyStore):
    def __init__(self) -> None:
        self.timer = SignTimer(None)

    def generate(self, role: str) -> ec.EllipticCurvePrivateKey:
        return TimedFileKey(super().generate(role), self.timer)


def alone_us(store: Pkcs11KeyStore, key: object, n: int = 500) -> tuple[float, float]:
    """The same token signature, alone (no control plane around it): median wall, CPU."""
    digest = hashlib.sha256(b"tbs").digest()
    handle = getattr(key, "_signer")  # noqa: B009 (the store's private signing object)
    wall, cpu = [], []
    for _ in range(n):
        t0, c0 = time.perf_counter(), time.thread_time()
        store.sign_digest(handle, digest)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall) * 1e6, statistics.median(cpu) * 1e6


async def main(
    n: int, rounds: int, concurrency: int, sign_key: str = "session", time_file_key: bool = False
) -> float:
    platform = ec.generate_private_key(ec.SECP256R1())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        token = init_token(root / "hsm")
        os.environ["SOFTHSM2_CONF"] = str(token.conf)
        store = open_key_store(f"{token.uri}&x-sign-key={sign_key}")
        assert isinstance(store, Pkcs11KeyStore)
        file_keys = TimedFileKeys() if time_file_key else None
        cps = {
            "file": make_cp(root / "file", file_keys or FILE_KEYS, platform),
            "pkcs11": make_cp(root / "pkcs11", store, platform),
        }
        alone = alone_us(store, cps["pkcs11"]._ca.intermediate.key)
        timer = SignTimer(store)
        for cp in cps.values():  # warm: imports, first signatures, SQLite pages
            await round_rate(cp, requests(cp, platform, 20), concurrency)
        timer.reset()
        if file_keys is not None:
            file_keys.timer.reset()
        rates: dict[str, list[float]] = {k: [] for k in cps}
        cpus: dict[str, list[float]] = {k: [] for k in cps}
        for i in range(rounds):
            order = list(cps.items()) if i % 2 == 0 else list(reversed(cps.items()))
            for name, cp in order:
                rate, cpu = await round_rate(cp, requests(cp, platform, n), concurrency)
                rates[name].append(rate)
                cpus[name].append(cpu)
        inside = timer.medians_us()
        per_attestation = len(timer.wall) / (rounds * n)
        file_inside = file_keys.timer.medians_us() if file_keys is not None else None
        if file_keys is not None:
            key = cps["file"]._ca.intermediate.key
            assert isinstance(key, TimedFileKey)
            file_keys.timer.reset()
            for _ in range(500):
                key.sign(b"tbs", ec.ECDSA(hashes.SHA256()))
            file_alone = file_keys.timer.medians_us()
        for cp in cps.values():
            cp._store.close()
    file_rate, hsm_rate = (statistics.median(rates[k]) for k in ("file", "pkcs11"))
    file_cpu, hsm_cpu = (statistics.median(cpus[k]) * 1e3 for k in ("file", "pkcs11"))
    ratio = hsm_rate / file_rate
    # each round runs both back to back: the ratio within a round sees the same machine load,
    # robust where other work comes and goes (the ratio of the medians above does not)
    paired = statistics.median(h / f for f, h in zip(rates["file"], rates["pkcs11"], strict=True))
    print(
        f"attested issuance, {concurrency} concurrent, median of {rounds} rounds x {n}; "
        f"token signs with its {'session copy' if sign_key == 'session' else 'token object'}"
    )
    print("                                  rate (wall)    ratio   CPU/attestation")
    print(f"  CA key in a file                {file_rate:8.1f} /s    1.00x   {file_cpu:6.2f} ms")
    print(
        f"  CA key in SoftHSM2 (PKCS#11)    {hsm_rate:8.1f} /s    {ratio:.2f}x   {hsm_cpu:6.2f} ms"
    )
    print(
        f"  median of the per-round ratios  {paired:.2f}x   "
        f"target >= {TARGET}x: {'met' if paired >= TARGET else 'MISSED'}"
    )
    print(
        f"  one token signature: inside the control plane {inside[0]:.0f} us wall "
        f"{inside[1]:.0f} us CPU; alone {alone[0]:.0f} us wall {alone[1]:.0f} us CPU; "
        f"{per_attestation:.2f} token signatures per attestation (leaf, EAR, CRLs)"
    )
    if file_inside is not None:
        print(
            f"  one file-key signature: inside the control plane {file_inside[0]:.0f} us wall "
            f"{file_inside[1]:.0f} us CPU; alone {file_alone[0]:.0f} us wall "
            f"{file_alone[1]:.0f} us CPU (--time-file-key: the file key signs through Python)"
        )
    return paired


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=150)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sign-key", choices=("session", "token"), default="session")
    p.add_argument("--time-file-key", action="store_true", help="time the file key's signatures")
    a = p.parse_args()
    asyncio.run(main(a.n, a.rounds, a.concurrency, a.sign_key, a.time_file_key))
