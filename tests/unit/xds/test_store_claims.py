"""Appraised claims survive a restart, so a policy change can re-appraise running workloads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from certs.evidence.claims import Claims, Tee
from tests.unit.fixtures_core import NOW, record, registration
from xds.state import IssuedCert, MeshState, record_attestation, register, unregister
from xds.store import SqliteStore


def test_claims_round_trip_through_sqlite(tmp_path: Path) -> None:
    claims = Claims(
        tee=Tee.SEV_SNP,
        measurements={"measurement": "ab" * 48, "host_data": "00" * 32},
        report_data=bytes(range(64)),
        debug=False,
        evidence_sha256="cd" * 32,
        signer="ef" * 48,
        product_id=None,
        svn=4,
        platform_id="12" * 64,
        tcb={"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115},
        tcb_status=None,
        advisories=("INTEL-SA-00289",),
        details={"policy": "0x3001f", "smt_allowed": True, "vmpl": 0},
    )
    s0 = MeshState("mesh.example")
    s1, ev1 = register(s0, registration(), NOW)
    s2, ev2 = record_attestation(
        s1, "web-1", replace(record(), claims=claims), IssuedCert(7, NOW), NOW, NOW
    )
    store = SqliteStore(tmp_path / "s.db")
    store.save(s0, s1, ev1)
    store.save(s1, s2, ev2)
    store.close()
    loaded = SqliteStore(tmp_path / "s.db").load("mesh.example")
    att = loaded.workloads["web-1"].attestation
    assert att is not None and att.claims == claims
    assert loaded == s2


def test_unregister_forgets_the_workload_but_keeps_revocations() -> None:
    s, _ = register(MeshState("mesh.example"), registration(), NOW)
    gone, events = unregister(s, "web-1", NOW)
    assert "web-1" not in gone.workloads and [e.kind.value for e in events] == ["unregistered"]
    assert unregister(gone, "web-1", NOW) == (gone, [])
