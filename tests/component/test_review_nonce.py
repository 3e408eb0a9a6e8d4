"""An attacker's review of the attestation fast path (issue 7): the offered nonce against
races with a quarantine, a restart and a mismatched binding."""

from __future__ import annotations

import asyncio
import base64
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.controlplane import AttestationLimiter
from attestmesh.controlplane.http import build_app, public_error
from certs.binding import expected_report_data
from certs.errors import AttestmeshError
from certs.evidence import sim
from certs.issuance import AttestRequest, EvidenceRejected
from certs.nonces import NonceBook, NonceError
from certs.standing import QuarantinedError
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    Clock,
    csr_pem,
    make_control_plane,
    new_key,
    registration,
    spki,
)
from xds.state import Status, Trigger, quarantine, release
from xds.store import Batch

PLATFORM = ec.generate_private_key(ec.SECP256R1())


class _Any:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)


ANY_DETAIL: Any = _Any()


def request(name: str, nonce: bytes, *, bound_to: bytes | None = None) -> AttestRequest:
    """An attestation presenting ``nonce`` whose evidence binds ``bound_to`` (default: it)."""
    key = new_key()
    report = expected_report_data(bound_to if bound_to is not None else nonce, spki(key))
    evidence = sim.build_report(PLATFORM, report_data=report, measurement=MEASUREMENT)
    return AttestRequest(name, "sim", evidence, csr_pem(key), nonce)


def plane(tmp_path: Path, clock: Clock) -> Any:
    p = make_control_plane(
        tmp_path,
        clock=clock,
        platform_key=PLATFORM,
        registrations=[registration("web-1"), registration("web-2", port=15002)],
    )
    p.cp._limiter = AttestationLimiter(burst=100)
    return p


class HeldStore:
    """Writes commit at once but are acknowledged only when the test releases them (a slow
    group commit): what the control plane does while an answer waits for durability."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.held: list[asyncio.Future[None]] = []

    def write(self, batch: Batch) -> asyncio.Future[None]:
        self._inner.write(batch)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        return fut

    def release(self) -> None:
        for fut in self.held:
            if not fut.done():
                fut.set_result(None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_an_attestation_racing_a_quarantine_gets_no_certificate_and_no_nonce(
    tmp_path: Path,
) -> None:
    """Quarantined while its answer waits for durability: the certificate it would carry is
    revoked by the quarantine, and neither it nor a nonce for the next attestation is handed
    out (a nonce offered after the quarantine would outlive it, into a release)."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    store = HeldStore(p.store)
    cp._store = store
    task = asyncio.ensure_future(cp.attest(request("web-1", cp.challenge()[0]), None))
    while not store.held:  # verified, signed and recorded; waiting for the store
        await asyncio.sleep(0.01)
    serial = cp.state.get("web-1").certificates[-1].serial
    assert cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    store.release()
    with pytest.raises(QuarantinedError) as info:
        await task
    assert info.value.reason == "quarantined"
    assert "web-1" not in cp._offered
    assert serial in cp.state.revoked_serials()
    store.release()  # (the quarantine's own write)


async def test_an_attestation_quarantined_while_it_is_verified_is_refused(
    tmp_path: Path,
) -> None:
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    first = await cp.attest(request("web-1", cp.challenge()[0]), None)
    off_loop = cp._off_loop

    async def then_quarantined(fn: Any, *args: Any) -> Any:
        result = await off_loop(fn, *args)
        cp.quarantine("web-1", Trigger.OPERATOR, "during verification")
        return result

    cp._off_loop = then_quarantined
    with pytest.raises(QuarantinedError):
        await cp.attest(request("web-1", first.next_nonce), None)
    assert "web-1" not in cp._offered
    assert cp.status_of("web-1") is Status.QUARANTINED
    assert cp.state.get("web-1").certificates == ()


async def test_an_offered_nonce_is_refused_cleanly_after_a_restart(tmp_path: Path) -> None:
    """Offered nonces are not persisted: the restarted control plane has a new key, refuses
    one as unknown (the agent's cue to ask for a challenge), and a challenge still serves."""
    p = plane(tmp_path, Clock(NOW))
    issued = await p.cp.attest(request("web-1", p.cp.challenge()[0]), None)
    await p.cp.flushed()
    p.store.close()
    again = make_control_plane(tmp_path, clock=Clock(NOW), platform_key=PLATFORM)
    cp = again.cp
    assert cp.status_of("web-1") is Status.ATTESTED
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-1", issued.next_nonce), None)
    assert info.value.reason == "nonce_unknown"
    renewed = await cp.attest(request("web-1", cp.challenge()[0]), None)
    assert NonceBook.is_offered(renewed.next_nonce)


async def test_the_offered_nonce_is_bound_into_the_evidence_like_a_challenges(
    tmp_path: Path,
) -> None:
    """Evidence binding another nonce (the challenge's, an older offered one) does not pass
    with the offered one, nor the reverse; the offered nonce is spent by the attempt."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    first = await cp.attest(request("web-1", cp.challenge()[0]), None)
    challenge = cp.challenge()[0]
    with pytest.raises(EvidenceRejected) as info:
        await cp.attest(request("web-1", first.next_nonce, bound_to=challenge), None)
    assert info.value.reason == "binding_mismatch"
    with pytest.raises(NonceError):  # one use, whatever the outcome
        await cp.attest(request("web-1", first.next_nonce), None)
    second = await cp.attest(request("web-1", cp.challenge()[0]), None)
    with pytest.raises(EvidenceRejected) as info:
        await cp.attest(request("web-1", cp.challenge()[0], bound_to=second.next_nonce), None)
    assert info.value.reason == "binding_mismatch"
    assert cp.status_of("web-1") is Status.ATTESTED  # a refused request quarantines nothing
    refused = p.sample(
        "attestmesh_attestations_total", tee="sim", result="rejected", reason="binding_mismatch"
    )
    assert refused == 2


async def test_a_quarantine_adopted_from_another_replica_drops_the_offered_nonce(
    tmp_path: Path,
) -> None:
    """Another replica quarantined the workload, then an operator released it there: this
    replica adopts both rows and the nonce it offered before does not outlive them (the
    released workload attests with a challenge)."""
    clock = Clock(NOW)
    p = plane(tmp_path, clock)
    cp = p.cp
    issued = await cp.attest(request("web-1", cp.challenge()[0]), None)
    mine = cp.state
    elsewhere, _ = quarantine(mine, "web-1", Trigger.OPERATOR, "on replica b", NOW)
    revoked = elsewhere.revocations[len(mine.revocations) :]
    p.store.write(Batch({"web-1": elsewhere.get("web-1")}, frozenset(), revoked))  # replica b
    cp.adopt_rows({"web-1": elsewhere.get("web-1")}, revoked)
    assert "web-1" not in cp._offered
    assert issued.serial in cp.state.revoked_serials()
    released, _ = release(elsewhere, "web-1", NOW)
    p.store.write(Batch({"web-1": released.get("web-1")}))
    cp.adopt_rows({"web-1": released.get("web-1")})
    assert cp.status_of("web-1") is Status.PENDING
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-1", issued.next_nonce), None)
    assert info.value.reason == "nonce_not_offered"
    await cp.attest(request("web-1", cp.challenge()[0]), None)
    assert cp.status_of("web-1") is Status.ATTESTED


def body(req: AttestRequest) -> dict[str, object]:
    return {
        "workload": req.workload,
        "tee": req.tee,
        "evidence": base64.b64encode(req.evidence).decode(),
        "csr": req.csr_pem.decode(),
        "nonce": base64.b64encode(req.nonce).decode(),
    }


async def test_every_offered_nonce_refusal_is_answered_and_counted_by_its_reason(
    tmp_path: Path,
) -> None:
    """Over HTTP: a replayed renewal, another workload's offered nonce, a forged one and an
    expired one each get 400 with their own reason, counted per endpoint; none spends the
    nonce its workload holds."""
    clock = Clock(NOW)
    p = plane(tmp_path, clock)
    async with TestClient(TestServer(build_app(p.cp, p.metrics), host="127.0.0.1")) as client:

        async def post(path: str, req: AttestRequest) -> tuple[int, dict[str, str]]:
            resp = await client.post(path, json=body(req))
            return resp.status, await resp.json()

        status, first = await post("/v1/attest", request("web-1", p.cp.challenge()[0]))
        assert status == 200
        offered = base64.b64decode(first["next_nonce"])
        status, _ = await post("/v1/attest", request("web-2", p.cp.challenge()[0]))
        assert status == 200
        stolen = request("web-2", offered)  # web-2 presents web-1's nonce
        assert await post("/v1/renew", stolen) == (400, {
            "error": "nonce_not_offered", "detail": ANY_DETAIL,
        })  # fmt: skip
        renewal = request("web-1", offered)
        status, second = await post("/v1/renew", renewal)
        assert status == 200  # web-1's nonce was not spent by web-2's attempt
        status, replayed = await post("/v1/renew", renewal)  # the same request again
        assert (status, replayed["error"]) == (400, "nonce_not_offered")
        forged = bytearray(base64.b64decode(second["next_nonce"]))
        forged[1] ^= 1
        status, refused = await post("/v1/renew", request("web-1", bytes(forged)))
        assert (status, refused["error"]) == (400, "nonce_unknown")
        clock.now = datetime.fromisoformat(second["next_nonce_expires_at"])
        late = request("web-1", base64.b64decode(second["next_nonce"]))
        status, refused = await post("/v1/renew", late)
        assert (status, refused["error"]) == (400, "nonce_expired")
    assert p.rejections("renew", "nonce_not_offered") == 2
    assert p.rejections("renew", "nonce_unknown") == 1
    assert p.rejections("renew", "nonce_expired") == 1


async def test_one_workload_cannot_fill_the_replay_set_past_its_attestation_budget(
    tmp_path: Path,
) -> None:
    """Challenges are free and stateless; each attest request puts its nonce in the replay set
    (bounded, shared by the mesh: when full every workload gets nonce_capacity). A workload
    looping on a valid (or stolen) token must be stopped by its own budget before its nonces
    are remembered, or it refuses attestations mesh-wide."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    cp._limiter = AttestationLimiter(burst=3)
    cp._nonces = NonceBook(max_consumed=10)
    reasons = []
    for _ in range(30):
        garbage = AttestRequest("web-2", "sim", b"junk", request("web-2", bytes(32)).csr_pem,
                                cp.challenge()[0])  # fmt: skip
        with pytest.raises(Exception) as info:
            await cp.attest(garbage, None)
        reasons.append(getattr(info.value, "reason", ""))
    assert reasons.count("too_many_attestations") == 27
    assert cp._nonces.consumed <= 3
    issued = await cp.attest(request("web-1", cp.challenge()[0]), None)  # not nonce_capacity
    assert cp.status_of("web-1") is Status.ATTESTED and issued.serial


async def test_a_failing_listener_does_not_stop_a_decision_or_an_adoption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A listener (the TCB index, the Kubernetes adapter) that raises is logged; the
    quarantine it listened to is still persisted and announced, here and when adopted."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    await cp.attest(request("web-1", cp.challenge()[0]), None)
    await cp.attest(request("web-2", cp.challenge()[0]), None)

    def broken(*args: object) -> None:
        raise RuntimeError("listener bug")

    cp.add_state_listener(broken)
    cp.add_adoption_listener(broken)
    assert cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    await cp.flushed()
    assert p.publisher.last_state.get("web-1").status is Status.QUARANTINED
    assert p.store.load(cp.state.trust_domain).get("web-1").status is Status.QUARANTINED
    mine = cp.state
    elsewhere, _ = quarantine(mine, "web-2", Trigger.OPERATOR, "on replica b", NOW)
    revoked = elsewhere.revocations[len(mine.revocations) :]
    p.store.write(Batch({"web-2": elsewhere.get("web-2")}, frozenset(), revoked))
    cp.adopt_rows({"web-2": elsewhere.get("web-2")}, revoked)
    await asyncio.sleep(0)  # (an adoption is announced on the loop's next turn)
    assert p.publisher.last_state.get("web-2").status is Status.QUARANTINED
    assert "listener bug" in caplog.text


async def test_a_certificate_revoked_while_its_answer_waits_is_not_handed_out(
    tmp_path: Path,
) -> None:
    """Quarantined and released while the answer waits for the store: the workload may attest
    again, but the certificate it waited for is revoked; it is refused (409), not delivered."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    store = HeldStore(p.store)
    cp._store = store
    task = asyncio.ensure_future(cp.attest(request("web-1", cp.challenge()[0]), None))
    while not store.held:
        await asyncio.sleep(0.01)
    assert cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    assert cp.release("web-1")
    store.release()
    with pytest.raises(AttestmeshError) as info:
        await task
    assert info.value.reason == "certificate_revoked"
    assert public_error(info.value)[0] == 409
    assert "web-1" not in cp._offered
    store.release()
