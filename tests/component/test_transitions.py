"""The control plane's transitions under group commit: durable before answered, announced once
per commit group, fail-stop on a failed write; bounded records; a lost response taken back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane.http import build_app
from certs.binding import expected_report_data
from certs.errors import AttestmeshError
from certs.evidence import sim
from certs.issuance import AttestRequest
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
from xds.state import MAX_LIVE_CERTIFICATES, Status, Trigger
from xds.store import GroupCommitStore, SqliteStore, StoreError

PLATFORM = ec.generate_private_key(ec.SECP256R1())


def request(cp: Any, name: str = "web-1") -> AttestRequest:
    key = new_key()
    nonce, _ = cp.challenge()
    evidence = sim.build_report(
        PLATFORM, report_data=expected_report_data(nonce, spki(key)), measurement=MEASUREMENT
    )
    return AttestRequest(name, "sim", evidence, csr_pem(key), nonce)


async def test_a_lost_first_attestation_is_taken_back(tmp_path: Path) -> None:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    issued = await plane.cp.attest(request(plane.cp), None)
    assert plane.cp.status_of("web-1") is Status.ATTESTED
    assert plane.cp.withdraw(issued)
    w = plane.cp.state.get("web-1")
    assert w.status is Status.PENDING and w.certificates == ()
    assert issued.serial in plane.cp.state.revoked_serials()
    assert plane.sample("attestmesh_certificates_withdrawn_total") == 1.0
    assert not plane.cp.withdraw(issued)  # once
    # the agent retries and gets a certificate
    again = await plane.cp.attest(request(plane.cp), None)
    assert plane.cp.state.get("web-1").certificates[-1].serial == again.serial


async def test_a_lost_renewal_keeps_the_previous_certificate(tmp_path: Path) -> None:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    first = await plane.cp.attest(request(plane.cp), None)
    lost = await plane.cp.attest(request(plane.cp), None)
    assert plane.cp.withdraw(lost)
    w = plane.cp.state.get("web-1")
    assert w.status is Status.ATTESTED
    assert [c.serial for c in w.certificates] == [first.serial]
    assert lost.serial in plane.cp.state.revoked_serials()
    assert first.serial not in plane.cp.state.revoked_serials()


async def test_withdraw_after_a_quarantine_changes_nothing(tmp_path: Path) -> None:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    issued = await plane.cp.attest(request(plane.cp), None)
    assert plane.cp.quarantine("web-1", Trigger.OPERATOR, "x")
    assert not plane.cp.withdraw(issued)
    assert plane.cp.status_of("web-1") is Status.QUARANTINED


async def test_a_workload_record_does_not_grow_with_how_often_it_attests(tmp_path: Path) -> None:
    clock = Clock(NOW)
    plane = make_control_plane(tmp_path, clock=clock, platform_key=PLATFORM,
                               registrations=[registration()])  # fmt: skip
    serials = []
    for _ in range(8):
        serials.append((await plane.cp.attest(request(plane.cp), None)).serial)
    w = plane.cp.state.get("web-1")
    assert [c.serial for c in w.certificates] == serials[-MAX_LIVE_CERTIFICATES:]
    # the superseded ones are revoked: a quarantine still covers every key that was issued
    assert set(serials[:-MAX_LIVE_CERTIFICATES]) <= plane.cp.state.revoked_serials()
    # a client looping on a valid token runs out of budget (429), and it refills with time
    with pytest.raises(AttestmeshError) as exc:
        await plane.cp.attest(request(plane.cp), None)
    assert exc.value.reason == "too_many_attestations"
    clock.advance(minutes=2)
    await plane.cp.attest(request(plane.cp), None)


def grouped_plane(tmp_path: Path, names: list[str]) -> Any:
    plane = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM,
                               registrations=[registration(n, port=15001 + i)
                                              for i, n in enumerate(names)])  # fmt: skip
    plane.store.close()
    store = GroupCommitStore(SqliteStore(tmp_path / "state.db"))
    plane.cp._store = store  # the same control plane, now behind the group-commit writer
    return plane, store


async def test_attestations_are_durable_before_answered_and_announced_per_group(
    tmp_path: Path,
) -> None:
    names = [f"web-{i}" for i in range(24)]
    plane, store = grouped_plane(tmp_path, names)
    try:
        published = len(plane.publisher.published)
        results = await asyncio.gather(
            *(plane.cp.attest(request(plane.cp, n), None) for n in names)
        )
        # each answer came after its row was durable: another connection sees every serial
        db = sqlite3.connect(tmp_path / "state.db")
        docs = "".join(d for (d,) in db.execute("SELECT doc FROM workloads"))
        db.close()
        assert all(str(r.serial) in docs for r in results)
        assert store.stats().commits < len(names)  # grouped
        await asyncio.sleep(0)
        announcements = len(plane.publisher.published) - published
        assert 1 <= announcements < len(names)  # coalesced per commit group
        last = plane.publisher.last_state
        assert all(last.workloads[n].status is Status.ATTESTED for n in names)
    finally:
        store.close()


async def test_a_failed_write_is_fail_stop(tmp_path: Path) -> None:
    plane, store = grouped_plane(tmp_path, ["web-1", "web-2"])
    try:
        await plane.cp.attest(request(plane.cp, "web-1"), None)
        published = len(plane.publisher.published)
        inner = store._store

        def broken(*args: Any, **kwargs: Any) -> None:
            raise StoreError("store_commit_failed", "disk full")

        inner._commit = broken
        with pytest.raises(StoreError):
            await plane.cp.attest(request(plane.cp, "web-2"), None)
        assert not plane.cp.healthy
        assert len(plane.publisher.published) == published  # nothing announced
        with pytest.raises(AttestmeshError) as exc:
            plane.cp.quarantine("web-1", Trigger.OPERATOR, "x")
        assert exc.value.reason == "store_unavailable"
    finally:
        with contextlib.suppress(Exception):
            store.close()


def slow_commits(store: GroupCommitStore, seconds: float) -> None:
    inner = store._store
    commit = inner._commit

    def slow(*args: Any, **kwargs: Any) -> None:
        time.sleep(seconds)  # the writer thread: a slow disk
        commit(*args, **kwargs)

    inner._commit = slow


def attest_body(req: AttestRequest) -> dict[str, str]:
    return {
        "workload": req.workload,
        "tee": req.tee,
        "evidence": base64.b64encode(req.evidence).decode(),
        "csr": req.csr_pem.decode(),
        "nonce": base64.b64encode(req.nonce).decode(),
    }


async def gone_client(url: str, req: AttestRequest) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(url, json=attest_body(req))


async def eventually_pending(plane: Any) -> None:
    for _ in range(60):
        if plane.cp.status_of("web-1") is Status.PENDING:
            break
        await asyncio.sleep(0.05)
    w = plane.cp.state.get("web-1")
    assert w.status is Status.PENDING and w.certificates == ()
    assert plane.sample("attestmesh_certificates_withdrawn_total") == 1.0
    assert len(plane.cp.state.revoked_serials()) == 1


@pytest.mark.parametrize("cancel_handlers", [True, False])
async def test_a_client_that_went_away_gets_its_issuance_taken_back(
    tmp_path: Path, cancel_handlers: bool
) -> None:
    """The agent times out while the decision is being made durable. Whether the server
    cancels the handler (aiohttp's handler_cancellation) or lets it finish and finds the
    connection gone, the issuance is withdrawn: no attested state holds a key nobody has."""
    plane, store = grouped_plane(tmp_path, ["web-1"])
    slow_commits(store, 0.5)
    runner = web.AppRunner(build_app(plane.cp, plane.metrics), handler_cancellation=cancel_handlers)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        await gone_client(f"http://127.0.0.1:{port}/v1/attest", request(plane.cp))
        await eventually_pending(plane)
        await plane.cp.flushed()
    finally:
        await runner.cleanup()
        store.close()
    # and what is durable agrees: pending after a restart
    reopened = SqliteStore(tmp_path / "state.db")
    try:
        assert reopened.load("x").workloads["web-1"].status is Status.PENDING
    finally:
        reopened.close()


async def test_deadlines_follow_the_latest_attestation(tmp_path: Path) -> None:
    """Deadlines come from a heap, not a scan: a renewal moves the deadline (the old entry
    is dropped when it surfaces), a release or quarantine removes it, a restart rebuilds it."""
    clock = Clock(NOW)
    regs = [registration("web-1"), registration("web-2", port=15002)]
    plane = make_control_plane(tmp_path, clock=clock, platform_key=PLATFORM, registrations=regs,
                               policies=[policy_doc(reattestationInterval="5m")])  # fmt: skip
    await plane.cp.attest(request(plane.cp, "web-1"), None)
    await plane.cp.attest(request(plane.cp, "web-2"), None)
    clock.advance(minutes=3)
    await plane.cp.attest(request(plane.cp, "web-1"), None)  # due now at 8 min
    assert plane.cp.quarantine("web-2", Trigger.OPERATOR, "x")
    assert plane.cp.release("web-2")  # pending: no deadline
    clock.advance(minutes=3)  # 6 min: web-1's first deadline passed, its current one not
    assert plane.cp.check_deadlines() == []
    plane.store.close()
    plane = make_control_plane(tmp_path, clock=clock, platform_key=PLATFORM,
                               policies=[policy_doc(reattestationInterval="5m")])  # fmt: skip
    assert plane.cp.check_deadlines() == []
    clock.advance(minutes=3)  # 9 min
    assert plane.cp.check_deadlines() == ["web-1"]
    assert plane.cp.status_of("web-1") is Status.QUARANTINED
    assert plane.cp.status_of("web-2") is Status.PENDING
