"""Attested issuance with the CA key in a PKCS#11 token (SoftHSM2) against the file key, in the
same run: two control planes, identical but for ``key_store``, each attesting sim workloads end
to end in process (nonce, evidence verify, appraisal, leaf signed by the intermediate, state
persisted to SQLite with group commit, as ``attestmesh controlplane`` runs). Rounds alternate
file / token; each round runs ``--n`` attestations from ``--concurrency`` tasks and reports
attestations per second (wall time) and CPU per attestation; the figures are medians over
``--rounds``. Target: token >= 0.8x file.

    .venv/bin/python -m benchmarks.bench_hsm [--n 150] [--rounds 9] [--concurrency 8]

Needs SoftHSM2 (Debian package softhsm2, installed by .ci/run); the token lives in a temporary
directory."""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane import AttestationLimiter, ControlPlane
from attestmesh.metrics import Metrics
from benchmarks.bench_attest import GOOD, WORKLOADS, NullPublisher
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, spki_der
from certs.evidence import sim
from certs.issuance import AttestRequest
from certs.keystore import FILE_KEYS, KeyStore, open_key_store
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


async def main(n: int, rounds: int, concurrency: int) -> float:
    platform = ec.generate_private_key(ec.SECP256R1())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        token = init_token(root / "hsm")
        os.environ["SOFTHSM2_CONF"] = str(token.conf)
        cps = {
            "file": make_cp(root / "file", FILE_KEYS, platform),
            "pkcs11": make_cp(root / "pkcs11", open_key_store(token.uri), platform),
        }
        for cp in cps.values():  # warm: imports, first signatures, SQLite pages
            await round_rate(cp, requests(cp, platform, 20), concurrency)
        rates: dict[str, list[float]] = {k: [] for k in cps}
        cpus: dict[str, list[float]] = {k: [] for k in cps}
        for i in range(rounds):
            order = list(cps.items()) if i % 2 == 0 else list(reversed(cps.items()))
            for name, cp in order:
                rate, cpu = await round_rate(cp, requests(cp, platform, n), concurrency)
                rates[name].append(rate)
                cpus[name].append(cpu)
        for cp in cps.values():
            cp._store.close()
    file_rate, hsm_rate = (statistics.median(rates[k]) for k in ("file", "pkcs11"))
    file_cpu, hsm_cpu = (statistics.median(cpus[k]) * 1e3 for k in ("file", "pkcs11"))
    ratio = hsm_rate / file_rate
    print(f"attested issuance, {concurrency} concurrent, median of {rounds} rounds x {n}")
    print("                                  rate (wall)    ratio   CPU/attestation")
    print(f"  CA key in a file                {file_rate:8.1f} /s    1.00x   {file_cpu:6.2f} ms")
    print(
        f"  CA key in SoftHSM2 (PKCS#11)    {hsm_rate:8.1f} /s    {ratio:.2f}x   {hsm_cpu:6.2f} ms"
        f"   target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'}"
    )
    return ratio


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=150)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--concurrency", type=int, default=8)
    a = p.parse_args()
    asyncio.run(main(a.n, a.rounds, a.concurrency))
