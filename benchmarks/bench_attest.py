"""CPU per attestation in the control plane, against the lower bound of its unavoidable
cryptography measured in the same run (sim TEE: evidence signature verify + CSR signature
verify + leaf signature). Run: python -m benchmarks.bench_attest [N]

Then the same with the real process's store (``GroupCommitStore``: one writer thread, group
commit) at 1 and 64 concurrent attestations: CPU per attestation (process, and the event loop's
thread) and how late a 5 ms timer on the loop fires (p50 / p99), which is what /healthz waits
for under load: the verify-and-sign threads hold the GIL for the Python around the crypto
(``cryptography`` releases it while it signs and verifies), so the loop waits for it behind
them."""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane import AttestationLimiter, ControlPlane
from attestmesh.metrics import Metrics
from certs.binding import expected_report_data
from certs.ca import CertificateAuthority, spki_der
from certs.evidence import sim
from certs.issuance import AttestRequest
from certs.policy import parse_policies
from sidecar.agent import build_csr
from xds.build import TrustMaterial
from xds.cache import SnapshotCache
from xds.meshpolicy import MeshPolicy
from xds.publisher import XdsPublisher
from xds.state import Endpoint, Event, MeshState, Registration
from xds.store import GroupCommitStore, SqliteStore, StateStore

GOOD = bytes.fromhex("a1" * 48)
# attestations cycle over this many workloads: each keeps at most MAX_LIVE_CERTIFICATES live
# certificates, so cycling over two would measure revoking (and re-signing the CRL) every time
WORKLOADS = 128


class NullPublisher:
    def publish(
        self,
        state: MeshState,
        mp: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None:
        pass

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None:
        pass


def make_cp(
    root: Path,
    publisher: object,
    platform: ec.EllipticCurvePrivateKey,
    store: Callable[[Path], StateStore] = SqliteStore,
) -> ControlPlane:
    now = datetime.now(UTC)
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
    cp = ControlPlane(
        state=MeshState("bench.local"),
        store=store(root / "s.sqlite3"),
        ca=CertificateAuthority.load_or_create(root / "ca", "bench.local", now),
        verifiers={
            sim.SimVerifier([platform.public_key()]).tee: sim.SimVerifier([platform.public_key()])
        },
        policies=policy,
        mesh_policies=(),
        metrics=Metrics(),
        publisher=publisher,  # type: ignore[arg-type]
        clock=lambda: datetime.now(UTC),
        serials=x509.random_serial_number,
        random_bytes=secrets.token_bytes,
        # measures cost, not the per-workload budget
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


def request(cp: ControlPlane, platform: ec.EllipticCurvePrivateKey, i: int) -> AttestRequest:
    key = ec.generate_private_key(ec.SECP256R1())
    nonce, _ = cp.challenge()
    evidence = sim.build_report(
        platform,
        report_data=expected_report_data(nonce, spki_der(key.public_key())),
        measurement=GOOD,
    )
    return AttestRequest(f"w{i % WORKLOADS}", "sim", evidence, build_csr(key), nonce)


async def measure(cp: ControlPlane, platform: ec.EllipticCurvePrivateKey, n: int) -> list[float]:
    cpu: list[float] = []
    for i in range(n):
        req = request(cp, platform, i)
        t0 = time.process_time()
        await cp.attest(req, None)
        cpu.append(time.process_time() - t0)
    return cpu


@dataclass(frozen=True)
class Concurrent:
    concurrency: int
    cpu_ms: float  # process CPU per attestation (every thread)
    loop_ms: float  # the event loop thread's CPU per attestation
    lag_p50_ms: float  # how late a 5 ms timer on the loop fired
    lag_p99_ms: float


async def concurrent(
    cp: ControlPlane, platform: ec.EllipticCurvePrivateKey, n: int, concurrency: int
) -> Concurrent:
    """``n`` attestations, ``concurrency`` at a time (requests made beforehand), while a probe
    measures how late the loop runs a 5 ms timer."""
    reqs = [request(cp, platform, i) for i in range(n)]
    sem = asyncio.Semaphore(concurrency)
    loop = asyncio.get_running_loop()
    lags: list[float] = []

    async def one(req: AttestRequest) -> None:
        async with sem:
            await cp.attest(req, None)

    async def probe() -> None:
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            lags.append(loop.time() - t - 0.005)

    task = loop.create_task(probe())
    c0, t0 = time.process_time(), time.thread_time()
    await asyncio.gather(*(one(r) for r in reqs))
    c1, t1 = time.process_time(), time.thread_time()
    task.cancel()
    lags.sort()
    return Concurrent(
        concurrency,
        (c1 - c0) / n * 1e3,
        (t1 - t0) / n * 1e3,
        lags[len(lags) // 2] * 1e3,
        lags[min(len(lags) - 1, len(lags) * 99 // 100)] * 1e3,
    )


def lower_bound(
    platform: ec.EllipticCurvePrivateKey, ca: CertificateAuthority, n: int
) -> list[float]:
    """The unavoidable crypto: verify the evidence signature, verify the CSR, sign the leaf."""
    key = ec.generate_private_key(ec.SECP256R1())
    data = b"x" * 300
    sig = platform.sign(data, ec.ECDSA(hashes.SHA256()))
    csr = x509.load_pem_x509_csr(build_csr(key))
    tbs = b"y" * 600
    out = []
    for _ in range(n):
        t0 = time.process_time()
        platform.public_key().verify(sig, data, ec.ECDSA(hashes.SHA256()))
        assert csr.is_signature_valid
        ca.intermediate.key.sign(tbs, ec.ECDSA(hashes.SHA256()))
        out.append(time.process_time() - t0)
    return out


async def main(n: int) -> None:
    platform = ec.generate_private_key(ec.SECP256R1())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cp_null = make_cp(root / "a", NullPublisher(), platform)
        cp_xds = make_cp(root / "b", XdsPublisher(SnapshotCache()), platform)
        await measure(cp_null, platform, 20)  # warm
        await measure(cp_xds, platform, 20)
        null = await measure(cp_null, platform, n)
        xds = await measure(cp_xds, platform, n)
        bound = lower_bound(platform, cp_null.ca, n)
        cp_group = make_cp(
            root / "c", XdsPublisher(SnapshotCache()), platform, GroupCommitStore.open
        )
        await cp_group.flushed()
        await concurrent(cp_group, platform, 100, 8)  # warm
        levels = [await concurrent(cp_group, platform, max(n, 500), c) for c in (1, 64)]
    med_b = statistics.median(bound) * 1e3
    print(f"CPU per attestation (sim TEE, median of {n}, process time)")
    print(f"  lower bound: evidence verify + CSR verify + leaf sign  {med_b:7.3f} ms  1.00x")
    for label, xs in (("control plane, state persisted (SQLite)      ", null),
                      ("  + xDS publisher (a renewal rebuilds nothing)", xds)):  # fmt: skip
        m = statistics.median(xs) * 1e3
        print(f"  {label}{m:7.3f} ms  {m / med_b:5.2f}x")
    print("group commit (the real process's store), concurrent attestations:")
    for lv in levels:
        print(
            f"  {lv.concurrency:3d} at a time: {lv.cpu_ms:6.3f} ms CPU each "
            f"({lv.cpu_ms / med_b:5.2f}x; loop thread {lv.loop_ms:.3f} ms), a 5 ms timer "
            f"late by p50 {lv.lag_p50_ms:.1f} / p99 {lv.lag_p99_ms:.1f} ms"
        )


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
