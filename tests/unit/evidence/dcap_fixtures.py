"""Synthetic Intel DCAP PKI, quotes and collateral for tests (test keys, never Intel's).

Real vectors cannot be re-signed, so cases like a debug enclave, a revoked PCK certificate or
each TCB status come from this builder. Layouts follow the Intel DCAP quote formats that the
real vectors exercise; the dcap-qvl oracle checks both agree on them.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from cryptography.x509.oid import NameOID

T0 = datetime(2025, 1, 1, tzinfo=UTC)
NOW = datetime(2025, 1, 10, tzinfo=UTC)
FMSPC = bytes.fromhex("00906ED50000")
QE_MRSIGNER = bytes(range(32))
SEPT_VE_DISABLE = bytes.fromhex("0000001000000000")


def _name(cn: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, cn),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Test Corporation"),
        ]
    )


def _tlv(tag: int, value: bytes) -> bytes:
    n = len(value)
    if n < 0x80:
        length = bytes([n])
    elif n < 0x100:
        length = bytes([0x81, n])
    else:
        length = bytes([0x82]) + n.to_bytes(2, "big")
    return bytes([tag]) + length + value


def _oid(suffix: bytes) -> bytes:
    return _tlv(0x06, bytes.fromhex("2a864886f84d010d01") + suffix)


def _int(value: int) -> bytes:
    raw = value.to_bytes(max(1, (value.bit_length() + 8) // 8), "big")
    return _tlv(0x02, raw)


def sgx_extension(cpu_svn: tuple[int, ...], pce_svn: int, fmspc: bytes) -> bytes:
    tcb = b"".join(_tlv(0x30, _oid(bytes([2, i + 1])) + _int(c)) for i, c in enumerate(cpu_svn))
    tcb += _tlv(0x30, _oid(bytes([2, 17])) + _int(pce_svn))
    tcb += _tlv(0x30, _oid(bytes([2, 18])) + _tlv(0x04, bytes(cpu_svn)))
    body = _tlv(0x30, _oid(b"\x01") + _tlv(0x04, b"\x11" * 16))
    body += _tlv(0x30, _oid(b"\x02") + _tlv(0x30, tcb))
    body += _tlv(0x30, _oid(b"\x03") + _tlv(0x04, b"\x00\x00"))
    body += _tlv(0x30, _oid(b"\x04") + _tlv(0x04, fmspc))
    body += _tlv(0x30, _oid(b"\x05") + _tlv(0x0A, b"\x00"))
    return _tlv(0x30, body)


def _cert(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool,
    serial: int,
    not_before: datetime = T0,
    not_after: datetime = T0 + timedelta(days=3650),
    extra: bytes | None = None,
) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer.subject if issuer is not None else _name(subject))
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=not ca,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=ca,
                crl_sign=ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    )
    if extra is not None:
        builder = builder.add_extension(
            x509.UnrecognizedExtension(x509.ObjectIdentifier("1.2.840.113741.1.13.1"), extra),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _crl(
    issuer: x509.Certificate,
    key: ec.EllipticCurvePrivateKey,
    revoked: tuple[int, ...],
    this_update: datetime,
    next_update: datetime,
) -> bytes:
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(issuer.subject)
        .last_update(this_update)
        .next_update(next_update)
        .add_extension(x509.CRLNumber(1), critical=False)
    )
    for serial in revoked:
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(this_update)
            .build()
        )
    return builder.sign(key, hashes.SHA256()).public_bytes(Encoding.DER)


def _raw_sig(key: ec.EllipticCurvePrivateKey, data: bytes) -> bytes:
    r, s = decode_dss_signature(key.sign(data, ec.ECDSA(hashes.SHA256())))
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def _pem(*certs: x509.Certificate) -> bytes:
    return b"".join(c.public_bytes(Encoding.PEM) for c in certs)


@dataclass
class Pki:
    """A test root, PCK Platform CA, PCK leaf, TCB signing cert and the attestation key."""

    cpu_svn: tuple[int, ...] = (5, 5, 2, 2, 3, 1, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0)
    pce_svn: int = 11
    fmspc: bytes = FMSPC
    root_key: ec.EllipticCurvePrivateKey = field(init=False)
    root: x509.Certificate = field(init=False)
    ca_key: ec.EllipticCurvePrivateKey = field(init=False)
    ca: x509.Certificate = field(init=False)
    pck_key: ec.EllipticCurvePrivateKey = field(init=False)
    pck: x509.Certificate = field(init=False)
    tcb_key: ec.EllipticCurvePrivateKey = field(init=False)
    tcb: x509.Certificate = field(init=False)
    att_key: ec.EllipticCurvePrivateKey = field(init=False)

    def __post_init__(self) -> None:
        gen = ec.generate_private_key
        self.root_key = gen(ec.SECP256R1())
        self.root = _cert("Test SGX Root CA", self.root_key, None, self.root_key, ca=True, serial=1)
        self.ca_key = gen(ec.SECP256R1())
        self.ca = _cert(
            "Test SGX PCK Platform CA", self.ca_key, self.root, self.root_key, ca=True, serial=2
        )
        self.pck_key = gen(ec.SECP256R1())
        self.pck = _cert(
            "Test SGX PCK Certificate",
            self.pck_key,
            self.ca,
            self.ca_key,
            ca=False,
            serial=0x1234,
            extra=sgx_extension(self.cpu_svn, self.pce_svn, self.fmspc),
        )
        self.tcb_key = gen(ec.SECP256R1())
        self.tcb = _cert(
            "Test SGX TCB Signing", self.tcb_key, self.root, self.root_key, ca=False, serial=3
        )
        self.att_key = gen(ec.SECP256R1())

    @property
    def root_der(self) -> bytes:
        return self.root.public_bytes(Encoding.DER)


def enclave_report(
    *,
    mr_enclave: bytes = b"\xaa" * 32,
    mr_signer: bytes = b"\xbb" * 32,
    attributes: bytes = bytes.fromhex("0500000000000000e700000000000000"),
    isv_prod_id: int = 0,
    isv_svn: int = 0,
    report_data: bytes = bytes(64),
    cpu_svn: bytes = bytes(16),
) -> bytes:
    raw = bytearray(384)
    raw[0:16] = cpu_svn
    raw[48:64] = attributes
    raw[64:96] = mr_enclave
    raw[128:160] = mr_signer
    struct.pack_into("<HH", raw, 256, isv_prod_id, isv_svn)
    raw[320:384] = report_data
    return bytes(raw)


def td_report(
    *,
    tee_tcb_svn: bytes = bytes([6, 1, 3]) + bytes(13),
    td_attributes: bytes = SEPT_VE_DISABLE,
    report_data: bytes = bytes(64),
    td15: bool = False,
) -> bytes:
    raw = bytearray(648 if td15 else 584)
    raw[0:16] = tee_tcb_svn
    raw[16:64] = b"\x5b" * 48
    raw[120:128] = td_attributes
    raw[128:136] = bytes.fromhex("e702060000000000")
    raw[136:184] = b"\x91" * 48
    raw[328:376] = b"\x01" * 48
    raw[520:584] = report_data
    if td15:
        raw[584:600] = tee_tcb_svn
    return bytes(raw)


def build_quote(
    pki: Pki,
    *,
    tdx: bool = False,
    version: int | None = None,
    body: bytes | None = None,
    qe_isvsvn: int = 8,
    qe_auth: bytes = bytes(range(32)),
    td15: bool = False,
) -> bytes:
    version = version if version is not None else (4 if tdx else 3)
    tee_type = 0x81 if tdx else 0
    header = struct.pack("<HHIHH", version, 2, tee_type, 0, 0)
    header += bytes.fromhex("939a7233f79c4ca9940a0db3957f0607") + bytes(20)
    if body is None:
        body = td_report(td15=td15) if tdx else enclave_report()
    if version == 5:
        body_type = 1 if not tdx else (3 if len(body) == 648 else 2)
        signed = header + struct.pack("<HI", body_type, len(body)) + body
    else:
        signed = header + body
    att_pub = pki.att_key.public_key().public_bytes(Encoding.X962, PublicFormat.UncompressedPoint)[
        1:
    ]
    qe_rd = hashlib.sha256(att_pub + qe_auth).digest() + bytes(32)
    qe = enclave_report(
        mr_signer=QE_MRSIGNER,
        attributes=bytes.fromhex("1100000000000000e700000000000000"),
        isv_prod_id=2 if tdx else 1,
        isv_svn=qe_isvsvn,
        report_data=qe_rd,
    )
    chain = _pem(pki.pck, pki.ca, pki.root) + b"\x00"
    inner = (
        qe
        + _raw_sig(pki.pck_key, qe)
        + struct.pack("<H", len(qe_auth))
        + qe_auth
        + struct.pack("<HI", 5, len(chain))
        + chain
    )
    sig_data = _raw_sig(pki.att_key, signed) + att_pub
    sig_data += inner if version == 3 else struct.pack("<HI", 6, len(inner)) + inner
    return signed + struct.pack("<I", len(sig_data)) + sig_data


def platform_level(
    status: str,
    *,
    sgx: tuple[int, ...] | None = None,
    pce_svn: int = 11,
    tdx: tuple[int, ...] | None = None,
    advisories: tuple[str, ...] = (),
) -> dict[str, Any]:
    sgx = sgx if sgx is not None else (5, 5, 2, 2, 3, 1, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0)
    tcb: dict[str, Any] = {"sgxtcbcomponents": [{"svn": s} for s in sgx], "pcesvn": pce_svn}
    if tdx is not None:
        tcb["tdxtcbcomponents"] = [{"svn": s} for s in tdx]
    level: dict[str, Any] = {"tcb": tcb, "tcbDate": "2024-03-13T00:00:00Z", "tcbStatus": status}
    if advisories:
        level["advisoryIDs"] = list(advisories)
    return level


def isv_level(status: str, isvsvn: int, advisories: tuple[str, ...] = ()) -> dict[str, Any]:
    level: dict[str, Any] = {
        "tcb": {"isvsvn": isvsvn},
        "tcbDate": "2024-03-13T00:00:00Z",
        "tcbStatus": status,
    }
    if advisories:
        level["advisoryIDs"] = list(advisories)
    return level


TDX_TCB = (5, 0, 2) + (0,) * 13


def build_collateral(
    pki: Pki,
    *,
    tdx: bool = False,
    levels: list[dict[str, Any]] | None = None,
    qe_levels: list[dict[str, Any]] | None = None,
    module_levels: list[dict[str, Any]] | None = None,
    issue: datetime = T0,
    next_update: datetime = T0 + timedelta(days=30),
    revoked_pck: tuple[int, ...] = (),
    fmspc: bytes | None = None,
) -> bytes:
    """dcap-qvl ``QuoteCollateralV3`` JSON signed by the synthetic TCB signing key."""

    def ts(t: datetime) -> str:
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")

    if levels is None:
        levels = [platform_level("UpToDate", tdx=TDX_TCB if tdx else None)]
    info: dict[str, Any] = {
        "id": "TDX" if tdx else "SGX",
        "version": 3,
        "issueDate": ts(issue),
        "nextUpdate": ts(next_update),
        "fmspc": (fmspc or pki.fmspc).hex().upper(),
        "pceId": "0000",
        "tcbType": 0,
        "tcbEvaluationDataNumber": 17,
    }
    if tdx:
        module = {"mrsigner": "00" * 48, "attributes": "00" * 8, "attributesMask": "FF" * 8}
        info["tdxModule"] = module
        info["tdxModuleIdentities"] = [
            {
                "id": "TDX_01",
                **module,
                "tcbLevels": module_levels or [isv_level("UpToDate", 4)],
            }
        ]
    info["tcbLevels"] = levels
    qe = {
        "id": "TD_QE" if tdx else "QE",
        "version": 2,
        "issueDate": ts(issue),
        "nextUpdate": ts(next_update),
        "tcbEvaluationDataNumber": 17,
        "miscselect": "00000000",
        "miscselectMask": "FFFFFFFF",
        "attributes": "11000000000000000000000000000000",
        "attributesMask": "FBFFFFFFFFFFFFFF0000000000000000",
        "mrsigner": QE_MRSIGNER.hex().upper(),
        "isvprodid": 2 if tdx else 1,
        "tcbLevels": qe_levels or [isv_level("UpToDate", 8)],
    }
    tcb_text = json.dumps(info, separators=(",", ":"))
    qe_text = json.dumps(qe, separators=(",", ":"))
    chain = _pem(pki.tcb, pki.root).decode()
    return json.dumps(
        {
            "pck_crl_issuer_chain": _pem(pki.ca, pki.root).decode(),
            "root_ca_crl": _crl(pki.root, pki.root_key, (), issue, next_update).hex(),
            "pck_crl": _crl(pki.ca, pki.ca_key, revoked_pck, issue, next_update).hex(),
            "tcb_info_issuer_chain": chain,
            "tcb_info": tcb_text,
            "tcb_info_signature": _raw_sig(pki.tcb_key, tcb_text.encode()).hex(),
            "qe_identity_issuer_chain": chain,
            "qe_identity": qe_text,
            "qe_identity_signature": _raw_sig(pki.tcb_key, qe_text.encode()).hex(),
        }
    ).encode()


# --------------------------------------------------------------------------------------------
# Real vectors (../shared/vectors, README sections 3 and 4)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vector:
    name: str
    quote: bytes
    collateral: dict[str, bytes]
    pin: datetime


def _read(rel: str) -> bytes:
    from tests.vectors import VECTORS

    return (VECTORS / rel).read_bytes()


def intel_root() -> bytes:
    return _read("tdx/Intel_SGX_RootCA.der")


def vector(name: str) -> Vector:
    from tests.vectors import pin

    if name in ("sgx-dcap/dcapqvl_sgx_v3", "tdx/dcapqvl_v4"):
        return Vector(
            name,
            _read(f"{name}/quote.bin"),
            {"collateral_json": _read(f"{name}/collateral.json")},
            pin("2025-06-20T00:00:00Z"),
        )
    if name == "tdx/gotdxguest_v4_spr":
        return Vector(
            name,
            _read(f"{name}/quote.bin"),
            {
                "tcb_info": _read(f"{name}/tcb_info_response.json"),
                "tcb_info_issuer_chain": _read(f"{name}/tcb_info_issuer_chain.pem"),
                "qe_identity": _read(f"{name}/qe_identity_response.json"),
                "qe_identity_issuer_chain": _read(f"{name}/qe_identity_issuer_chain.pem"),
                "pck_crl": _read(f"{name}/pck_crl_platform.der"),
                "pck_crl_issuer_chain": _read(f"{name}/pck_crl_issuer_chain.pem"),
                "root_ca_crl": _read(f"{name}/root_ca_crl.der"),
            },
            pin("2023-07-01T01:00:00Z"),
        )
    if name == "tdx/gotdxguest_v5":
        return Vector(
            name,
            _read(f"{name}/quote.bin"),
            {
                "tcb_info": _read(f"{name}/tcb_info_response.json"),
                "tcb_info_issuer_chain": _read(f"{name}/tcb_info_issuer_chain_2025.pem"),
            },
            pin("2026-02-03T01:00:00Z"),
        )
    raise KeyError(name)


def flip(data: bytes, offset: int, mask: int = 0x01) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


def derived_negatives(quote: bytes) -> list[tuple[str, bytes, str]]:
    """(case, mutated quote, expected reason) for one real quote; layout from its header."""
    from certs.evidence.dcap import parse_quote

    parsed = parse_quote(quote)
    signed = len(parsed.signed)
    sig = signed + 4
    qe_report = sig + 128 + (0 if parsed.header.version == 3 else 6)
    qe_sig = qe_report + 384
    auth = qe_sig + 64 + 2
    body = 54 if parsed.header.version == 5 else 48
    return [
        ("header_user_data", flip(quote, 40), "signature_invalid"),
        ("body_last_byte", flip(quote, signed - 1), "signature_invalid"),
        ("body_first_byte", flip(quote, body + 1), "signature_invalid"),
        ("quote_signature_r", flip(quote, sig + 5), "signature_invalid"),
        ("quote_signature_s", flip(quote, sig + 40), "signature_invalid"),
        ("attestation_key", flip(quote, sig + 64 + 10), "attestation_key_binding_invalid"),
        ("qe_report", flip(quote, qe_report + 100), "qe_report_signature_invalid"),
        ("qe_report_signature", flip(quote, qe_sig + 3), "qe_report_signature_invalid"),
        ("qe_auth_data", flip(quote, auth + 1), "attestation_key_binding_invalid"),
    ]
