"""An attacker's review of the coalesced CRL (issue 7): which revocations wait for the
coalesced re-signing (a renewal's superseded certificate) and which go out with their
transition (a quarantine's, a withdrawn first certificate's)."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from attestmesh.controlplane import service
from certs.ca import CertificateAuthority
from tests.component.test_review_nonce import plane, request
from tests.unit.fixtures_core import (
    NOW,
    Clock,
)
from xds.state import MAX_LIVE_CERTIFICATES, Status


def listed(pem: bytes) -> set[int]:
    return {r.serial_number for r in x509.load_pem_x509_crl(pem)}


async def test_a_withdrawn_first_certificate_is_revoked_at_once(
    tmp_path: Path,
) -> None:
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    first = await cp.attest(request("web-1", cp.challenge()[0]), None)
    assert cp.withdraw(first)  # a first attestation's lost answer: back to pending
    assert cp.status_of("web-1") is Status.PENDING
    assert first.serial in listed(cp.trust.crl_pem)  # no await: with the transition
    assert cp._crl_task is None  # nothing was left for the coalesced re-signing


async def test_a_failed_coalesced_signing_is_retried_not_left_for_the_next_revocation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A superseded certificate waits CRL_COALESCE for its CRL; if that signing fails, the
    next interval signs again (before, it waited for another revocation or the half-day
    refresh, accepted meanwhile)."""
    monkeypatch.setattr(service, "CRL_COALESCE", timedelta(milliseconds=20))
    p = plane(tmp_path, Clock(NOW))
    cp = p.cp
    crl_pem = CertificateAuthority.crl_pem
    failures = []

    def fails_once_off_loop(self: CertificateAuthority, *args: Any, **kwargs: Any) -> bytes:
        if threading.current_thread() is not threading.main_thread() and not failures:
            failures.append(1)
            raise OSError("HSM busy")
        return crl_pem(self, *args, **kwargs)

    monkeypatch.setattr(CertificateAuthority, "crl_pem", fails_once_off_loop)
    issued = [
        await cp.attest(request("web-1", cp.challenge()[0]), None)
        for _ in range(MAX_LIVE_CERTIFICATES + 1)
    ]
    await cp.flushed()
    assert failures == [1]
    assert issued[0].serial in listed(cp.trust.crl_pem)
    assert listed(p.publisher.last_trust.crl_pem) == {issued[0].serial}
