"""Costs of issue 12's additions, each against a peer measured in the same run:

* the EAR (sign + wrap) a leaf carries, against signing the leaf itself;
* re-appraising claims on record after a TCB change (re-evaluate + appraise), per workload,
  against the admission appraisal alone, and the wall time for N workloads;
* verifying a CVM report with one attached H100 report, against the CVM report alone;
* deferring N quarantines after a TCB change (each deadline written into its workload's row,
  one batch, until durable), against quarantining the same N at once (the same rows plus their
  revocations), and a restart's start-up over N rows with deferrals against N without.

Run: python -m benchmarks.bench_beyond [N]   (N workloads for the re-appraisal, default 10000)
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

import tests.unit.evidence.dcap_fixtures as fx
from attestmesh.controlplane import ControlPlane
from attestmesh.metrics import Metrics
from attestmesh.tcb_monitor import reappraise_all
from certs.ca import CertificateAuthority
from certs.ca.claims import encode_claims_extension
from certs.ca.templates import build_leaf
from certs.csr import parse_csr
from certs.ear import build_ear_extension
from certs.evidence.composite import CompositeVerifier, GpuEvidence, gpu_collateral, gpu_nonce
from certs.evidence.dcap import DcapVerifier
from certs.evidence.nvidia_gpu import NvidiaGpuVerifier
from certs.evidence.sev_snp import SevSnpVerifier, parse_amd_chain
from certs.evidence.tdx import TdxVerifier
from certs.policy import OnTcbChange, Rejected, appraise_all, parse_policies
from certs.tcb_reeval import TcbCollateral, TcbFinding
from tests.unit.evidence import test_nvidia as nv
from tests.unit.evidence.test_sev_snp import CHIP, IDBLOCK, SYN_TCB, TCB_RAW, _Amd, _sign
from tests.unit.fixtures_core import RecordingPublisher, csr_pem, policy_doc, record, registration
from tests.unit.fixtures_core import claims as sim_claims
from xds.state import Status, WorkloadState
from xds.store import Batch, GroupCommitStore, SqliteStore


def median_us(fn: Callable[[], object], rounds: int = 7, per: int = 50) -> float:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(per):
            fn()
        samples.append((time.perf_counter() - t) / per * 1e6)
    return statistics.median(samples)


def bench_ear() -> None:
    now = fx.NOW
    with tempfile.TemporaryDirectory() as d:
        ca = CertificateAuthority.load_or_create(Path(d) / "ca", "bench.local", now)
        key = ec.generate_private_key(ec.SECP256R1())
        csr = parse_csr(csr_pem(key))
        c = sim_claims()
        ext = encode_claims_extension(c, "p", now)

        def leaf() -> object:
            return build_leaf(csr, spiffe_id="spiffe://bench.local/ns/a/sa/b",
                              claims_extension=ext, issuer=ca.intermediate, serial=7, now=now,
                              ttl=timedelta(hours=1))  # fmt: skip

        def ear() -> object:
            return build_ear_extension(c, policy="p", spiffe_id="spiffe://bench.local/ns/a/sa/b",
                                       subject_key=key.public_key(), nonce=bytes(32),
                                       issuer=ca.intermediate, now=now)  # fmt: skip

        t_leaf, t_ear = median_us(leaf), median_us(ear)
    print(f"leaf signature (peer)       median {t_leaf:8.1f} us")
    print(f"EAR sign + CMW wrap         median {t_ear:8.1f} us   ratio {t_ear / t_leaf:.2f}x leaf")


def bench_reappraisal(n: int) -> None:
    pki = fx.Pki()
    coll = {"collateral_json": fx.build_collateral(pki, tdx=True)}
    claims = TdxVerifier(pki.root_der).verify(
        fx.build_quote(pki, tdx=True), now=fx.NOW, collateral=coll
    )
    moved = {
        "collateral_json": fx.build_collateral(
            pki, tdx=True,
            levels=[fx.platform_level("UpToDate", tdx=(5, 0, 9) + (0,) * 13),
                    fx.platform_level("OutOfDate", tdx=fx.TDX_TCB)],
        )
    }  # fmt: skip
    v = DcapVerifier(pki.root_der).verify_tcb_collateral(moved, now=fx.NOW)
    assert v.tcb_info is not None and v.qe_identity is not None
    current = TcbCollateral(
        intel_tcb={("tdx", v.tcb_info.fmspc.hex()): v.tcb_info}, intel_qe={"tdx": v.qe_identity}
    )
    policies = parse_policies(
        [
            policy_doc(
                "p", tees=["tdx"], refs={"tdx": {"mrtd": ["91" * 48]}}, onTcbChange="quarantine"
            )
        ]
    )
    items = [(f"w{i}", replace(claims, evidence_sha256=f"{i:064x}"), policies) for i in range(n)]
    t = time.perf_counter()
    findings, admitted = reappraise_all(items, current, fx.NOW)
    wall = time.perf_counter() - t
    assert len(findings) == n and not admitted
    one = items[0]
    t_re = median_us(lambda: reappraise_all([one], current, fx.NOW), per=200)
    t_ap = median_us(lambda: appraise_all(claims, policies, fx.NOW), per=200)
    print(f"admission appraisal (peer)  median {t_ap:8.1f} us per workload")
    print(
        f"TCB re-appraisal            median {t_re:8.1f} us per workload   ratio {t_re / t_ap:.2f}x"
    )
    print(f"re-appraise {n} workloads    {wall * 1e3:8.1f} ms wall ({wall / n * 1e6:.1f} us each)")


def bench_composite() -> None:
    amd = _Amd()
    vkey = ec.generate_private_key(ec.SECP384R1())
    vcek = amd.vcek(vkey, SYN_TCB, CHIP, "Milan-B0")
    bundle, gkey = nv.make_leaf(bytes(range(48)))
    root = bundle[bundle.index(b"-----BEGIN", 10) :]
    rd = bytes(range(64))
    template = bytearray(IDBLOCK.evidence())
    template[0x50:0x90] = rd
    report = _sign(bytes(template), vkey, reported_tcb=TCB_RAW, chip_id=CHIP)
    gpu = GpuEvidence(nv.build_report(gkey, bytes(range(48)), gpu_nonce(rd, 0, 1)), bundle)
    snp = SevSnpVerifier([parse_amd_chain(amd.chain_pem())])
    composite = CompositeVerifier(snp, NvidiaGpuVerifier(root))
    with_gpu = {"vcek": vcek, **gpu_collateral([gpu])}
    composite.verify(report, now=nv.T0, collateral=with_gpu)  # warm the caches
    t_cpu = median_us(lambda: snp.verify(report, now=nv.T0, collateral={"vcek": vcek}), per=20)
    t_both = median_us(lambda: composite.verify(report, now=nv.T0, collateral=with_gpu), per=20)
    print(f"SEV-SNP report (peer)       median {t_cpu:8.1f} us")
    print(f"SEV-SNP + 1 H100            median {t_both:8.1f} us   ratio {t_both / t_cpu:.2f}x")


def _deferral_cp(path: Path, n: int) -> tuple[ControlPlane, list[TcbFinding]]:
    """A control plane on a SQLite database (group commit) holding n attested workloads."""
    now = fx.NOW
    rows = {
        f"w{i}": WorkloadState(registration(f"w{i}", port=10_000 + i % 50_000), Status.ATTESTED,
                               record(), now + timedelta(hours=1))
        for i in range(n)
    }  # fmt: skip
    if not (path / "state.db").exists():
        seed = SqliteStore(path / "state.db")
        seed.write(Batch(upserts=rows))
        seed.close()
    store = GroupCommitStore.open(path / "state.db")
    cp = ControlPlane(
        state=store.load("bench.local"), store=store,
        ca=CertificateAuthority.load_or_create(path / "ca", "bench.local", now), verifiers={},
        policies=(), mesh_policies=(), metrics=Metrics(), publisher=RecordingPublisher(),
        clock=lambda: now, serials=x509.random_serial_number, random_bytes=secrets.token_bytes,
    )  # fmt: skip
    decision = Rejected(("tcb_status_not_accepted: OutOfDate",), "pol", now)
    findings = [
        TcbFinding(name, "ab" * 32, decision, OnTcbChange.QUARANTINE, timedelta(minutes=10))
        for name in rows
    ]
    return cp, findings


async def _durable_ms(cp: ControlPlane, findings: list[TcbFinding]) -> float:
    t = time.perf_counter()
    cp.apply_tcb_findings(findings)
    await cp.flushed()
    return (time.perf_counter() - t) * 1e3


def bench_deferrals(n: int, rounds: int = 4) -> None:
    defer: list[float] = []
    now_q: list[float] = []
    start_d: list[float] = []
    start_p: list[float] = []
    logging.getLogger("attestmesh").setLevel(logging.ERROR)  # one warning per quarantine
    for i in range(rounds):
        with tempfile.TemporaryDirectory() as d:
            a, b = Path(d) / "a", Path(d) / "b"
            a.mkdir()
            b.mkdir()
            cp, findings = _deferral_cp(a, n)
            defer.append(asyncio.run(_durable_ms(cp, findings)))
            assert sum(w.tcb_deferral is not None for w in cp.state.workloads.values()) == n
            cp._store.close()
            cp, findings = _deferral_cp(b, n)
            at_once = [replace(f, grace=timedelta(0)) for f in findings]
            now_q.append(asyncio.run(_durable_ms(cp, at_once)))
            cp._store.close()
            plain = Path(d) / "plain"
            plain.mkdir()
            _deferral_cp(plain, n)[0]._store.close()  # seeded, its CA made: not timed
            order = [(a, start_d), (plain, start_p)]
            for where, out in order if i % 2 == 0 else order[::-1]:  # no order effect
                t = time.perf_counter()
                cp, _ = _deferral_cp(where, n)
                out.append((time.perf_counter() - t) * 1e3)
                cp._store.close()
    md, mq = statistics.median(defer), statistics.median(now_q)
    sd, sp = statistics.median(start_d), statistics.median(start_p)
    print(f"defer {n} TCB quarantines (rows written, durable): {md:.0f} ms "
          f"({md / n * 1e3:.0f} us/workload); quarantining them at once: {mq:.0f} ms; "
          f"ratio {md / mq:.2f}")  # fmt: skip
    print(f"start-up over {n} rows with deferrals: {sd:.0f} ms; without: {sp:.0f} ms; "
          f"ratio {sd / sp:.2f}")  # fmt: skip


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    bench_ear()
    bench_reappraisal(n)
    bench_composite()
    bench_deferrals(n)


if __name__ == "__main__":
    main()
