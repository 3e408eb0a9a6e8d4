"""The control plane's own serving credentials (attestation API, xDS) from the mesh CA, written
to disk for ``SSLContext.load_cert_chain``."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from certs.ca.authority import CertificateAuthority
from certs.ca.slots import key_pem, write_private
from certs.ca.templates import leaf_validity


def build_server_cert(
    ca: CertificateAuthority,
    key: ec.EllipticCurvePrivateKey,
    *,
    spiffe_id: str,
    dns_names: Iterable[str],
    ips: Iterable[str],
    serial: int,
    now: datetime,
    ttl: timedelta,
) -> x509.Certificate:
    """The control plane's own serving certificate (attestation API, xDS), signed by the mesh CA's
    signing intermediate."""
    not_before, not_after = leaf_validity(now, ttl, ca.intermediate.cert.not_valid_after_utc)
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(spiffe_id)]
    names += [x509.DNSName(d) for d in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    return (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "attestmesh control plane")])
        )
        .issuer_name(ca.intermediate.cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca.intermediate.key, hashes.SHA256())
    )


def issue_serving_credentials(
    ca: CertificateAuthority,
    directory: Path,
    stem: str,
    *,
    spiffe_id: str,
    dns_names: Iterable[str],
    ips: Iterable[str],
    now: datetime,
    ttl: timedelta,
) -> tuple[Path, Path]:
    """A fresh key and serving certificate from the mesh CA, written as ``<stem>.pem`` (chain)
    and ``<stem>.key`` (0600) in ``directory``, ready for ``SSLContext.load_cert_chain``."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = build_server_cert(
        ca,
        key,
        spiffe_id=spiffe_id,
        dns_names=dns_names,
        ips=ips,
        serial=x509.random_serial_number(),
        now=now,
        ttl=ttl,
    )
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
    write_private(key_path, key_pem(key))
    cert_path.write_bytes(ca.chain_pem(cert))
    return cert_path, key_path
