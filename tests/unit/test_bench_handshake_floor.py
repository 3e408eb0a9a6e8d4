"""benchmarks.scale_ads.handshake_floor_ms: a real mTLS handshake in process, the server side
made as the control plane's ADS port makes it (a client without a certificate is refused)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme

from benchmarks.scale_ads import handshake_floor_ms, xds_server_context


def _server(tmp_path: Path, ca: trustme.CA) -> ssl.SSLContext:
    root = tmp_path / "root.pem"
    ca.cert_pem.write_to_path(str(root))
    server = ca.issue_cert("localhost")
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    server.private_key_pem.write_to_path(str(key))
    cert.write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    return xds_server_context(str(root), str(cert), str(key))


def test_the_floor_of_a_mutual_tls_handshake_is_measured(tmp_path: Path) -> None:
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    ca.issue_cert("client.example").configure_cert(client)
    median, least = handshake_floor_ms(_server(tmp_path, ca), client, rounds=5)
    assert 0 < least <= median


def test_a_client_without_a_certificate_is_refused(tmp_path: Path) -> None:
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    with pytest.raises(ssl.SSLError):
        handshake_floor_ms(_server(tmp_path, ca), client, rounds=1)
