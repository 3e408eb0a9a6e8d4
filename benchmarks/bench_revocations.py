"""Explains what a change costs as revocations pile up, in process (no HTTP, no store I/O):
the pure transitions on a mesh of ``--n`` attested workloads holding R revocations (R over
``--revocations``; superseded certificates are revoked until they expire: a workload that
attests in a loop within its budget adds ~56 an hour).

Per R, the median CPU of:

- a superseding attestation: ``record_attestation`` (the workload's oldest live certificate is
  revoked) and the revocations its batch writes, as ``ControlPlane._apply`` takes them (the
  slice after the ones held before);
- a replica adopting one row another replica wrote (``ControlPlane.adopt_rows``, the change
  feed's path), which should cost what the row costs, not the mesh.

Each is printed against the same at the smallest R (its lower bound: the same transition with
nothing to carry). Run: ``python -m benchmarks.bench_revocations`` (``--n 10000
--revocations 0,20000,200000``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509

from attestmesh.controlplane import ControlPlane
from attestmesh.metrics import Metrics
from benchmarks.bench_attest import NullPublisher
from certs.ca import CertificateAuthority
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    Revocation,
    Status,
    WorkloadState,
    record_attestation,
)
from xds.store import SqliteStore

NOW = datetime(2026, 12, 7, tzinfo=UTC)
LIVE = NOW + timedelta(hours=1)
RECORD = AttestationRecord("sim", {}, "p", "00", NOW)
TRUST_DOMAIN = "bench.local"


def mesh(n: int, revocations: int) -> MeshState:
    """``n`` attested workloads, each holding 4 live certificates, and ``revocations``."""
    workloads = {}
    serial = 1
    for i in range(n):
        reg = Registration(
            f"w{i}", "default", f"sa{i % 16}", f"svc{i % 64}", Endpoint("10.0.0.1", 8080), 9090
        )
        certs = tuple(IssuedCert(serial + k, LIVE) for k in range(4))
        serial += 4
        workloads[reg.name] = WorkloadState(reg, Status.ATTESTED, RECORD, LIVE, certificates=certs)
    revoked = tuple(Revocation(10**9 + k, LIVE, NOW, f"w{k % n}") for k in range(revocations))
    return MeshState(TRUST_DOMAIN, workloads, revoked)


def superseding(state: MeshState, rounds: int) -> list[float]:
    """CPU (us) per superseding attestation and its batch."""
    spent: list[float] = []
    serial = 10**12
    names = list(state.workloads)
    for k in range(rounds):
        name = names[k % len(names)]
        serial += 1
        t0 = time.process_time()
        new, _ = record_attestation(
            state, name, RECORD, IssuedCert(serial, LIVE), LIVE, NOW + timedelta(milliseconds=k)
        )
        added = new.revocations[len(state.revocations) :]
        spent.append((time.process_time() - t0) * 1e6)
        assert len(added) == 1 and added[0].serial < serial
        state = new
    return spent


def adopting(state: MeshState, rounds: int) -> list[float]:
    """CPU (us) for a replica to adopt one row written elsewhere."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cp = ControlPlane(
            state=state,
            store=SqliteStore(root / "s.sqlite3"),
            ca=CertificateAuthority.load_or_create(root / "ca", TRUST_DOMAIN, NOW),
            verifiers={},
            policies=(),
            mesh_policies=(),
            metrics=Metrics(),
            publisher=NullPublisher(),  # type: ignore[arg-type]
            clock=lambda: NOW,
            serials=x509.random_serial_number,
            random_bytes=os.urandom,
        )
        spent: list[float] = []
        names = list(state.workloads)
        for k in range(rounds):
            name = names[k % len(names)]
            w = cp.state.workloads[name]
            row = replace(w, next_attestation_due=NOW + timedelta(minutes=k + 1))
            t0 = time.process_time()
            cp.adopt_rows({name: row})
            spent.append((time.process_time() - t0) * 1e6)
        return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=10_000, help="attested workloads")
    p.add_argument("--revocations", default="0,20000,200000", help="R values, comma-separated")
    p.add_argument("--rounds", type=int, default=400)
    args = p.parse_args()
    sizes = [int(r) for r in args.revocations.split(",")]
    print(f"N = {args.n:,} attested workloads; median CPU of {args.rounds} rounds, in process")
    base: dict[str, float] = {}
    for r in sizes:
        state = mesh(args.n, r)
        figures = {
            "superseding attestation + its batch": statistics.median(
                superseding(state, args.rounds)
            ),
            "a replica adopting one row": statistics.median(adopting(state, args.rounds // 4)),
        }
        for what, us in figures.items():
            base.setdefault(what, us)
            print(f"  R = {r:>7,}: {what:<38} {us:9.1f} us  {us / base[what]:6.1f}x R={sizes[0]:,}")


if __name__ == "__main__":
    main()
