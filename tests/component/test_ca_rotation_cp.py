"""Intermediate CA rotation through the control plane: a real ControlPlane over SqliteStore and
CertificateAuthority in tmp_path, the sim verifier, an injected clock, and the deadline tick
(``check_deadlines``, which serve.py runs every second) as the only driver."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import crypto

import certs.ca as ca_module
from certs.binding import expected_report_data
from certs.ca import (
    PREVIOUS_RETENTION,
    CertificateAuthority,
    activation_time,
    preparation_time,
)
from certs.issuance import AttestRequest
from sidecar.agent import SimEvidenceSource
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    Clock,
    Plane,
    csr_pem,
    make_control_plane,
    new_key,
    policy_doc,
    registration,
    spki,
)
from xds.build import TrustMaterial
from xds.state import Trigger

PLATFORM = ec.generate_private_key(ec.SECP256R1())
POLICY = policy_doc(certificateTTL="1h", reattestationInterval="30m")
EXPIRY = "attestmesh_ca_intermediate_expiry_timestamp_seconds"


def _plane(directory: Path, clock: Clock) -> Plane:
    return make_control_plane(
        directory,
        clock=clock,
        platform_key=PLATFORM,
        policies=[POLICY],
        registrations=[registration("web-1")],
    )


def _ca(plane: Plane) -> CertificateAuthority:
    """The control plane's CA now (it is replaced on every rotation step)."""
    ca = plane.cp.ca
    assert isinstance(ca, CertificateAuthority)
    return ca


async def _attest(plane: Plane) -> list[x509.Certificate]:
    cp = plane.cp
    nonce, _ = cp.challenge()
    key = new_key()
    bound = spki(key)
    evidence = SimEvidenceSource(PLATFORM, MEASUREMENT).collect(
        expected_report_data(nonce, bound), nonce=nonce, spki=bound
    )
    issued = await cp.attest(
        AttestRequest("web-1", evidence.tee, evidence.evidence, csr_pem(key), nonce), None
    )
    assert issued.bundle_pem == _ca(plane).bundle_pem  # the root, always
    chain = x509.load_pem_x509_certificates(issued.chain_pem)
    assert len(chain) == 2 and chain[0].serial_number == issued.serial
    return chain


def _crls(trust: TrustMaterial) -> list[x509.CertificateRevocationList]:
    end = b"-----END X509 CRL-----\n"
    return [x509.load_pem_x509_crl(p + end) for p in trust.crl_pem.split(end) if p.strip()]


def _verify(trust: TrustMaterial, chain: list[x509.Certificate], at: datetime) -> None:
    """OpenSSL, from the published trust material only: the root bundle and the CRL set, the
    leaf's CRL required (Envoy's only_verify_leaf_cert_crl)."""
    store = crypto.X509Store()
    for root in x509.load_pem_x509_certificates(trust.bundle_pem):
        store.add_cert(crypto.X509.from_cryptography(root))
    for crl in _crls(trust):
        store.add_crl(crl)
    store.set_flags(crypto.X509StoreFlags.CRL_CHECK)
    store.set_time(at)
    leaf, *intermediates = chain
    crypto.X509StoreContext(
        store,
        crypto.X509.from_cryptography(leaf),
        [crypto.X509.from_cryptography(c) for c in intermediates],
    ).verify_certificate()


async def test_attest_rotate_attest_two_issuers_under_one_root(tmp_path: Path) -> None:
    clock = Clock(NOW)
    plane = _plane(tmp_path, clock)
    first = _ca(plane).intermediate.cert
    prepare_at, activate_at = preparation_time(first), activation_time(first)
    assert plane.sample(EXPIRY) == first.not_valid_after_utc.timestamp()
    assert len(_crls(plane.cp.trust)) == 1

    # Nothing is due until half the intermediate's lifetime (the tick refreshes the CRLs).
    clock.now = prepare_at - timedelta(seconds=1)
    assert plane.cp.check_deadlines() == []
    assert _ca(plane).prepared is None

    clock.now = prepare_at
    published = len(plane.publisher.published)
    plane.cp.check_deadlines()
    prepared = _ca(plane).prepared
    assert prepared is not None and _ca(plane).intermediate.cert == first
    assert len(plane.publisher.published) == published + 1
    assert plane.publisher.last_trust == plane.cp.trust
    # The prepared intermediate's CRL is published before it signs anything.
    assert [c.issuer for c in _crls(plane.cp.trust)] == [first.subject, prepared.cert.subject]

    clock.now = activate_at - timedelta(minutes=10)
    old_chain = await _attest(plane)
    assert old_chain[1] == first

    clock.now = activate_at
    published = len(plane.publisher.published)
    assert plane.cp.check_deadlines() == []
    ca = plane.cp.ca
    assert ca.intermediate.cert == prepared.cert and ca.previous is not None
    assert ca.previous.cert == first
    assert len(plane.publisher.published) == published + 1
    trust = plane.publisher.last_trust
    assert trust == plane.cp.trust
    crls = _crls(trust)
    assert len(crls) == 2
    assert [c.issuer for c in crls] == [prepared.cert.subject, first.subject]
    assert plane.sample(EXPIRY) == prepared.cert.not_valid_after_utc.timestamp()

    new_chain = await _attest(plane)
    assert new_chain[1] == prepared.cert
    assert old_chain[0].issuer != new_chain[0].issuer  # two intermediates ...
    for chain in (old_chain, new_chain):  # ... under the same root, both valid now
        chain[1].verify_directly_issued_by(ca.root)
        _verify(trust, chain, activate_at + timedelta(minutes=1))

    # Quarantine revokes both live leaves; each is listed in the CRL set and refused.
    assert plane.cp.quarantine("web-1", Trigger.OPERATOR, "test")
    revoked_trust = plane.publisher.last_trust
    assert len(_crls(revoked_trust)) == 2
    for chain in (old_chain, new_chain):
        with pytest.raises(crypto.X509StoreContextError, match="certificate revoked"):
            _verify(revoked_trust, chain, activate_at + timedelta(minutes=1))
    assert plane.cp.release("web-1")

    # A restart keeps the previous intermediate (its leaves are alive).
    plane.store.close()
    plane = _plane(tmp_path, clock)
    previous = _ca(plane).previous
    assert previous is not None and previous.cert == first
    assert len(_crls(plane.cp.trust)) == 2

    # Once its leaves have all expired, the previous intermediate goes and its CRL with it.
    retire_at = activate_at + PREVIOUS_RETENTION
    assert old_chain[0].not_valid_after_utc < retire_at
    clock.now = retire_at
    published = len(plane.publisher.published)
    plane.cp.check_deadlines()
    assert _ca(plane).previous is None
    assert len(plane.publisher.published) == published + 1
    assert [c.issuer for c in _crls(plane.publisher.last_trust)] == [prepared.cert.subject]
    plane.store.close()


async def test_a_failed_rotation_step_is_retried_and_never_stops_the_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock(NOW)
    plane = _plane(tmp_path, clock)
    first = _ca(plane).intermediate.cert
    clock.now = preparation_time(first) - timedelta(seconds=1)
    plane.cp.check_deadlines()  # the CRL refresh, due after months, is not what is tested
    clock.now = preparation_time(first)
    commit = ca_module._commit
    failures = 0

    def disk_full(tmp: Path, path: Path) -> None:
        nonlocal failures
        failures += 1
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ca_module, "_commit", disk_full)
    published = len(plane.publisher.published)
    plane.cp.check_deadlines()  # logged, not raised
    assert failures == 1 and _ca(plane).prepared is None
    assert len(plane.publisher.published) == published
    monkeypatch.setattr(ca_module, "_commit", commit)
    clock.advance(seconds=30)
    plane.cp.check_deadlines()  # still backing off
    assert _ca(plane).prepared is None
    clock.advance(seconds=30)
    plane.cp.check_deadlines()
    assert _ca(plane).prepared is not None
    assert len(plane.publisher.published) == published + 1
    # Leaves are still issued by the signing intermediate throughout.
    assert (await _attest(plane))[1] == first
    plane.store.close()
