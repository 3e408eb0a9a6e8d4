"""The ADS port's TLS context mints no session tickets, in TLS 1.3 (``num_tickets = 0``) nor in
TLS 1.2, what Envoy's upstream TLS negotiates by default (its maximum is TLS 1.2; it asks for a
ticket): ADS connections are long-lived, and a ticket cost the server ~0.25 ms per handshake
(in process, P-256 leaf, X25519). No session is kept server-side instead (no cache entry), and
the handshake still verifies the client's certificate."""

from __future__ import annotations

import socket
import ssl
from datetime import UTC, datetime
from pathlib import Path

import pytest

from attestmesh.serve import ControlPlaneSettings, _load_server_cert, _xds_tls
from certs.ca import CertificateAuthority
from tests.component.test_ads_leaf_only import client
from tests.unit.xds.meshfixture import TD


def _handshake(server: ssl.SSLContext, cli_ctx: ssl.SSLContext) -> ssl.SSLSocket:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    srv = server.wrap_socket(a, server_side=True, do_handshake_on_connect=False)
    cli = cli_ctx.wrap_socket(b, server_hostname="localhost", do_handshake_on_connect=False)
    done_s = done_c = False
    for _ in range(50):
        for side in ("c", "s"):
            if done_c if side == "c" else done_s:
                continue
            try:
                (cli if side == "c" else srv).do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                continue
            if side == "c":
                done_c = True
            else:
                done_s = True
        if done_c and done_s:
            break
    assert done_c and done_s
    assert srv.getpeercert(True)  # the client's certificate was asked for and verified
    # a NewSessionTicket comes after the client's Finished: let the client read it
    srv.write(b"x")
    assert cli.read(1) == b"x"
    srv.close()
    return cli


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_the_ads_port_sends_no_session_ticket(tmp_path: Path, version: ssl.TLSVersion) -> None:
    ca = CertificateAuthority.load_or_create(tmp_path / "ca", TD, datetime.now(UTC))
    server = _xds_tls(ca)
    settings = ControlPlaneSettings(state_dir=tmp_path, trust_domain=TD)
    _load_server_cert([server], ca, settings, datetime.now(UTC))
    cli_ctx = client(ca.bundle_pem, ca.intermediate, tmp_path, "frontend", leaf_only=True)
    cli_ctx.maximum_version = version
    cli = _handshake(server, cli_ctx)
    try:
        assert cli.version() == ("TLSv1.2" if version is ssl.TLSVersion.TLSv1_2 else "TLSv1.3")
        session = cli.session
        assert session is None or not session.has_ticket
    finally:
        cli.close()
    assert server.session_stats()["number"] == 0  # nothing cached server-side instead
