"""Quarantine triggers are classified by where the evidence failed, and several quarantines
decided at once are persisted and announced in one transition."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from certs.binding import expected_report_data
from certs.evidence import sim
from certs.issuance import AttestRequest, EvidenceRejected
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    Clock,
    csr_pem,
    make_control_plane,
    new_key,
    policy_doc,
    registration,
    spki,
)
from xds.state import Status

PLATFORM = ec.generate_private_key(ec.SECP256R1())


async def attest(cp: object, name: str, platform: ec.EllipticCurvePrivateKey) -> None:
    key = new_key()
    nonce, _ = cp.challenge()  # type: ignore[attr-defined]
    evidence = sim.build_report(
        platform, report_data=expected_report_data(nonce, spki(key)), measurement=MEASUREMENT
    )
    await cp.attest(AttestRequest(name, "sim", evidence, csr_pem(key), nonce), None)  # type: ignore[attr-defined]


async def test_failed_verification_accuses_nobody(tmp_path: Path) -> None:
    """Evidence that does not verify (here: not signed by a platform key) is a refused request;
    it cannot quarantine the workload it names (an attacker would choose the failure)."""
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    await attest(plane.cp, "web-1", PLATFORM)
    impostor = ec.generate_private_key(ec.SECP256R1())  # not the configured platform key
    with pytest.raises(EvidenceRejected) as exc:
        await attest(plane.cp, "web-1", impostor)
    assert exc.value.reason == "signature_invalid" and not exc.value.appraisal
    w = plane.cp.state.get("web-1")
    assert w.status is Status.ATTESTED and w.quarantine is None
    assert plane.sample("attestmesh_quarantine_events_total", trigger="verification_failed") in (
        None,
        0.0,
    )


async def test_deadline_quarantines_are_one_transition(tmp_path: Path) -> None:
    clock = Clock(NOW)
    regs = [registration(f"web-{i}", port=15001 + i) for i in range(3)]
    plane = make_control_plane(
        tmp_path, clock=clock, platform_key=PLATFORM, registrations=regs,
        policies=[policy_doc(reattestationInterval="5m")],
    )  # fmt: skip
    for r in regs:
        await attest(plane.cp, r.name, PLATFORM)
    published = len(plane.publisher.published)
    clock.advance(minutes=6)
    late = plane.cp.check_deadlines()
    assert late == ["web-0", "web-1", "web-2"]
    assert len(plane.publisher.published) == published + 1  # persisted and announced once
    assert all(plane.cp.state.get(n).status is Status.QUARANTINED for n in late)
    assert plane.sample("attestmesh_quarantine_events_total", trigger="deadline_missed") == 3.0
    assert len(plane.cp.state.revoked_serials()) == 3
