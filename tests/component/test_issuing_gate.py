"""The issuing gate (service.ISSUING): at most that many attestations are being verified, signed
and decided at once; the others wait before any crypto, and one quarantined while it waited is
refused when its turn comes, unverified and unsigned. Waiting for the store holds no place."""

from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from attestmesh.controlplane import AttestationLimiter, service
from certs.standing import QuarantinedError
from tests.component.test_review_nonce import PLATFORM, HeldStore, request
from tests.polling import until
from tests.unit.fixtures_core import NOW, Clock, make_control_plane, registration
from xds.state import Status, Trigger

_until = partial(until, within=20)

EXTRA = 4


def _plane(tmp_path: Path) -> tuple[Any, list[Any]]:
    regs = [registration(f"w-{i}", port=15000 + i) for i in range(service.ISSUING + EXTRA)]
    p = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM, registrations=regs)
    p.cp._limiter = AttestationLimiter(burst=100)
    return p, regs


async def test_at_most_issuing_attestations_are_verified_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p, regs = _plane(tmp_path)
    cp = p.cp
    crypto = asyncio.Event()
    verifying: list[str] = []
    real = cp._off_loop

    async def held(fn: Any, req: Any, *args: Any) -> Any:
        verifying.append(req.workload)
        await crypto.wait()
        return await real(fn, req, *args)

    monkeypatch.setattr(cp, "_off_loop", held)
    tasks = [
        asyncio.ensure_future(cp.attest(request(r.name, cp.challenge()[0]), None)) for r in regs
    ]
    await _until(lambda: len(verifying) == service.ISSUING)
    await asyncio.sleep(0.3)  # the others stay in the gate while those are verified
    assert len(verifying) == service.ISSUING
    waiting = regs[-1].name
    assert waiting not in verifying
    assert cp.quarantine(waiting, Trigger.OPERATOR, "drill")
    assert cp.status_of(waiting) is Status.QUARANTINED
    crypto.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    refused = outcomes.pop()
    assert isinstance(refused, QuarantinedError)
    assert all(not isinstance(o, BaseException) for o in outcomes)
    assert waiting not in verifying  # refused before verification: nothing was signed for it
    assert len(verifying) == len(regs) - 1


async def test_an_answer_waiting_for_the_store_holds_no_place(tmp_path: Path) -> None:
    p, regs = _plane(tmp_path)
    cp = p.cp
    store = HeldStore(p.store)
    cp._store = store
    tasks = [
        asyncio.ensure_future(cp.attest(request(r.name, cp.challenge()[0]), None)) for r in regs
    ]
    await _until(lambda: len(store.held) == len(regs))  # every one decided, none acknowledged
    assert not any(t.done() for t in tasks)
    store.release()
    for issued in await asyncio.gather(*tasks):
        assert cp.state.get(issued.workload).status is Status.ATTESTED
