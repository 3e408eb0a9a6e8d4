"""xds.adsconn.identity_of: a verified client certificate's URI SANs and serial from its DER,
the same as xds.server.peer_identity reads from getpeercert()'s dict."""

from __future__ import annotations

import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from xds.adsconn import identity_of
from xds.server import PeerIdentity, peer_identity


def _cert(
    sans: list[x509.GeneralName] | None, serial: int = 0x78669D9BF9F2063E
) -> x509.Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "w1")])
    now = datetime.now(UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
    )
    if sans is not None:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(key, hashes.SHA256())


def _as_getpeercert(cert: x509.Certificate, tmp_path: Path) -> object:
    pem = tmp_path / "c.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return ssl._ssl._test_decode_cert(str(pem))  # type: ignore[attr-defined]  # getpeercert()'s decoder


def test_uris_and_serial_match_what_getpeercert_gives(tmp_path: Path) -> None:
    cert = _cert(
        [
            x509.DNSName("w1.example"),
            x509.UniformResourceIdentifier("spiffe://attestmesh.local/ns/default/sa/a"),
            x509.UniformResourceIdentifier("spiffe://attestmesh.local/ns/default/sa/b"),
        ]
    )
    got = identity_of(cert.public_bytes(serialization.Encoding.DER))
    assert got == PeerIdentity(
        (
            "spiffe://attestmesh.local/ns/default/sa/a",
            "spiffe://attestmesh.local/ns/default/sa/b",
        ),
        0x78669D9BF9F2063E,
    )
    assert got == peer_identity(_as_getpeercert(cert, tmp_path))  # type: ignore[arg-type]


def test_no_san_is_no_uri_and_garbage_is_no_identity(tmp_path: Path) -> None:
    cert = _cert(None, serial=12345)
    got = identity_of(cert.public_bytes(serialization.Encoding.DER))
    assert got == PeerIdentity((), 12345)
    assert got == peer_identity(_as_getpeercert(cert, tmp_path))  # type: ignore[arg-type]
    assert identity_of(b"\x30\x03\x02\x01\x01") == PeerIdentity((), None)
    assert identity_of(b"") == PeerIdentity((), None)
