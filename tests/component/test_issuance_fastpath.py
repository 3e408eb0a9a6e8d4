"""The attestation fast path: the nonce offered with each certificate (single use, for that
workload only, bounded to one per workload) and CRLs re-signed off the event loop, coalesced, for
revocations that need not go out with their transition (a renewal's superseded certificate)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from attestmesh.controlplane import service
from certs.ca import CertificateAuthority
from certs.nonces import NonceBook, NonceError
from tests.component.test_review_nonce import plane, request
from tests.unit.fixtures_core import (
    NOW,
    Clock,
)
from xds.state import MAX_LIVE_CERTIFICATES, Status, Trigger


async def test_the_nonce_offered_with_a_certificate_serves_that_workloads_next_attestation_once(
    tmp_path: Path,
) -> None:
    clock = Clock(NOW)
    p = plane(tmp_path, clock)
    cp = p.cp
    first = await cp.attest(request("web-1", cp.challenge()[0]), None)
    assert NonceBook.is_offered(first.next_nonce)
    # as fresh as a challenge: it lives a challenge's lifetime, not until the deadline
    assert first.next_nonce_expires == NOW + cp._nonces.ttl < first.reattest_by
    # another workload cannot use it (and does not spend it)
    await cp.attest(request("web-2", cp.challenge()[0]), None)
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-2", first.next_nonce), None)
    assert info.value.reason == "nonce_not_offered"
    # its workload can, once
    second = await cp.attest(request("web-1", first.next_nonce), None)
    assert second.serial != first.serial and second.next_nonce != first.next_nonce
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-1", first.next_nonce), None)
    assert info.value.reason == "nonce_not_offered"
    # a challenge's nonce cannot be passed off as an offered one (the MAC covers the mark)
    plain = bytearray(cp.challenge()[0])
    plain[0] |= 0x80
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-1", bytes(plain)), None)
    assert info.value.reason == "nonce_unknown"
    # one offered nonce per workload, the latest: bounded by the mesh, not by attestations
    assert set(cp._offered) == {"web-1", "web-2"}
    assert cp._offered["web-1"] == second.next_nonce
    # past its expiry (the re-attestation deadline) it is refused
    clock.now = second.reattest_by
    with pytest.raises(NonceError) as info:
        await cp.attest(request("web-1", second.next_nonce), None)
    assert info.value.reason == "nonce_expired"


async def test_a_withdrawn_answer_takes_its_offered_nonce_back(tmp_path: Path) -> None:
    cp = plane(tmp_path, Clock(NOW)).cp
    first = await cp.attest(request("web-1", cp.challenge()[0]), None)
    second = await cp.attest(request("web-1", first.next_nonce), None)
    assert cp.withdraw(second)  # the answer never reached the agent
    assert "web-1" not in cp._offered
    with pytest.raises(NonceError):
        await cp.attest(request("web-1", second.next_nonce), None)


async def test_a_quarantine_drops_the_offered_nonce(tmp_path: Path) -> None:
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    issued = await cp.attest(request("web-1", cp.challenge()[0]), None)
    cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    cp.release("web-1")
    with pytest.raises(NonceError):
        await cp.attest(request("web-1", issued.next_nonce), None)
    assert "web-1" not in cp._offered
    await cp.attest(request("web-1", cp.challenge()[0]), None)  # a challenge still serves
    assert cp.status_of("web-1") is Status.ATTESTED


async def test_superseded_certificates_reach_the_crl_off_the_loop_in_few_signings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service, "CRL_COALESCE", timedelta(milliseconds=50))
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    signed_on: list[str] = []
    crl_pem = CertificateAuthority.crl_pem

    def counted(self: CertificateAuthority, *args: Any, **kwargs: Any) -> bytes:
        signed_on.append(threading.current_thread().name)
        return crl_pem(self, *args, **kwargs)

    monkeypatch.setattr(CertificateAuthority, "crl_pem", counted)
    renewals = 24
    issued = []
    for _ in range(renewals):  # each past the fourth supersedes (and revokes) the oldest
        issued.append(await cp.attest(request("web-1", cp.challenge()[0]), None))
    superseded = {i.serial for i in issued[:-MAX_LIVE_CERTIFICATES]}
    assert superseded <= cp.state.revoked_serials()  # in the state (and store) at once
    await cp.flushed()  # and in the announced CRL set soon after
    crl = x509.load_pem_x509_crl(p.publisher.last_trust.crl_pem)
    assert {r.serial_number for r in crl} == superseded
    assert cp.trust.crl_pem == p.publisher.last_trust.crl_pem
    # off the loop's thread, and far fewer signings than revocations
    assert signed_on and threading.main_thread().name not in signed_on
    assert len(signed_on) < len(superseded) / 2


async def test_a_quarantines_revocations_go_out_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    issued = await cp.attest(request("web-1", cp.challenge()[0]), None)
    assert cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    # no await: the CRL set in force already lists the quarantined workload's certificate
    crl = x509.load_pem_x509_crl(cp.trust.crl_pem)
    assert crl.get_revoked_certificate_by_serial_number(issued.serial) is not None
    await cp.flushed()
    last = x509.load_pem_x509_crl(p.publisher.last_trust.crl_pem)
    assert last.get_revoked_certificate_by_serial_number(issued.serial) is not None
    assert last.next_update_utc - NOW > timedelta(hours=23)


async def test_a_quarantine_sends_the_gathered_supersessions_at_once(tmp_path: Path) -> None:
    """Renewals' revocations wait for the coalesced re-signing (CRL_COALESCE, seconds); a
    quarantine meanwhile signs a CRL set at once that holds them too."""
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    issued = [await cp.attest(request("web-1", cp.challenge()[0]), None) for _ in range(6)]
    superseded = {i.serial for i in issued[:-MAX_LIVE_CERTIFICATES]}
    assert len(superseded) == 2
    listed = {r.serial_number for r in x509.load_pem_x509_crl(cp.trust.crl_pem)}
    assert not superseded & listed  # gathered, not signed yet
    assert cp._crl_task is not None
    cp.quarantine("web-1", Trigger.OPERATOR, "drill")
    listed = {r.serial_number for r in x509.load_pem_x509_crl(cp.trust.crl_pem)}
    assert {i.serial for i in issued} <= listed
    cp._crl_task.cancel()  # (the test does not wait out the interval)
