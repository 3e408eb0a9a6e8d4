"""AMD SEV-SNP: strict attestation-report parser and a pure verifier.

Evidence (the bytes the agent sends) is either the raw 1184-byte ATTESTATION_REPORT, or an
Azure HCL report (magic ``HCLA``) that carries the SNP report at offset 32.

Collateral names (``Collateral`` mapping), each value DER or PEM:

``vcek``
    The Versioned Chip Endorsement Key certificate (required when the report's flags say the
    report was signed with the VCEK). AMD KDS serves it per chip and TCB.
``vlek``
    The Versioned Loaded Endorsement Key certificate (required when the flags say VLEK; cloud
    providers hand it to the guest, KDS cannot serve it by chip id).
``cert_chain``
    Optional PEM bundle: the ASK (or ASVK) first, then the ARK, exactly as KDS serves it at
    ``/vcek/v1/<product>/cert_chain`` or ``/vlek/v1/<product>/cert_chain``. It replaces the
    pinned intermediate; its ARK must still be byte-identical to a root pinned at construction.

Verification: ARK self-signature, ASK/ASVK <- ARK, VCEK/VLEK <- ASK/ASVK (RSASSA-PSS, SHA-384,
MGF1-SHA-384, salt 48), every certificate valid at ``now``, the ARK pinned, the product
(Milan/Genoa/Turin, from the VCEK productName and the v3+ CPUID bytes) consistent with the chain,
the report signature (ECDSA P-384/SHA-384, little-endian R and S) over bytes 0x000-0x29F (the
rest of the signature field, 0x330-0x49F, is reserved and must be zero: ``report_field_invalid``),
the signing-key kind (flags) consistent with the certificate supplied, the certificate's TCB
extensions equal to ``reported_tcb``, and (VCEK only) the hwID extension equal to ``chip_id``.
The report signature is checked before the TCB/hwID comparison: a report that does not verify
under the given key is ``signature_invalid`` (its detail names a TCB/chip mismatch when the
certificate looks like the wrong one); ``tcb_mismatch``/``chip_id_mismatch`` mean an authentic
report whose certificate extensions disagree with it. ``Claims.platform_id`` is ``None`` when
the chip id is masked (VLEK reports, or MASK_CHIP_ID set).

Reasons (``EvidenceVerificationError.reason``): ``signature_invalid``, ``chain_invalid``,
``untrusted_root``, ``certificate_expired``, ``certificate_not_yet_valid``, ``tcb_mismatch``,
``chip_id_mismatch``, ``signing_key_mismatch``, ``signing_key_unsupported``,
``product_mismatch``, ``collateral_missing``. Format reasons (``EvidenceFormatError``):
``report_length``, ``report_version_unsupported``, ``signature_algorithm_unsupported``,
``report_field_invalid``, ``hcl_report_invalid``, ``certificate_invalid``.

Verified chain links and parsed certificates are cached (bounded, keyed by DER bytes), so a
warm verification costs about one ECDSA P-384 verification.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from certs.errors import EvidenceFormatError, EvidenceVerificationError
from certs.evidence.claims import Claims, Collateral, Detail, Tee, evidence_digest
from certs.evidence.x509chain import (
    TAG_IA5_STRING,
    TAG_INTEGER,
    TAG_OCTET_STRING,
    ChainVerifier,
    Lru,
    ParsedCertificate,
    RsaPssLinks,
    common_name,
    der_single,
    der_uint,
    parse_certificate,
    parse_certificates,
)

__all__ = [
    "COLLATERAL_CERT_CHAIN",
    "COLLATERAL_VCEK",
    "COLLATERAL_VLEK",
    "REPORT_SIZE",
    "AmdChain",
    "AttestationReport",
    "HclReport",
    "Product",
    "SevSnpVerifier",
    "SigningKey",
    "TcbVersion",
    "decode_tcb",
    "load_amd_certificate",
    "looks_like",
    "parse_amd_chain",
    "parse_evidence",
    "parse_report",
    "product_from_cpuid",
    "product_of_certificate",
]

REPORT_SIZE: Final = 0x4A0
SIGNED_LEN: Final = 0x2A0
SUPPORTED_VERSIONS: Final = frozenset({2, 3, 4, 5})
SIG_ALGO_ECDSA_P384_SHA384: Final = 1
HCL_MAGIC: Final = b"HCLA"
HCL_REPORT_OFFSET: Final = 32
HCL_IGVM_OFFSET: Final = HCL_REPORT_OFFSET + REPORT_SIZE  # 1216
HCL_MAX: Final = 64 * 1024

COLLATERAL_VCEK: Final = "vcek"
COLLATERAL_VLEK: Final = "vlek"
COLLATERAL_CERT_CHAIN: Final = "cert_chain"

POLICY_SMT: Final = 1 << 16
POLICY_MIGRATE_MA: Final = 1 << 18
POLICY_DEBUG: Final = 1 << 19
FLAG_MASK_CHIP_ID: Final = 1 << 1

_P384_ORDER_BYTES: Final = 48
_SIG_COMPONENT: Final = 72
_SIG_RESERVED: Final = SIGNED_LEN + 2 * _SIG_COMPONENT  # 0x330: reserved, must be zero

_OID_PRODUCT_NAME: Final = "1.3.6.1.4.1.3704.1.2"
_OID_BL_SPL: Final = "1.3.6.1.4.1.3704.1.3.1"
_OID_TEE_SPL: Final = "1.3.6.1.4.1.3704.1.3.2"
_OID_SNP_SPL: Final = "1.3.6.1.4.1.3704.1.3.3"
_OID_UCODE_SPL: Final = "1.3.6.1.4.1.3704.1.3.8"
_OID_FMC_SPL: Final = "1.3.6.1.4.1.3704.1.3.9"
_OID_HWID: Final = "1.3.6.1.4.1.3704.1.4"

AMD_SIGNATURES: Final = RsaPssLinks(hash_algorithm=hashes.SHA384, salt_length=48)
"""AMD's signatures on certificates and CRLs: RSASSA-PSS, SHA-384, MGF1-SHA-384, salt 48 (fixed,
not read from the certificate)."""
_MAX_CERT: Final = 16 * 1024
_CACHE_SIZE: Final = 256


class Product(enum.StrEnum):
    MILAN = "Milan"
    GENOA = "Genoa"
    TURIN = "Turin"


class SigningKey(enum.StrEnum):
    VCEK = "vcek"
    VLEK = "vlek"
    NONE = "none"


_SIGNING_KEY_CODES: Final[Mapping[int, SigningKey]] = {
    0: SigningKey.VCEK,
    1: SigningKey.VLEK,
    7: SigningKey.NONE,
}


# ---------------------------------------------------------------------------------------------
# report model and parser


@dataclass(frozen=True, slots=True)
class TcbVersion:
    """One TCB_VERSION decoded for a product (Turin adds ``fmc`` and moves the fields)."""

    raw: int
    bootloader: int
    tee: int
    snp: int
    microcode: int
    fmc: int | None = None

    def as_claims(self) -> dict[str, int]:
        out = {
            "bootloader": self.bootloader,
            "tee": self.tee,
            "snp": self.snp,
            "microcode": self.microcode,
        }
        if self.fmc is not None:
            out["fmc"] = self.fmc
        return out


def decode_tcb(raw: int, product: Product) -> TcbVersion:
    b = raw.to_bytes(8, "little")
    if product is Product.TURIN:
        return TcbVersion(raw, bootloader=b[1], tee=b[2], snp=b[3], microcode=b[7], fmc=b[0])
    return TcbVersion(raw, bootloader=b[0], tee=b[1], snp=b[6], microcode=b[7])


@dataclass(frozen=True, slots=True)
class AttestationReport:
    """The fields of an SNP ATTESTATION_REPORT (ABI spec, report versions 2 to 5)."""

    version: int
    guest_svn: int
    policy: int
    family_id: bytes
    image_id: bytes
    vmpl: int
    signature_algo: int
    current_tcb: int
    platform_info: int
    flags: int
    signing_key: SigningKey
    report_data: bytes
    measurement: bytes
    host_data: bytes
    id_key_digest: bytes
    author_key_digest: bytes
    report_id: bytes
    report_id_ma: bytes
    reported_tcb: int
    cpuid: tuple[int, int, int] | None
    chip_id: bytes
    committed_tcb: int
    current_version: tuple[int, int, int]
    committed_version: tuple[int, int, int]
    launch_tcb: int
    signed: bytes
    signature_r: bytes
    signature_s: bytes

    @property
    def debug(self) -> bool:
        return bool(self.policy & POLICY_DEBUG)

    @property
    def chip_id_masked(self) -> bool:
        return bool(self.flags & FLAG_MASK_CHIP_ID) or not any(self.chip_id)


_HEAD = struct.Struct("<IIQ16s16sIIQQI4x64s48s32s48s48s32s32sQ")
_TAIL = struct.Struct("<64sQBBBxBBBxQ")


def parse_report(data: bytes) -> AttestationReport:
    """Parse exactly one 1184-byte report; raise only EvidenceFormatError."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EvidenceFormatError("report_length", "evidence must be bytes")
    data = bytes(data)
    if len(data) != REPORT_SIZE:
        raise EvidenceFormatError("report_length", f"{len(data)} bytes, want {REPORT_SIZE}")
    (
        version,
        guest_svn,
        policy,
        family_id,
        image_id,
        vmpl,
        sig_algo,
        current_tcb,
        platform_info,
        flags,
        report_data,
        measurement,
        host_data,
        id_key_digest,
        author_key_digest,
        report_id,
        report_id_ma,
        reported_tcb,
    ) = _HEAD.unpack_from(data, 0)
    if version not in SUPPORTED_VERSIONS:
        raise EvidenceFormatError(
            "report_version_unsupported",
            f"version {version}, supported {sorted(SUPPORTED_VERSIONS)}",
        )
    if sig_algo != SIG_ALGO_ECDSA_P384_SHA384:
        raise EvidenceFormatError("signature_algorithm_unsupported", f"sig_algo {sig_algo}")
    key_code = (flags >> 2) & 0x7
    if key_code not in _SIGNING_KEY_CODES:
        raise EvidenceFormatError("report_field_invalid", f"reserved signing key {key_code}")
    if vmpl > 3:
        raise EvidenceFormatError("report_field_invalid", f"vmpl {vmpl}")
    if any(data[_SIG_RESERVED:]):
        # Neither signed nor part of R/S: accepting any value would make the evidence malleable.
        raise EvidenceFormatError(
            "report_field_invalid",
            f"signature bytes {_SIG_RESERVED:#x}-{REPORT_SIZE - 1:#x} are reserved, must be zero",
        )
    cpuid = (data[0x188], data[0x189], data[0x18A]) if version >= 3 else None
    (
        chip_id,
        committed_tcb,
        cur_build,
        cur_minor,
        cur_major,
        com_build,
        com_minor,
        com_major,
        launch_tcb,
    ) = _TAIL.unpack_from(data, 0x1A0)
    return AttestationReport(
        version=version,
        guest_svn=guest_svn,
        policy=policy,
        family_id=family_id,
        image_id=image_id,
        vmpl=vmpl,
        signature_algo=sig_algo,
        current_tcb=current_tcb,
        platform_info=platform_info,
        flags=flags,
        signing_key=_SIGNING_KEY_CODES[key_code],
        report_data=report_data,
        measurement=measurement,
        host_data=host_data,
        id_key_digest=id_key_digest,
        author_key_digest=author_key_digest,
        report_id=report_id,
        report_id_ma=report_id_ma,
        reported_tcb=reported_tcb,
        cpuid=cpuid,
        chip_id=chip_id,
        committed_tcb=committed_tcb,
        current_version=(cur_major, cur_minor, cur_build),
        committed_version=(com_major, com_minor, com_build),
        launch_tcb=launch_tcb,
        signed=data[:SIGNED_LEN],
        signature_r=data[SIGNED_LEN : SIGNED_LEN + _SIG_COMPONENT],
        signature_s=data[SIGNED_LEN + _SIG_COMPONENT : SIGNED_LEN + 2 * _SIG_COMPONENT],
    )


@dataclass(frozen=True, slots=True)
class HclReport:
    """The parts of an Azure HCL report we use: the SNP report and the runtime claims."""

    report: bytes
    runtime_claims: bytes
    hash_type: int

    def runtime_claims_bound(self, report_data: bytes) -> bool | None:
        """Whether report_data starts with the runtime claims' hash (None: unknown hash type)."""
        algo = {1: hashlib.sha256, 2: hashlib.sha384, 3: hashlib.sha512}.get(self.hash_type)
        if algo is None:
            return None
        digest = algo(self.runtime_claims).digest()
        return hmac.compare_digest(report_data[: len(digest)], digest)


def _parse_hcl(data: bytes) -> HclReport:
    if len(data) > HCL_MAX:
        raise EvidenceFormatError("hcl_report_invalid", f"{len(data)} bytes is too large")
    if len(data) < HCL_IGVM_OFFSET + 20:
        raise EvidenceFormatError("hcl_report_invalid", f"{len(data)} bytes is too short")
    _size, _ver, _rtype, hash_type, var_len = struct.unpack_from("<5I", data, HCL_IGVM_OFFSET)
    start = HCL_IGVM_OFFSET + 20
    if var_len > len(data) - start:
        raise EvidenceFormatError("hcl_report_invalid", "runtime claims run past the end")
    return HclReport(
        report=data[HCL_REPORT_OFFSET:HCL_IGVM_OFFSET],
        runtime_claims=data[start : start + var_len],
        hash_type=hash_type,
    )


def parse_evidence(data: bytes) -> tuple[AttestationReport, HclReport | None]:
    """Parse evidence: a raw report, or an Azure HCL report wrapping one."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EvidenceFormatError("report_length", "evidence must be bytes")
    data = bytes(data)
    if data[:4] == HCL_MAGIC:
        hcl = _parse_hcl(data)
        return parse_report(hcl.report), hcl
    return parse_report(data), None


def looks_like(evidence: bytes) -> bool:
    """Cheap auto-detection: an SNP report (or HCL report) with a plausible version/sig_algo."""
    if evidence[:4] == HCL_MAGIC and len(evidence) >= HCL_IGVM_OFFSET:
        evidence = evidence[HCL_REPORT_OFFSET:HCL_IGVM_OFFSET]
    if len(evidence) != REPORT_SIZE:
        return False
    version, sig_algo = (
        struct.unpack_from("<I", evidence, 0)[0],
        struct.unpack_from("<I", evidence, 0x34)[0],
    )
    return version in SUPPORTED_VERSIONS and sig_algo == SIG_ALGO_ECDSA_P384_SHA384


def product_from_cpuid(cpuid: tuple[int, int, int] | None) -> Product | None:
    """Map the v3+ CPUID family/model bytes to a KDS product name (None: unknown)."""
    if cpuid is None:
        return None
    family, model, _stepping = cpuid
    if family == 0x19 and model <= 0x0F:
        return Product.MILAN
    if family == 0x19 and (0x10 <= model <= 0x1F or 0xA0 <= model <= 0xAF):
        return Product.GENOA
    if family == 0x1A and model <= 0x11:
        return Product.TURIN
    return None


# ---------------------------------------------------------------------------------------------
# certificates


def _parse_amd_certificate(data: bytes) -> ParsedCertificate:
    if len(data) > _MAX_CERT:
        raise EvidenceFormatError("certificate_invalid", "certificate too large")
    return parse_certificate(data, max_size=_MAX_CERT, allow_nonpositive_serial=True)


def load_amd_certificate(data: bytes) -> x509.Certificate:
    """Load one DER or PEM certificate strictly; EvidenceFormatError on anything else.

    AMD issues VCEK/VLEK certificates with serial number 0, which ``cryptography`` accepts with a
    deprecation warning; that one warning is tolerated here, on purpose, and nothing else
    (``certs.evidence.x509chain.parse_certificate``).
    """
    return _parse_amd_certificate(data).cert


def _ext_raw(cert: ParsedCertificate, oid: str) -> bytes | None:
    return cert.raw_extension(x509.ObjectIdentifier(oid))


def _spl(raw: bytes | None) -> int | None:
    """A TCB SPL extension: one DER INTEGER, non-negative, at most 8 bytes (None otherwise)."""
    if raw is None:
        return None
    try:
        return der_uint(der_single(raw, TAG_INTEGER), max_len=8)
    except ValueError:
        return None


def _ia5(raw: bytes | None) -> str | None:
    """The productName extension: one DER IA5String (None otherwise)."""
    if raw is None:
        return None
    try:
        return der_single(raw, TAG_IA5_STRING).decode("ascii")
    except (ValueError, UnicodeDecodeError):
        return None


def _unwrap_octets(raw: bytes) -> bytes:
    """The hwID extension: an OCTET STRING's content, or the raw value as AMD also issues it."""
    try:
        return der_single(raw, TAG_OCTET_STRING)
    except ValueError:
        return raw


def _product_of_name(text: str | None) -> Product | None:
    if not text:
        return None
    head = text.split("-", 1)[0]
    try:
        return Product(head)
    except ValueError:
        return None


def product_of_certificate(data: bytes) -> Product | None:
    """The product a VCEK/VLEK names in its productName extension (None: absent/unknown)."""
    cert = _parse_amd_certificate(data)
    return _product_of_name(_ia5(_ext_raw(cert, _OID_PRODUCT_NAME)))


@dataclass(frozen=True, slots=True)
class AmdChain:
    """One pinned AMD chain: ARK (root) and ASK (VCEK issuer) or ASVK (VLEK issuer)."""

    product: Product
    key: SigningKey
    ark: x509.Certificate
    intermediate: x509.Certificate
    ark_der: bytes
    intermediate_der: bytes
    ark_parsed: ParsedCertificate
    intermediate_parsed: ParsedCertificate


def parse_amd_chain(pem: bytes) -> AmdChain:
    """Parse a KDS ``cert_chain`` PEM bundle (ASK or ASVK first, ARK second)."""
    if len(pem) > 4 * _MAX_CERT:
        raise EvidenceFormatError("certificate_invalid", "cert_chain too large")
    if b"-----BEGIN" not in pem:
        raise EvidenceFormatError("certificate_invalid", "cert_chain: not a PEM bundle")
    parsed = parse_certificates(pem, max_size=_MAX_CERT, allow_nonpositive_serial=True)
    if len(parsed) != 2:
        raise EvidenceFormatError("certificate_invalid", f"cert_chain has {len(parsed)} certs")
    inter, ark = (c.cert for c in parsed)
    ark_cn, inter_cn = common_name(ark.subject), common_name(inter.subject)
    product = _product_of_name(ark_cn.removeprefix("ARK-"))
    if not ark_cn.startswith("ARK-") or product is None:
        raise EvidenceFormatError("certificate_invalid", f"not an AMD ARK: {ark_cn!r}")
    if inter_cn == f"SEV-VLEK-{product}":
        key = SigningKey.VLEK
    elif inter_cn == f"SEV-{product}":
        key = SigningKey.VCEK
    else:
        raise EvidenceFormatError("certificate_invalid", f"not an AMD ASK/ASVK: {inter_cn!r}")
    return AmdChain(
        product=product,
        key=key,
        ark=ark,
        intermediate=inter,
        ark_der=parsed[1].der,
        intermediate_der=parsed[0].der,
        ark_parsed=parsed[1],
        intermediate_parsed=parsed[0],
    )


@dataclass(frozen=True, slots=True)
class _Endorsement:
    """Facts from a VCEK/VLEK certificate, parsed once and cached by its bytes."""

    cert: x509.Certificate
    der: bytes
    parsed: ParsedCertificate
    key: SigningKey
    public_key: ec.EllipticCurvePublicKey
    product: Product | None
    spl: Mapping[str, int | None]
    hwid: bytes | None
    serial: int = 0
    """Read from the strict parse (``cert.serial_number`` warns on AMD's serial 0)."""


def _parse_endorsement(data: bytes) -> _Endorsement:
    parsed = _parse_amd_certificate(data)
    cert = parsed.cert
    cn = common_name(parsed.subject)
    if cn == "SEV-VCEK":
        key = SigningKey.VCEK
    elif cn == "SEV-VLEK":
        key = SigningKey.VLEK
    else:
        raise EvidenceVerificationError("signing_key_mismatch", f"not a VCEK/VLEK: {cn!r}")
    public_key = parsed.public_key
    if not isinstance(public_key, ec.EllipticCurvePublicKey) or not isinstance(
        public_key.curve, ec.SECP384R1
    ):
        raise EvidenceVerificationError("chain_invalid", f"{cn} key is not EC P-384")
    hwid = _ext_raw(parsed, _OID_HWID)
    return _Endorsement(
        cert=cert,
        der=parsed.der,
        parsed=parsed,
        key=key,
        public_key=public_key,
        product=_product_of_name(_ia5(_ext_raw(parsed, _OID_PRODUCT_NAME))),
        spl={
            "bootloader": _spl(_ext_raw(parsed, _OID_BL_SPL)),
            "tee": _spl(_ext_raw(parsed, _OID_TEE_SPL)),
            "snp": _spl(_ext_raw(parsed, _OID_SNP_SPL)),
            "microcode": _spl(_ext_raw(parsed, _OID_UCODE_SPL)),
            "fmc": _spl(_ext_raw(parsed, _OID_FMC_SPL)),
        },
        hwid=_unwrap_octets(hwid) if hwid is not None else None,
        serial=parsed.serial_number,
    )


def _chain_verifier(ark: ParsedCertificate) -> ChainVerifier:
    """The shared chain verifier for one pinned ARK (its self-signature checked here, once)."""
    return ChainVerifier(
        ark,
        links=AMD_SIGNATURES,
        leaf_curve=ec.SECP384R1,
        max_cert_size=_MAX_CERT,
        allow_nonpositive_serial=True,
        self_signed_root=True,
        cache_size=_CACHE_SIZE,
    )


# ---------------------------------------------------------------------------------------------
# the verifier


class SevSnpVerifier:
    """Verify SNP reports against pinned AMD roots.

    ``chains``: the trusted ARK+ASK/ASVK pairs, as ``AmdChain`` values or KDS ``cert_chain``
    PEM bundles (e.g. the Milan VCEK chain, the Genoa chain, the Milan VLEK chain). Their ARKs
    are the pinned roots; their intermediates are used unless collateral overrides them.
    """

    def __init__(self, chains: Iterable[AmdChain | bytes]) -> None:
        parsed = [c if isinstance(c, AmdChain) else parse_amd_chain(c) for c in chains]
        if not parsed:
            raise ValueError("at least one pinned AMD chain is required")
        self._chains: dict[tuple[Product, SigningKey], AmdChain] = {}
        self._roots: dict[bytes, ChainVerifier] = {}
        for chain in parsed:
            # Pinned material is checked once, at construction (time-independent parts).
            verifier = self._roots.get(chain.ark_der) or _chain_verifier(chain.ark_parsed)
            verifier.verify_issuers([chain.intermediate_parsed])
            self._chains[(chain.product, chain.key)] = chain
            self._roots[chain.ark_der] = verifier
        self._endorsements: Lru[bytes, _Endorsement] = Lru(_CACHE_SIZE)
        self._overrides: Lru[bytes, AmdChain] = Lru(16)

    @property
    def tee(self) -> Tee:
        return Tee.SEV_SNP

    # -- collateral -------------------------------------------------------------------------

    def _endorsement(self, report: AttestationReport, collateral: Collateral) -> _Endorsement:
        if report.signing_key is SigningKey.NONE:
            raise EvidenceVerificationError(
                "signing_key_unsupported", "report is unsigned (signing key 'none')"
            )
        name = str(report.signing_key)
        blob = collateral.get(name)
        if blob is None:
            other = COLLATERAL_VLEK if name == COLLATERAL_VCEK else COLLATERAL_VCEK
            if other in collateral:
                raise EvidenceVerificationError(
                    "signing_key_mismatch",
                    f"report is signed by the {name.upper()} but collateral holds a {other}",
                )
            raise EvidenceVerificationError("collateral_missing", f"collateral {name!r} missing")
        cached = self._endorsements.get(blob)
        if cached is None:
            cached = _parse_endorsement(blob)
            self._endorsements.put(blob, cached)
        if cached.key is not report.signing_key:
            raise EvidenceVerificationError(
                "signing_key_mismatch",
                f"report flags say {report.signing_key}, certificate is a {cached.key}",
            )
        return cached

    def _chain(self, product: Product, key: SigningKey, collateral: Collateral) -> AmdChain:
        override = collateral.get(COLLATERAL_CERT_CHAIN)
        if override is not None:
            chain = self._overrides.get(override)
            if chain is None:
                chain = parse_amd_chain(override)
                if chain.ark_der not in self._roots:
                    raise EvidenceVerificationError(
                        "untrusted_root", f"ARK-{chain.product} in cert_chain is not pinned"
                    )
                self._roots[chain.ark_der].verify_issuers([chain.intermediate_parsed])
                self._overrides.put(override, chain)
            if chain.product is not product or chain.key is not key:
                raise EvidenceVerificationError(
                    "chain_invalid",
                    f"cert_chain is for {chain.product}/{chain.key}, report needs {product}/{key}",
                )
            return chain
        pinned = self._chains.get((product, key))
        if pinned is None:
            raise EvidenceVerificationError(
                "untrusted_root", f"no pinned AMD root for {product} {key.upper()}"
            )
        return pinned

    def _product(self, report: AttestationReport, leaf: _Endorsement) -> Product:
        from_cpu = product_from_cpuid(report.cpuid)
        if from_cpu and leaf.product and from_cpu is not leaf.product:
            raise EvidenceVerificationError(
                "product_mismatch", f"report CPUID says {from_cpu}, certificate {leaf.product}"
            )
        product = from_cpu or leaf.product
        if product is None:
            # Fall back to the issuer named in the certificate (e.g. CN=SEV-Milan).
            issuer = common_name(leaf.cert.issuer)
            product = _product_of_name(issuer.removeprefix("SEV-").removeprefix("VLEK-"))
        if product is None:
            raise EvidenceVerificationError("chain_invalid", "cannot tell the AMD product")
        return product

    # -- verify -----------------------------------------------------------------------------

    def verify(self, evidence: bytes, *, now: datetime, collateral: Collateral) -> Claims:
        report, hcl = parse_evidence(evidence)
        leaf = self._endorsement(report, collateral)
        product = self._product(report, leaf)
        chain = self._chain(product, report.signing_key, collateral)

        self._roots[chain.ark_der].verify([leaf.parsed, chain.intermediate_parsed], now)

        tcb = decode_tcb(report.reported_tcb, product)
        # The signature comes first: fields of a report that does not verify mean nothing.
        # When it fails, the detail says whether the certificate looks like the wrong one.
        self._check_signature(report, leaf, lambda: self._mismatch_hint(report, tcb, leaf))
        problem = self._mismatch_hint(report, tcb, leaf)
        if problem is not None:
            raise EvidenceVerificationError(*problem)
        # The serials are kept on record so a later AMD CRL is checked against the claims alone.
        serials = {
            "endorsement_serial": format(leaf.serial, "x"),
            "intermediate_serial": format(chain.intermediate.serial_number, "x"),
        }
        return self._claims(evidence, report, hcl, product, tcb, serials)

    @staticmethod
    def _mismatch_hint(
        report: AttestationReport, tcb: TcbVersion, leaf: _Endorsement
    ) -> tuple[str, str] | None:
        """The first disagreement between the certificate and the report, if any."""
        for name, value in tcb.as_claims().items():
            have = leaf.spl.get(name)
            if have != value:
                return (
                    "tcb_mismatch",
                    f"{leaf.key.upper()} {name} SPL {have} != reported_tcb {value}",
                )
        if leaf.key is SigningKey.VCEK:
            hwid = report.chip_id[:8] if tcb.fmc is not None else report.chip_id
            if leaf.hwid is None or not hmac.compare_digest(leaf.hwid, hwid):
                return ("chip_id_mismatch", "VCEK hwID does not equal the report's chip_id")
        return None

    @staticmethod
    def _check_signature(
        report: AttestationReport,
        leaf: _Endorsement,
        hint: Callable[[], tuple[str, str] | None],
    ) -> None:
        r_le, s_le = report.signature_r, report.signature_s
        # Components are 48 bytes zero-extended to 72; anything else is not a P-384 signature.
        if any(r_le[_P384_ORDER_BYTES:]) or any(s_le[_P384_ORDER_BYTES:]):
            raise EvidenceVerificationError("signature_invalid", "R or S exceeds 384 bits")
        r = int.from_bytes(r_le, "little")
        s = int.from_bytes(s_le, "little")
        if r == 0 or s == 0:
            raise EvidenceVerificationError("signature_invalid", "R or S is zero")
        try:
            leaf.public_key.verify(
                encode_dss_signature(r, s), report.signed, ec.ECDSA(hashes.SHA384())
            )
        except InvalidSignature:
            why = hint()
            extra = f" (and {why[0]}: {why[1]}; wrong certificate?)" if why else ""
            raise EvidenceVerificationError(
                "signature_invalid", f"report signature does not verify{extra}"
            ) from None

    @staticmethod
    def _claims(
        evidence: bytes,
        report: AttestationReport,
        hcl: HclReport | None,
        product: Product,
        tcb: TcbVersion,
        serials: Mapping[str, str],
    ) -> Claims:
        details: dict[str, Detail] = {
            **serials,
            "version": report.version,
            "policy": f"{report.policy:#x}",
            "vmpl": report.vmpl,
            "smt_allowed": bool(report.policy & POLICY_SMT),
            "migration_agent_allowed": bool(report.policy & POLICY_MIGRATE_MA),
            "abi_major": (report.policy >> 8) & 0xFF,
            "abi_minor": report.policy & 0xFF,
            "signing_key": str(report.signing_key),
            "platform_info": f"{report.platform_info:#x}",
            "current_tcb": f"{report.current_tcb:#018x}",
            "reported_tcb": f"{report.reported_tcb:#018x}",
            "committed_tcb": f"{report.committed_tcb:#018x}",
            "launch_tcb": f"{report.launch_tcb:#018x}",
            "firmware": "{}.{} build {}".format(*report.current_version),
            "product": str(product),
        }
        if report.cpuid is not None:
            details["cpuid"] = "{:02x}{:02x}{:02x}".format(*report.cpuid)
        if hcl is not None:
            details["hcl"] = True
            bound = hcl.runtime_claims_bound(report.report_data)
            if bound is not None:
                details["hcl_runtime_claims_bound"] = bound
        return Claims(
            tee=Tee.SEV_SNP,
            measurements={
                "measurement": report.measurement.hex(),
                "host_data": report.host_data.hex(),
                "id_key_digest": report.id_key_digest.hex(),
                "author_key_digest": report.author_key_digest.hex(),
                "family_id": report.family_id.hex(),
                "image_id": report.image_id.hex(),
            },
            report_data=report.report_data,
            debug=report.debug,
            evidence_sha256=evidence_digest(bytes(evidence)),
            svn=report.guest_svn,
            platform_id=None if report.chip_id_masked else report.chip_id.hex(),
            tcb=tcb.as_claims(),
            details=details,
        )
