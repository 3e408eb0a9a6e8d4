"""The attestation API's serving certificate is issued by the mesh CA and rotates in place:
new handshakes see the new certificate without a restart."""

from __future__ import annotations

import asyncio
import ssl
from datetime import UTC, datetime
from pathlib import Path

from aiohttp import web
from cryptography import x509

from attestmesh.serve import ControlPlaneSettings, _api_tls, _load_server_cert
from certs.ca import CertificateAuthority


async def served_serial(port: int, bundle: bytes) -> int:
    ctx = ssl.create_default_context(cadata=bundle.decode())
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
    )
    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    writer.close()
    await writer.wait_closed()
    return x509.load_der_x509_certificate(der).serial_number


async def test_server_certificate_rotates_for_new_handshakes(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", "mesh.example", now)
    settings = ControlPlaneSettings(state_dir=tmp_path, trust_domain="mesh.example")
    ctx = _api_tls()
    _load_server_cert([ctx], ca, settings, now)
    assert (tmp_path / "tls" / "server.key").stat().st_mode & 0o777 == 0o600
    runner = web.AppRunner(web.Application())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    try:
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        first = await served_serial(port, ca.bundle_pem)
        _load_server_cert([ctx], ca, settings, datetime.now(UTC))
        second = await served_serial(port, ca.bundle_pem)
        assert first != second
    finally:
        await runner.cleanup()
