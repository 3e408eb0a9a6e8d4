"""The issuing gate (service.ISSUING): at most that many attestations are between verification
and their durable answer; the others wait before any crypto, and one quarantined while it
waited is refused when its turn comes, unverified and unsigned."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from attestmesh.controlplane import AttestationLimiter, service
from certs.standing import QuarantinedError
from tests.component.test_review_nonce import PLATFORM, HeldStore, request
from tests.unit.fixtures_core import NOW, Clock, make_control_plane, registration
from xds.state import Status, Trigger


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(20):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_at_most_issuing_attestations_are_verified_and_waiting_for_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = 4
    regs = [registration(f"w-{i}", port=15000 + i) for i in range(service.ISSUING + extra)]
    p = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM, registrations=regs)
    cp = p.cp
    cp._limiter = AttestationLimiter(burst=100)
    store = HeldStore(p.store)
    cp._store = store
    verified: list[str] = []
    real = service._verify_and_sign

    def counting(req: Any, *args: Any) -> Any:
        verified.append(req.workload)
        return real(req, *args)

    monkeypatch.setattr(service, "_verify_and_sign", counting)
    tasks = [
        asyncio.ensure_future(cp.attest(request(r.name, cp.challenge()[0]), None)) for r in regs
    ]
    await _until(lambda: len(store.held) == service.ISSUING)
    await asyncio.sleep(0.3)  # the others stay in the gate while those wait for the store
    assert len(store.held) == service.ISSUING
    assert len(verified) == service.ISSUING
    waiting = regs[-1].name
    assert waiting not in verified
    assert cp.quarantine(waiting, Trigger.OPERATOR, "drill")
    assert cp.status_of(waiting) is Status.QUARANTINED
    while not all(t.done() for t in tasks):
        store.release()  # (the quarantine's own write too)
        await asyncio.sleep(0.01)
        assert sum(not f.done() for f in store.held) <= service.ISSUING + 1
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    refused = outcomes.pop()
    assert isinstance(refused, QuarantinedError)
    assert all(not isinstance(o, BaseException) for o in outcomes)
    assert waiting not in verified  # refused before verification: nothing was signed for it
    assert len(verified) == len(regs) - 1
