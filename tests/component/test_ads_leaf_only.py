"""The ADS port accepts an Envoy that presents its leaf alone (the sidecar's
``workload-leaf-cert``): the server's store holds the CA's live intermediates, across rotation.
A leaf of another CA is refused, alone or with its chain."""

from __future__ import annotations

import asyncio
import ssl
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from grpclib.exceptions import StreamTerminatedError
from pydantic.warnings import PydanticDeprecatedSince212

from attestmesh.serve import (
    ControlPlaneSettings,
    XdsTrust,
    _deadlines,
    _xds_tls,
)
from certs.ca import CertificateAuthority, Issuer
from certs.ca.templates import build_leaf
from tests.component.ads_transport import TRANSPORT, TRANSPORTS
from tests.component.test_ads_mtls import ads_server_tls as ads_server
from tests.component.test_ads_mtls import first_response
from tests.unit.fixtures_core import csr_pem, new_key
from tests.unit.xds.meshfixture import TD
from xds.resources import ADS_SERVICE

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)

METHOD = f"/{ADS_SERVICE}/StreamAggregatedResources"
REFUSED = (StreamTerminatedError, ssl.SSLError, ConnectionError)


@pytest.fixture(params=TRANSPORTS, autouse=True)
def _transport(request: pytest.FixtureRequest) -> None:
    TRANSPORT.name = request.param


def client(
    bundle_pem: bytes, issuer: Issuer, tmp: Path, sa: str, *, leaf_only: bool
) -> ssl.SSLContext:
    """A client presenting a leaf for ``sa`` signed by ``issuer``: alone, or with ``issuer``."""
    ctx = ssl.create_default_context(cadata=bundle_pem.decode())
    ctx.set_alpn_protocols(["h2"])
    key = new_key()
    leaf = build_leaf(
        x509.load_pem_x509_csr(csr_pem(key)),
        spiffe_id=f"spiffe://{TD}/ns/default/sa/{sa}",
        claims_extension=b"\x0c\x02{}",
        issuer=issuer,
        serial=x509.random_serial_number(),
        now=datetime.now(UTC),
        ttl=timedelta(minutes=5),
    )
    pem = leaf.public_bytes(serialization.Encoding.PEM)
    (tmp / "c.pem").write_bytes(pem if leaf_only else pem + issuer.pem)
    (tmp / "c.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx.load_cert_chain(tmp / "c.pem", tmp / "c.key")
    return ctx


@pytest.mark.parametrize("leaf_only", [True, False], ids=["leaf-only", "full-chain"])
async def test_a_mesh_leaf_is_accepted_alone_or_with_its_intermediate(
    tmp_path: Path, leaf_only: bool
) -> None:
    async with ads_server(tmp_path) as (port, ca, _ctx):
        ctx = client(ca.bundle_pem, ca.intermediate, tmp_path, "frontend", leaf_only=leaf_only)
        resp = await first_response(port, ctx, "frontend")
        assert resp.resources


@pytest.mark.parametrize("leaf_only", [True, False], ids=["leaf-only", "full-chain"])
async def test_a_leaf_of_a_foreign_ca_is_refused(tmp_path: Path, leaf_only: bool) -> None:
    # the same trust domain and names, another root and intermediate
    foreign = CertificateAuthority.load_or_create(tmp_path / "foreign", TD, datetime.now(UTC))
    async with ads_server(tmp_path) as (port, ca, _ctx):
        # the client trusts the real server; only its own certificate is foreign
        ctx = client(ca.bundle_pem, foreign.intermediate, tmp_path, "frontend", leaf_only=leaf_only)
        with pytest.raises(REFUSED):
            await first_response(port, ctx, "frontend")


async def test_a_rotated_intermediate_is_trusted_once_refreshed(tmp_path: Path) -> None:
    async with ads_server(tmp_path) as (port, ca, server_ctx):
        now = datetime.now(UTC)
        prepared = ca.prepare(now)
        assert prepared.prepared is not None
        new = prepared.prepared
        # not in the store yet: a leaf it signed, presented alone, does not chain
        with pytest.raises(REFUSED):
            await first_response(
                port, client(ca.bundle_pem, new, tmp_path, "frontend", leaf_only=True), "frontend"
            )
        trust = XdsTrust(server_ctx)
        trust.refresh(prepared)  # the tick after the preparation, long before it signs
        rotated = prepared.activate(now)
        trust.refresh(rotated)  # the same certificates: nothing new, nothing refused
        for issuer in (rotated.intermediate, rotated.previous):
            assert issuer is not None
            ctx = client(ca.bundle_pem, issuer, tmp_path, "frontend", leaf_only=True)
            assert (await first_response(port, ctx, "frontend")).resources


async def test_a_leaf_under_an_expired_intermediate_in_the_store_is_refused(
    tmp_path: Path,
) -> None:
    """The store's intermediates end chains (partial chains); their validity is still checked.
    A retired intermediate stays in the store: once expired it vouches for nothing, not even a
    leaf whose own dates are fine (one made with its key after it retired)."""
    async with ads_server(tmp_path) as (port, ca, server_ctx):
        now = datetime.now(UTC)
        old = ca.prepare(now - timedelta(days=400)).prepared
        assert old is not None and old.cert.not_valid_after_utc < now
        server_ctx.load_verify_locations(cadata=old.pem.decode())
        key = new_key()
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(old.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(f"spiffe://{TD}/ns/default/sa/frontend")]
                ),
                critical=True,
            )
            .sign(old.key, hashes.SHA256())
        )
        (tmp_path / "f.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
        (tmp_path / "f.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        ctx = ssl.create_default_context(cadata=ca.bundle_pem.decode())
        ctx.set_alpn_protocols(["h2"])
        ctx.load_cert_chain(tmp_path / "f.pem", tmp_path / "f.key")
        with pytest.raises(REFUSED):
            await first_response(port, ctx, "frontend")


async def test_the_deadline_tick_loads_a_rotated_ca_into_the_ads_context(tmp_path: Path) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, datetime.now(UTC))
    ctx = _xds_tls(ca)
    assert len(ctx.get_ca_certs()) == 2  # the root and the signing intermediate
    stop = asyncio.Event()

    class Plane:
        def __init__(self) -> None:
            self.ca = ca

        def check_deadlines(self) -> list[str]:
            self.ca = self.ca.prepare(datetime.now(UTC))  # as the leader's rotation would
            return []

        async def recover_store(self) -> None:
            stop.set()

    settings = ControlPlaneSettings(
        state_dir=tmp_path, trust_domain=TD, deadline_check=timedelta(0)
    )
    await _deadlines(Plane(), settings, stop, XdsTrust(ctx))  # type: ignore[arg-type]
    assert len(ctx.get_ca_certs()) == 3  # and the prepared one
