"""attestmesh.controlplane.workers.WorkerProcesses: attestations verified and signed in real
worker processes (``python -m certs.offload``), answered on the event loop; a dead worker's
jobs fall back to the caller and the worker is replaced; the control plane uses them when
they are ready and its threads otherwise."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from attestmesh.controlplane.http import public_error
from attestmesh.controlplane.workers import OffloadUnavailable, WorkerLost, WorkerProcesses
from certs import offload
from certs.ca import CertificateAuthority
from certs.evidence.claims import Claims, Collateral, Tee, Verifier
from certs.evidence.sim import SimVerifier, load_platform_public_key
from certs.issuance import AttestRequest, EvidenceRejected
from tests.polling import until
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    OTHER_MEASUREMENT,
    TRUST_DOMAIN,
    Clock,
    make_control_plane,
    new_key,
    registration,
)
from tests.unit.test_offload import NONCE, PLATFORM, PLATFORM_PEM, POLICIES, SPIFFE, sim_request
from xds.state import Status

_until = partial(until, within=60.0, every=0.02)

RECIPE = offload.VerifierRecipe(offload.configured_verifiers, (None, (PLATFORM_PEM,)))


class _SlowSim:
    """A sim verifier that takes ``seconds`` (a job still running when its worker is killed)."""

    def __init__(self, seconds: float) -> None:
        self.inner = SimVerifier([PLATFORM.public_key()])
        self.seconds = seconds

    @property
    def tee(self) -> Tee:
        return Tee.SIM

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        time.sleep(self.seconds)
        return self.inner.verify(evidence, now=now, collateral=collateral)


class _SlowFor(_SlowSim):
    """Slow only for evidence of OTHER_MEASUREMENT (one job hangs, the others do not)."""

    def __init__(self, seconds: float, platform_pem: bytes) -> None:
        self.inner = SimVerifier([load_platform_public_key(platform_pem)])  # (the parent's)
        self.seconds = seconds

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        if OTHER_MEASUREMENT.hex().encode() in evidence:
            time.sleep(self.seconds)
        return self.inner.verify(evidence, now=now, collateral=collateral)


def slow_for_other(seconds: float, platform_pem: bytes) -> Mapping[Tee, Verifier]:
    return {Tee.SIM: _SlowFor(seconds, platform_pem)}


def broken_verifiers() -> Mapping[Tee, Verifier]:
    """A recipe that fails in every worker (its roots unreadable, say)."""
    raise RuntimeError("no verifiers today")


def slow_verifiers(seconds: float) -> Mapping[Tee, Verifier]:
    """A recipe's builder (module level: the worker imports it by name)."""
    return {Tee.SIM: _SlowSim(seconds)}


def _attest(cp: Any, measurement: bytes = MEASUREMENT) -> Any:
    """``cp.attest`` of web-1 with fresh sim evidence bound to a challenge's nonce."""
    nonce, _ = cp.challenge()
    return cp.attest(sim_request(measurement, nonce=nonce), None)


@pytest.fixture
def ca(tmp_path: Path) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(
        tmp_path / "ca", TRUST_DOMAIN, datetime.now(UTC) - timedelta(days=1)
    )


@pytest.fixture
async def procs() -> AsyncIterator[WorkerProcesses]:
    pool = WorkerProcesses(2, RECIPE)
    pool.RESTART_DELAY = 0.05
    pool.start()
    await _until(lambda: len(pool._ready) == 2)
    yield pool
    await pool.aclose()


def _job(ca: CertificateAuthority, req: AttestRequest, serial: int = 5) -> offload.Job:
    material = ca.signing_material()
    assert material is not None
    return offload.Job(req, POLICIES, material, SPIFFE, serial, datetime.now(UTC))


async def test_jobs_run_in_other_processes_and_answer_on_the_loop(
    procs: WorkerProcesses, ca: CertificateAuthority
) -> None:
    pids = {w.process.pid for w in procs._ready}
    assert os.getpid() not in pids and len(pids) == 2
    keys = [new_key() for _ in range(20)]
    answers = await asyncio.gather(
        *(procs.run(_job(ca, sim_request(key=k), serial=100 + i)) for i, k in enumerate(keys))
    )
    for i, (key, (admitted, leaf)) in enumerate(zip(keys, answers, strict=True)):
        cert = x509.load_der_x509_certificate(leaf.der)
        cert.verify_directly_issued_by(ca.intermediate.cert)
        assert cert.public_key() == key.public_key() and leaf.serial == 100 + i
        assert admitted.claims.measurements == {"measurement": MEASUREMENT.hex()}
        assert admitted.policy == POLICIES[0].name
    assert all(not w.waiting for w in procs._ready)  # every answer was taken


async def test_a_refusal_is_raised_as_the_worker_raised_it(
    procs: WorkerProcesses, ca: CertificateAuthority
) -> None:
    with pytest.raises(EvidenceRejected) as info:
        await procs.run(_job(ca, sim_request(OTHER_MEASUREMENT)))
    assert info.value.appraisal and info.value.tee == "sim"
    tampered = sim_request()
    bad = AttestRequest(
        tampered.workload, "sim", tampered.evidence[:-1] + b"\x00", tampered.csr_pem, NONCE
    )
    with pytest.raises(EvidenceRejected) as info:
        await procs.run(_job(ca, bad))
    assert not info.value.appraisal
    assert len(procs._ready) == 2 and procs.restarts == 0  # a refusal harms no worker


async def test_a_killed_worker_fails_its_jobs_to_the_caller_and_is_replaced(
    ca: CertificateAuthority,
) -> None:
    pool = WorkerProcesses(1, offload.VerifierRecipe(slow_verifiers, (30.0,)))
    pool.RESTART_DELAY = 0.05
    pool.start()
    try:
        await _until(lambda: pool.ready)
        (worker,) = pool._ready
        running = asyncio.ensure_future(pool.run(_job(ca, sim_request())))
        await _until(lambda: bool(worker.waiting))
        await asyncio.sleep(0.2)  # it is verifying (for 30 s)
        os.kill(worker.process.pid or 0, signal.SIGKILL)
        with pytest.raises(WorkerLost) as info:  # never run again by the caller
            await asyncio.wait_for(running, 10)
        assert info.value.reason == "attest_worker_failed"
        assert worker not in pool._ready
        await _until(lambda: pool.ready)  # a new process took its place
        assert pool.restarts == 1 and pool._ready[0].process.pid != worker.process.pid
        await _until(lambda: worker.process.returncode == -signal.SIGKILL)  # reaped
    finally:
        await pool.aclose()


async def test_a_hung_worker_is_killed_its_job_lost_and_it_is_replaced(
    ca: CertificateAuthority,
) -> None:
    pool = WorkerProcesses(1, offload.VerifierRecipe(slow_verifiers, (30.0,)))
    pool.RESTART_DELAY, pool.JOB_TIMEOUT = 0.05, 0.5
    pool.start()
    try:
        await _until(lambda: pool.ready)
        (worker,) = pool._ready
        started = time.monotonic()
        jobs = [asyncio.ensure_future(pool.run(_job(ca, sim_request()))) for _ in range(2)]
        for job in jobs:  # the second waited behind the first: both lost with the worker
            with pytest.raises(WorkerLost):
                await job
        assert time.monotonic() - started < 5
        await _until(lambda: worker.process.returncode == -signal.SIGKILL)
        await _until(lambda: pool.ready and pool._ready[0] is not worker)
        assert pool.restarts == 1
    finally:
        await pool.aclose()


async def test_each_job_has_its_own_deadline_and_a_caller_gone_leaves_the_order_intact(
    ca: CertificateAuthority,
) -> None:
    """One watchdog per worker, not a timer per job: a job sent late is not killed at the
    deadline of one answered before it; a caller that went away drops only its own answer."""
    pool = WorkerProcesses(1, offload.VerifierRecipe(slow_for_other, (30.0, PLATFORM_PEM)))
    pool.RESTART_DELAY, pool.JOB_TIMEOUT = 0.05, 1.0
    pool.start()
    try:
        await _until(lambda: pool.ready)
        gone = asyncio.ensure_future(pool.run(_job(ca, sim_request(), serial=1)))
        kept = asyncio.ensure_future(pool.run(_job(ca, sim_request(), serial=2)))
        await asyncio.sleep(0)  # both sent, in this order
        gone.cancel()
        _, leaf = await kept
        assert leaf.serial == 2  # its own answer, not the one whose caller went away
        await asyncio.sleep(0.6)  # the first deadline passes while the slow job runs
        sent = time.monotonic()
        with pytest.raises(WorkerLost, match="did not answer"):
            await pool.run(_job(ca, sim_request(OTHER_MEASUREMENT), serial=3))
        assert 0.8 < time.monotonic() - sent < 5  # its own deadline, a second after it was sent
    finally:
        await pool.aclose()


async def test_workers_that_never_start_are_retried_ever_later(ca: CertificateAuthority) -> None:
    pool = WorkerProcesses(1, offload.VerifierRecipe(broken_verifiers))
    pool.RESTART_DELAY = 0.01
    pool.start()
    try:
        await _until(lambda: pool._failing >= 3)
        assert not pool.ready
        with pytest.raises(OffloadUnavailable):  # the caller verifies on its threads
            await pool.run(_job(ca, sim_request()))
        assert pool.restart_delay() == 0.01 * 2**pool._failing
        pool._failing = 40
        assert pool.restart_delay() == 60.0  # at most a minute apart
    finally:
        await pool.aclose()


def test_a_lost_worker_is_answered_503_retry() -> None:
    status, body = public_error(WorkerLost("the worker process verifying it ended; retry"))
    assert status == 503 and body["error"] == "attest_worker_failed"


async def test_aclose_ends_every_process(ca: CertificateAuthority) -> None:
    pool = WorkerProcesses(2, RECIPE)
    pool.start()
    await _until(lambda: len(pool._ready) == 2)
    processes = [w.process for w in pool._ready]
    await pool.aclose()
    assert all(p.returncode == 0 for p in processes)  # each saw its pipe close and returned
    with pytest.raises(OffloadUnavailable):
        await pool.run(_job(ca, sim_request()))


async def test_the_control_plane_signs_in_a_worker_when_one_is_ready(
    tmp_path: Path, procs: WorkerProcesses
) -> None:
    plane = make_control_plane(
        tmp_path, clock=Clock(NOW), platform_key=PLATFORM, registrations=[registration()]
    )
    cp = plane.cp
    cp._procs = procs  # (what serve passes: processes=...)
    issued = await _attest(cp)
    cert = x509.load_pem_x509_certificate(issued.chain_pem)
    cert.verify_directly_issued_by(plane.ca.intermediate.cert)
    assert plane.sample("attestmesh_attest_crypto_total", where="process") == 1
    assert plane.sample("attestmesh_attest_crypto_total", where="thread") == 0
    # a refusal decided in the worker quarantines as one decided here does
    with pytest.raises(EvidenceRejected):
        await _attest(cp, OTHER_MEASUREMENT)
    assert cp.status_of("web-1") is Status.QUARANTINED
    assert plane.sample("attestmesh_attest_crypto_total", where="process") == 2


async def test_a_job_lost_with_its_worker_fails_the_request_and_records_nothing(
    tmp_path: Path,
) -> None:
    """Evidence that crashes (or hangs) a worker is not verified again in the control plane's
    own process: the request fails (503, the agent retries) and the state does not move."""
    plane = make_control_plane(
        tmp_path, clock=Clock(NOW), platform_key=PLATFORM, registrations=[registration()]
    )
    pool = WorkerProcesses(1, offload.VerifierRecipe(slow_verifiers, (30.0,)))
    pool.RESTART_DELAY = 60.0
    pool.start()
    try:
        await _until(lambda: pool.ready)
        plane.cp._procs = pool
        (worker,) = pool._ready
        before = plane.cp.state.get("web-1")
        attempt = asyncio.ensure_future(_attest(plane.cp))
        await _until(lambda: bool(worker.waiting))
        os.kill(worker.process.pid or 0, signal.SIGKILL)
        with pytest.raises(WorkerLost):
            await attempt
        assert plane.cp.state.get("web-1") == before  # still pending, no certificate
        assert plane.sample("attestmesh_attest_crypto_total", where="lost") == 1
        assert plane.sample("attestmesh_attest_crypto_total", where="thread") == 0
        # with no worker ready the next attempt is verified on a thread, and succeeds
        assert not pool.ready
        assert (await _attest(plane.cp)).serial
        assert plane.sample("attestmesh_attest_crypto_total", where="thread") == 1
    finally:
        await pool.aclose()


async def test_the_control_plane_uses_its_threads_until_a_worker_is_ready(
    tmp_path: Path,
) -> None:
    plane = make_control_plane(
        tmp_path, clock=Clock(NOW), platform_key=PLATFORM, registrations=[registration()]
    )
    plane.cp._procs = pool = WorkerProcesses(1, RECIPE)  # never started
    with pytest.raises(OffloadUnavailable):
        await pool.run(_job(plane.ca, sim_request()))
    issued = await _attest(plane.cp)
    assert issued.serial
    assert plane.sample("attestmesh_attest_crypto_total", where="thread") == 1
    assert plane.sample("attestmesh_attest_crypto_total", where="process") == 0


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def abort(self) -> None:
        self.aborted = True


@pytest.mark.parametrize(
    "answer",
    [b"\x00\x00\x00\x03abc", b"\x7f\xff\xff\xff", b"\xff\xff\xff\xff"],
    ids=["unpicklable", "oversized", "negative"],
)
async def test_an_unreadable_answer_fails_its_job_and_drops_the_worker(
    answer: bytes, ca: CertificateAuthority
) -> None:
    from attestmesh.controlplane.workers import _Worker

    class Process:
        pid = 0

    pool = WorkerProcesses(1, RECIPE)
    pool._closed = True  # (nothing to restart: no process behind this worker)
    worker = _Worker(pool, Process())  # type: ignore[arg-type]
    transport = _Transport()
    worker.connection_made(transport)
    worker.data_received(b"\x00\x00\x00\x05" + offload.READY)
    fut = worker.submit(_job(ca, sim_request()), 10.0)
    worker.data_received(answer)
    assert transport.aborted
    if fut.done():  # (a bad frame header fails every job when the connection is lost)
        with pytest.raises(WorkerLost):
            fut.result()
    worker.connection_lost(None)
    with pytest.raises(WorkerLost):
        fut.result()


async def test_a_ca_key_in_a_pkcs11_token_signs_in_the_worker_through_its_own_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token's key never leaves it: the material carries the token's URI and the key's
    reference, and the worker opens a session of its own (SoftHSM2, the real module)."""
    from certs.keystore import open_key_store
    from tests.softhsm_harness import init_token

    token = init_token(tmp_path / "hsm")
    monkeypatch.setenv("SOFTHSM2_CONF", str(token.conf))  # (the worker inherits it)
    store = open_key_store(token.uri)
    ca = CertificateAuthority.load_or_create(
        tmp_path / "ca", TRUST_DOMAIN, datetime.now(UTC) - timedelta(days=1), key_store=store
    )
    material = ca.signing_material()
    assert material is not None and material.key_store == token.uri
    assert material.key.startswith(b"pkcs11:") and b"PRIVATE KEY" not in material.key
    pool = WorkerProcesses(1, RECIPE)
    pool.start()
    try:
        await _until(lambda: pool.ready)
        key = new_key()
        admitted, leaf = await pool.run(_job(ca, sim_request(key=key), serial=77))
        cert = x509.load_der_x509_certificate(leaf.der)
        cert.verify_directly_issued_by(ca.intermediate.cert)  # signed by the token's key
        assert cert.public_key() == key.public_key() and leaf.serial == 77
        assert admitted.claims.measurements == {"measurement": MEASUREMENT.hex()}
    finally:
        await pool.aclose()
