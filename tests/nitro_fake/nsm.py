"""A test Nitro Secure Module: signs real-format attestation documents (COSE_Sign1, ES384, the
NSM's payload fields) with a test PKI, behind the same ``ioctl`` seam as ``/dev/nsm``.

The "device" is a JSON file (``write_device``) naming the enclave's PCRs, its module id and the
test PKI directory; ``ioctl`` behaves like the kernel driver: it reads the CBOR request and
writes the CBOR response through the two iovecs of the message, then rewrites the response
length. The control plane trusts the test root only when a test passes it ``--roots``.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cbor2
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID

from certs.collateral.roots import NITRO_ROOT
from certs.evidence.nitro import sig_structure
from sidecar.tee.nitro_nsm import NSM_IOCTL_RAW

_IOVEC = struct.Struct("=QQ")


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: str,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    now: datetime,
    ttl: timedelta,
) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + ttl)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), True)
        .sign(issuer_key, hashes.SHA384())
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_test_pki(directory: Path, now: datetime | None = None) -> Path:
    """A test root and intermediate (P-384) in ``directory``; returns the roots directory to
    give the control plane (``--roots``): it holds the test root under the Nitro root's name."""
    now = now or datetime.now(UTC)
    directory.mkdir(parents=True, exist_ok=True)
    root_key = ec.generate_private_key(ec.SECP384R1())
    mid_key = ec.generate_private_key(ec.SECP384R1())
    root = _cert("test nitro root", root_key, "test nitro root", root_key, ca=True, now=now,
                 ttl=timedelta(days=2))  # fmt: skip
    mid = _cert("test nitro instance", mid_key, "test nitro root", root_key, ca=True, now=now,
                ttl=timedelta(days=1))  # fmt: skip
    pem = serialization.Encoding.PEM
    (directory / "root.pem").write_bytes(root.public_bytes(pem))
    (directory / "mid.pem").write_bytes(mid.public_bytes(pem))
    (directory / "mid.key.pem").write_bytes(_pem_key(mid_key))
    roots = directory / "roots"
    roots.mkdir(exist_ok=True)
    (roots / NITRO_ROOT).write_bytes(root.public_bytes(pem))
    return roots


@dataclass(frozen=True, slots=True)
class FakeNsm:
    pki: Path
    pcrs: dict[int, bytes]
    module_id: str

    def attest(
        self, *, user_data: bytes | None, nonce: bytes | None, public_key: bytes | None
    ) -> bytes:
        now = datetime.now(UTC)
        mid = x509.load_pem_x509_certificate((self.pki / "mid.pem").read_bytes())
        root = x509.load_pem_x509_certificate((self.pki / "root.pem").read_bytes())
        mid_key = serialization.load_pem_private_key((self.pki / "mid.key.pem").read_bytes(), None)
        assert isinstance(mid_key, ec.EllipticCurvePrivateKey)
        leaf_key = ec.generate_private_key(ec.SECP384R1())
        leaf = _cert(self.module_id, leaf_key, "test nitro instance", mid_key, ca=False, now=now,
                     ttl=timedelta(hours=3))  # fmt: skip
        der = serialization.Encoding.DER
        payload = {
            "module_id": self.module_id,
            "digest": "SHA384",
            "timestamp": int(time.time() * 1000),
            "pcrs": dict(self.pcrs),
            "certificate": leaf.public_bytes(der),
            "cabundle": [root.public_bytes(der), mid.public_bytes(der)],
            "public_key": public_key,
            "user_data": user_data,
            "nonce": nonce,
        }
        protected = cbor2.dumps({1: -35})
        body = cbor2.dumps(payload)
        sig = leaf_key.sign(sig_structure(protected, body), ec.ECDSA(hashes.SHA384()))
        r, s = decode_dss_signature(sig)
        doc = [protected, {}, body, r.to_bytes(48, "big") + s.to_bytes(48, "big")]
        return bytes(cbor2.dumps(doc))

    def respond(self, request: bytes) -> bytes:
        try:
            msg: Any = cbor2.loads(request)
            body = msg["Attestation"]
            document = self.attest(
                user_data=body["user_data"], nonce=body["nonce"], public_key=body["public_key"]
            )
        except (KeyError, TypeError, ValueError, cbor2.CBORDecodeError):
            return bytes(cbor2.dumps({"Error": "InvalidArgument"}))
        return bytes(cbor2.dumps({"Attestation": {"document": document}}))


def write_device(path: Path, pki: Path, pcrs: dict[int, bytes], module_id: str) -> None:
    doc = {"pki": str(pki), "module_id": module_id, "pcrs": {i: v.hex() for i, v in pcrs.items()}}
    path.write_text(json.dumps(doc))


def load_device(fd: int) -> FakeNsm:
    size = os.fstat(fd).st_size
    doc = json.loads(os.pread(fd, size, 0))
    pcrs = {int(i): bytes.fromhex(v) for i, v in doc["pcrs"].items()}
    return FakeNsm(Path(doc["pki"]), pcrs, doc["module_id"])


def ioctl(fd: int, request: int, message: bytearray) -> int:
    """The NSM driver's raw ioctl on the test device ``fd``."""
    if request != NSM_IOCTL_RAW or len(message) != 2 * _IOVEC.size:
        raise OSError(22, "Invalid argument")
    req_addr, req_len = _IOVEC.unpack_from(message, 0)
    resp_addr, resp_cap = _IOVEC.unpack_from(message, _IOVEC.size)
    response = load_device(fd).respond(ctypes.string_at(req_addr, req_len))
    if len(response) > resp_cap:
        raise OSError(90, "Message too long")
    ctypes.memmove(resp_addr, response, len(response))
    _IOVEC.pack_into(message, _IOVEC.size, resp_addr, len(response))
    return 0
