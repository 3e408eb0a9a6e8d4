"""Intermediate CA rotation through the control plane: a real ControlPlane over SqliteStore and
CertificateAuthority in tmp_path, the sim verifier, an injected clock, and the deadline tick
(``check_deadlines``, which serve.py runs every second) as the only driver."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import crypto

import certs.ca.slots as slots_module
from certs.binding import expected_report_data
from certs.ca import (
    PREVIOUS_RETENTION,
    CertificateAuthority,
    activation_time,
    build_server_cert,
    preparation_time,
)
from certs.issuance import AttestRequest
from sidecar.agent import SimEvidenceSource
from tests.integration.envoy_harness import free_port, run_envoy
from tests.unit.fixtures_core import (
    MEASUREMENT,
    NOW,
    TRUST_DOMAIN,
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
        registrations=[registration("web-1"), registration("web-2", port=15002)],
    )


def _ca(plane: Plane) -> CertificateAuthority:
    """The control plane's CA now (it is replaced on every rotation step)."""
    ca = plane.cp.ca
    assert isinstance(ca, CertificateAuthority)
    return ca


async def _attest(plane: Plane, workload: str = "web-1") -> list[x509.Certificate]:
    return (await _attest_with_key(plane, workload))[0]


async def _attest_with_key(
    plane: Plane, workload: str = "web-1"
) -> tuple[list[x509.Certificate], ec.EllipticCurvePrivateKey]:
    cp = plane.cp
    nonce, _ = cp.challenge()
    key = new_key()
    bound = spki(key)
    evidence = SimEvidenceSource(PLATFORM, MEASUREMENT).collect(
        expected_report_data(nonce, bound), nonce=nonce, spki=bound
    )
    issued = await cp.attest(
        AttestRequest(workload, evidence.tee, evidence.evidence, csr_pem(key), nonce), None
    )
    assert issued.bundle_pem == _ca(plane).bundle_pem  # the root, always
    chain = x509.load_pem_x509_certificates(issued.chain_pem)
    assert len(chain) == 2 and chain[0].serial_number == issued.serial
    return chain, key


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
    commit = slots_module.commit
    failures = 0

    def disk_full(tmp: Path, path: Path) -> None:
        nonlocal failures
        failures += 1
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slots_module, "commit", disk_full)
    published = len(plane.publisher.published)
    plane.cp.check_deadlines()  # logged, not raised
    assert failures == 1 and _ca(plane).prepared is None
    assert len(plane.publisher.published) == published
    monkeypatch.setattr(slots_module, "commit", commit)
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


# ---------------------------------------------------------------------------------------------
# a real Envoy with the published trust material


def _tls_listener(port: int, admin: int, server: Path, trust: Path, crl_pem: bytes) -> Any:
    """A listener requiring client certificates, validated as the mesh-trust secret says
    (xds.build.build_mesh_trust: the root bundle, the CRL set, only_verify_leaf_cert_crl)."""
    router = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
    hcm = (
        "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
        "HttpConnectionManager"
    )
    tls = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200}}
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "mtls",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": hcm,
                                        "stat_prefix": "mtls",
                                        "http_filters": [
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {"@type": router},
                                            }
                                        ],
                                        "route_config": {
                                            "virtual_hosts": [
                                                {"name": "v", "domains": ["*"], "routes": [route]}
                                            ]
                                        },
                                    },
                                }
                            ],
                            "transport_socket": {
                                "name": "envoy.transport_sockets.tls",
                                "typed_config": {
                                    "@type": tls,
                                    "require_client_certificate": True,
                                    "common_tls_context": {
                                        "tls_certificates": [
                                            {
                                                "certificate_chain": {
                                                    "filename": str(server.with_suffix(".pem"))
                                                },
                                                "private_key": {
                                                    "filename": str(server.with_suffix(".key"))
                                                },
                                            }
                                        ],
                                        "validation_context": {
                                            "trusted_ca": {"filename": str(trust)},
                                            "crl": {"inline_string": crl_pem.decode()},
                                            "only_verify_leaf_cert_crl": True,
                                        },
                                    },
                                },
                            },
                        }
                    ],
                }
            ]
        },
    }


def _write_credential(
    path: Path, chain: list[x509.Certificate], key: ec.EllipticCurvePrivateKey
) -> Path:
    path.with_suffix(".pem").write_bytes(
        b"".join(c.public_bytes(serialization.Encoding.PEM) for c in chain)
    )
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


async def _request(port: int, trust: Path, client: Path) -> str:
    """The status line Envoy answers with, or "refused" when the handshake fails."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(trust)
    ctx.load_cert_chain(client.with_suffix(".pem"), client.with_suffix(".key"))
    try:
        async with asyncio.timeout(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: mesh\r\nConnection: close\r\n\r\n")
                line = await reader.readline()
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
    except (ssl.SSLError, ConnectionError):
        return "refused"
    return line.decode().strip() or "refused"


@pytest.mark.integration
async def test_a_real_envoy_accepts_leaves_of_both_intermediates_with_the_crl_set(
    tmp_path: Path,
) -> None:
    # Envoy checks validity against the wall clock: the CA is created so that its
    # intermediate's activation time falls five minutes ago.
    wall = datetime.now(UTC).replace(microsecond=0)
    clock = Clock(wall - timedelta(days=243, hours=8, minutes=5))
    plane = _plane(tmp_path, clock)
    first = _ca(plane).intermediate.cert
    assert wall - timedelta(minutes=6) < activation_time(first) < wall
    clock.now = preparation_time(first)
    plane.cp.check_deadlines()
    clock.now = activation_time(first) - timedelta(minutes=10)
    old = await _attest_with_key(plane, "web-1")
    doomed = await _attest_with_key(plane, "web-2")
    clock.now = activation_time(first)
    plane.cp.check_deadlines()
    new = await _attest_with_key(plane, "web-1")
    assert {old[0][1], doomed[0][1]} == {first} and new[0][1] != first
    assert plane.cp.quarantine("web-2", Trigger.OPERATOR, "revoke its old-intermediate leaf")
    trust_material = plane.publisher.last_trust
    assert len(_crls(trust_material)) == 2
    plane.store.close()

    trust = tmp_path / "root.pem"
    trust.write_bytes(trust_material.bundle_pem)
    server_key = new_key()
    server_cert = build_server_cert(
        _ca(plane),
        server_key,
        spiffe_id=f"spiffe://{TRUST_DOMAIN}/ns/default/sa/server",
        dns_names=["localhost"],
        ips=["127.0.0.1"],
        serial=1,
        now=wall,
        ttl=timedelta(hours=1),
    )
    signer = _ca(plane).issuer_of(server_cert).cert
    server = _write_credential(tmp_path / "server", [server_cert, signer], server_key)
    clients = {
        name: _write_credential(tmp_path / name, chain, key)
        for name, (chain, key) in {"old": old, "new": new, "revoked": doomed}.items()
    }
    current_crl_only = _crls(trust_material)[0].public_bytes(serialization.Encoding.PEM)
    seen = {}
    for label, crl_pem in (("set", trust_material.crl_pem), ("current only", current_crl_only)):
        port, admin = free_port(), free_port()
        bootstrap = _tls_listener(port, admin, server, trust, crl_pem)
        async with run_envoy(f"envoy-{admin}", bootstrap, tmp_path, admin):
            seen[label] = {n: await _request(port, trust, c) for n, c in clients.items()}
    ok = "HTTP/1.1 200 OK"
    assert seen["set"] == {"old": ok, "new": ok, "revoked": "refused"}
    # Without the previous intermediate's CRL its live leaves are refused: why it is kept.
    assert seen["current only"] == {"old": "refused", "new": ok, "revoked": "refused"}
