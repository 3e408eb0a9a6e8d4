"""The verifier conformance table: one case per registered TEE, read by ``test_conformance``.

Each case says, for one real vector (sim: a report built here), what every uniform check needs:
the evidence and its collateral, the pin time, times outside the validity window, byte offsets
of signed regions and of the signature with the *exact* outcome a flip there must have, how to
build the registry with a wrong root, the policy section with reference values from the vectors'
README, and the debug / TCB policy cases. Where a TEE has no such concept the case carries an
``Absence`` with the reason and a proof that the concept really is absent (never a skip).

Offsets were located from the documented field values (``bytes.index`` of a README value) or
from the format's fixed layout, and are asserted against the parsed structure by the tests.
Vectors: ``/work/shared/vectors`` (see its README for provenance, pins and windows).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.serialization import Encoding

from certs.binding import expected_report_data
from certs.collateral.roots import TrustRoots, bundled_roots
from certs.errors import AttestmeshError, EvidenceFormatError, EvidenceVerificationError
from certs.evidence import sim
from certs.evidence.claims import Tee
from certs.evidence.dcap import parse_quote
from certs.evidence.nitro import parse_attestation_document
from certs.evidence.nvidia_gpu import parse_measurement_report
from certs.evidence.sev_snp import SIGNED_LEN
from certs.evidence.x509chain import load_pem_chain
from tests.unit.evidence import dcap_fixtures as fx
from tests.vectors import VECTORS, pin

FORMAT = EvidenceFormatError
VERIFY = EvidenceVerificationError

SIGNATURE_CLASS = frozenset(
    {"signature_invalid", "qe_report_signature_invalid", "attestation_key_binding_invalid"}
)
"""Reasons that mean "a signature over the evidence does not verify"."""


@dataclass(frozen=True)
class Subject:
    """Evidence plus everything verifying it needs (roots go through ``build_verifiers``)."""

    evidence: bytes
    collateral: Mapping[str, bytes]
    now: datetime
    roots: TrustRoots
    sim_keys: tuple[ec.EllipticCurvePublicKey, ...] = ()


@dataclass(frozen=True)
class Flip:
    """XOR ``mask`` into ``evidence[offset]``; the verifier must raise ``error`` with ``reason``.

    ``escapes``/``site``: a known inconsistency. The verifier lets this foreign exception (or
    warning) out at ``site`` instead of a project error; the test is a strict xfail.
    ``accepted``: a known inconsistency where the verifier accepts the flipped evidence.
    (None is documented at present; the fields stay so that a newly found gap is recorded the
    same way, as a strict xfail naming the file and line.)
    """

    region: str
    offset: int
    error: type[AttestmeshError]
    reason: str
    mask: int = 0x01
    escapes: type[BaseException] | None = None
    site: str = ""
    accepted: str = ""


@dataclass(frozen=True)
class WrongRoot:
    name: str
    roots: TrustRoots
    reason: str
    sim_keys: tuple[ec.EllipticCurvePublicKey, ...] = ()
    why: str = ""


@dataclass(frozen=True)
class OutOfWindow:
    now: datetime
    reason: str


@dataclass(frozen=True)
class DebugCase:
    """A debug subject and reference values that admit it once ``allowDebug`` is true."""

    subject: Subject
    refs: Mapping[str, object]
    origin: str


@dataclass(frozen=True)
class TcbCase:
    """Reference values (merged over the case's ``refs``) that put the vector below the policy."""

    refs: Mapping[str, object]
    reason: str


@dataclass(frozen=True)
class Absence:
    """A check that does not apply to this TEE, why, and a proof that the concept is absent."""

    check: str
    why: str
    proof: Callable[[], None]


@dataclass(frozen=True)
class Case:
    tee: Tee
    vector: str
    subject: Subject
    section: str
    refs: Mapping[str, object] | None
    """Reference values from the README that admit the vector (None: the README has none)."""
    signed_flips: tuple[Flip, ...]
    signature_flips: tuple[Flip, ...]
    truncations: tuple[tuple[int, str], ...]
    """(length, exact EvidenceFormatError reason)."""
    wrong_roots: tuple[WrongRoot, ...]
    out_of_window: tuple[OutOfWindow, ...]
    distinct: int
    """Expected size of the set of reasons seen by the signed/signature flips, wrong roots and
    out-of-window times."""
    shared: frozenset[str] = frozenset()
    """Reasons documented to be shared between those families (the TEE cannot tell them apart)."""
    other_forms: tuple[bytes, ...] = ()
    """Other encodings of the same evidence that must verify to the same claims."""
    embedded_flips: tuple[Flip, ...] = ()
    """Flips inside certificates the evidence itself carries."""
    reserved_flips: tuple[Flip, ...] = ()
    """Flips in bytes the format reserves (must be zero) that no signature covers: each must be
    a format error with the exact reason (never accepted)."""
    unsigned_trailer: int = 0
    """Bytes after the signed structure that the verifier tolerates by documented design."""
    appended_byte: str | None = None
    """Reason for evidence with one extra byte appended (None: tolerated by design)."""
    debug: DebugCase | None = None
    tcb: TcbCase | None = None
    tcb_verifier: tuple[Subject, str] | None = None
    """Evidence whose TCB the verifier itself refuses (and the exact reason)."""
    binding: tuple[bytes, bytes] | None = None
    """(nonce, SPKI DER) the evidence binds (only where we built it)."""
    absences: tuple[Absence, ...] = ()


# ---------------------------------------------------------------------------------------------
# helpers


def _read(rel: str) -> bytes:
    return (VECTORS / rel).read_bytes()


def _p384() -> ec.EllipticCurve:
    return ec.SECP384R1()


def _forged_root(
    like: bytes, curve: ec.EllipticCurve, digest: hashes.SHA256 | hashes.SHA384
) -> bytes:
    """A fresh self-signed CA with the *same subject* as the real root ``like`` (PEM or DER)."""
    real = (
        x509.load_pem_x509_certificates(like)[-1]
        if b"-----BEGIN" in like
        else x509.load_der_x509_certificate(like)
    )
    key = ec.generate_private_key(curve)
    cert = (
        x509.CertificateBuilder()
        .subject_name(real.subject)
        .issuer_name(real.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(datetime(2000, 1, 1, tzinfo=UTC))
        .not_valid_after(datetime(2100, 1, 1, tzinfo=UTC))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, digest)
    )
    return cert.public_bytes(Encoding.PEM if b"-----BEGIN" in like else Encoding.DER)


def _forged_amd_chain(like: bytes) -> bytes:
    """A fresh ARK + ASK (RSA-2048, RSASSA-PSS/SHA-384) with the real chain's names."""
    ask_real, ark_real = x509.load_pem_x509_certificates(like)
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
    ark_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ask_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def cert(real: x509.Certificate, key: rsa.RSAPrivateKey) -> x509.Certificate:
        return (
            x509.CertificateBuilder()
            .subject_name(real.subject)
            .issuer_name(ark_real.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(datetime(2000, 1, 1, tzinfo=UTC))
            .not_valid_after(datetime(2100, 1, 1, tzinfo=UTC))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(ark_key, hashes.SHA384(), rsa_padding=pss)
        )

    return cert(ask_real, ask_key).public_bytes(Encoding.PEM) + cert(
        ark_real, ark_key
    ).public_bytes(Encoding.PEM)


def _expect_policy_error(section: str, refs: Mapping[str, object], tee: Tee) -> None:
    """A TCB key in this TEE's policy section is refused by the policy parser."""
    from certs.errors import PolicyError
    from certs.policy import parse_policies
    from tests.unit.fixtures_core import policy_doc

    try:
        parse_policies([policy_doc(tees=[tee.value], refs={section: dict(refs)})])
    except PolicyError as exc:
        assert any("unknown field" in p for p in exc.problems), exc.problems
        return
    raise AssertionError(f"{section}: the policy parser accepted {sorted(refs)}")


SIM_KEY = ec.derive_private_key(0x5EED_0001, ec.SECP256R1())
OTHER_SIM_KEY = ec.derive_private_key(0x5EED_0002, ec.SECP256R1())
WORKLOAD_KEY = ec.derive_private_key(0x5EED_0003, ec.SECP256R1())
SIM_NONCE = bytes(range(100, 132))
SIM_MEASUREMENT = b"\x11" * 48


def sim_keys() -> tuple[ec.EllipticCurvePublicKey, ...]:
    return (SIM_KEY.public_key(),)


# ---------------------------------------------------------------------------------------------
# cases


def _nitro(roots: TrustRoots) -> Case:
    ev = _read("nitro/veracruz_eu-west-1_20221109.cbor")
    doc = parse_attestation_document(ev)
    pcr_hex = (  # README section 1: pcr0, pcr1, pcr2
        "22f9e1c949208da55eb01b9b9fc88f87454f77ba133f0d82320b509621c92482152a99d0a12335b97178c02d6f977d01",
        "bcdf05fefccaa8e55bf2c8d6dee9e79bbff31e34bf28a99aa19e6b29c37ee80b214a414b7607236edf26fcb78654e63f",
        "00943ea859140fed74e1025fe41aedb38780eae5656b3f9ef9b4b0e6111350315544db3efcda05725108f72b2ab141f7",
    )
    pcr = {i: bytes.fromhex(h) for i, h in enumerate(pcr_hex)}
    user_data = bytes.fromhex("7c37108079b3e8a36d8a7970de1d6d4ff1461e0e35d9557c4d789df5e0576620")
    nonce = bytes.fromhex("c678c86135de539d183acff58886d98dfb9823041af9f934bf909ac0f8d96245")
    ts = ev.index(b"itimestamp") + len(b"itimestamp") + 1 + 7  # 0x1b, 8 bytes: the last one
    sig = len(ev) - 96
    leaf = ev.index(doc.certificate)
    root_copy = ev.index(doc.cabundle[0])
    regional = ev.index(doc.cabundle[1])
    zonal = ev.index(doc.cabundle[2])
    debug_ev = _read("nitro/evervault_debug_us-east-1_20221012.cbor")
    return Case(
        tee=Tee.NITRO,
        vector="nitro/veracruz_eu-west-1_20221109.cbor",
        subject=Subject(ev, {}, pin("2022-11-09T23:00:00Z"), roots),
        section="nitro",
        refs={f"pcr{i}": [v.hex()] for i, v in pcr.items()},
        signed_flips=(
            Flip("protected_header_alg", 5, FORMAT, "algorithm_unsupported"),  # -35 -> -36
            Flip("payload_digest_name", ev.index(b"SHA384"), FORMAT, "field_value"),
            Flip("payload_module_id", ev.index(b"i-04fd") + 2, VERIFY, "signature_invalid"),
            Flip("payload_timestamp", ts, VERIFY, "signature_invalid"),
            Flip("measurement_pcr0", ev.index(pcr[0]), VERIFY, "signature_invalid"),
            Flip("measurement_pcr2", ev.index(pcr[2]) + 47, VERIFY, "signature_invalid"),
            Flip("report_data_user_data", ev.index(user_data), VERIFY, "signature_invalid"),
            Flip("nonce", ev.index(nonce) + 31, VERIFY, "signature_invalid"),
        ),
        signature_flips=tuple(
            Flip(f"signature+{k}", sig + k, VERIFY, "signature_invalid") for k in (0, 47, 48, 95)
        ),
        embedded_flips=(
            Flip("leaf_der_header", leaf, FORMAT, "certificate_invalid"),
            Flip("leaf_tbs_serial", leaf + 15, VERIFY, "chain_invalid"),
            Flip("cabundle_root_copy", root_copy + 15, VERIFY, "untrusted_root"),
            Flip("regional_tbs", regional + 15, VERIFY, "untrusted_root"),
            # A certificate the strict parser (x509chain.parse_certificate) cannot read whole is
            # certificate_invalid, before any signature or name check: malformed version,
            # negative serial (RFC 5280 4.1.2.2), undecodable name, outer signatureAlgorithm
            # unlike the signed one, unknown key type, duplicate extension.
            Flip("leaf_version", leaf + 12, FORMAT, "certificate_invalid"),
            Flip("leaf_serial_sign", leaf + 15, FORMAT, "certificate_invalid", mask=0x80),
            Flip("leaf_subject", leaf + 245, FORMAT, "certificate_invalid"),
            Flip("leaf_der_tail", leaf + 525, FORMAT, "certificate_invalid"),
            Flip("root_copy_issuer", root_copy + 68, FORMAT, "certificate_invalid"),
            Flip("zonal_subject", zonal + 190, FORMAT, "certificate_invalid"),
            Flip("zonal_key", zonal + 323, FORMAT, "certificate_invalid"),
            Flip("zonal_extensions", zonal + 503, FORMAT, "certificate_invalid"),
        ),
        truncations=(
            (0, "truncated"),
            (1, "truncated"),
            (len(ev) // 2, "truncated"),
            (len(ev) - 1, "truncated"),
        ),
        appended_byte="trailing_data",
        wrong_roots=(
            WrongRoot(
                "nvidia_root", dataclasses.replace(roots, nitro=roots.nvidia), "untrusted_root"
            ),
            WrongRoot(
                "forged_same_name_p384",
                dataclasses.replace(
                    roots, nitro=_forged_root(roots.nitro, _p384(), hashes.SHA384())
                ),
                "untrusted_root",
            ),
        ),
        out_of_window=(
            OutOfWindow(pin("2022-11-09T22:51:56Z"), "certificate_not_yet_valid"),
            OutOfWindow(pin("2022-11-10T01:52:01Z"), "certificate_expired"),
        ),
        distinct=4,
        debug=DebugCase(
            Subject(debug_ev, {}, pin("2022-10-12T14:00:00Z"), roots),
            {"pcr0": ["00" * 48]},
            "nitro/evervault_debug_us-east-1_20221012.cbor (PCR0-2 zero)",
        ),
        absences=(
            Absence(
                "tcb",
                "a Nitro document carries no TCB or SVN; the nitro policy section has no TCB key",
                lambda: _expect_policy_error(
                    "nitro", {"pcr0": ["00"], "minimumTcb": {"snp": 1}}, Tee.NITRO
                ),
            ),
        ),
    )


def _snp(roots: TrustRoots) -> Case:
    base = "sev-snp/milan_v2_idblock_trustee"
    ev = _read(f"{base}/report.bin")
    vcek = {"vcek": _read(f"{base}/vcek.der")}
    genoa = _read("sev-snp/amd/ask_ark_genoa.pem")
    milan = roots.amd_chains[0]
    return Case(
        tee=Tee.SEV_SNP,
        vector=f"{base}/report.bin",
        subject=Subject(ev, vcek, pin("2024-07-01T00:00:00Z"), roots),
        section="sevSnp",
        refs={
            "measurement": [
                "a1f3930413247bb38cfc171579ea3c12d5fe4901f0c792f63fd75d98f1ef827c"
                "23500644e0e692e6be917f9050d3d38c"
            ]
        },
        signed_flips=(
            Flip("header_version_2_to_3", 0x00, VERIFY, "signature_invalid"),
            Flip("header_version_2_to_6", 0x00, FORMAT, "report_version_unsupported", mask=0x04),
            Flip("header_guest_svn", 0x04, VERIFY, "signature_invalid"),
            Flip("header_policy", 0x0A, VERIFY, "signature_invalid"),
            Flip("header_sig_algo", 0x34, FORMAT, "signature_algorithm_unsupported"),
            Flip("report_data", 0x50, VERIFY, "signature_invalid"),
            Flip("report_data_last", 0x8F, VERIFY, "signature_invalid"),
            Flip("measurement", 0x90, VERIFY, "signature_invalid"),
            Flip("host_data", 0xC0, VERIFY, "signature_invalid"),
            Flip("reported_tcb", 0x180, VERIFY, "signature_invalid"),
            Flip("chip_id", 0x1A0, VERIFY, "signature_invalid"),
            Flip("signed_last_byte", SIGNED_LEN - 1, VERIFY, "signature_invalid"),
        ),
        signature_flips=(
            Flip("signature_r_low", SIGNED_LEN, VERIFY, "signature_invalid"),
            Flip("signature_r_high", SIGNED_LEN + 47, VERIFY, "signature_invalid"),
            Flip("signature_r_beyond_384_bits", SIGNED_LEN + 60, VERIFY, "signature_invalid"),
            Flip("signature_s_low", SIGNED_LEN + 72, VERIFY, "signature_invalid"),
            Flip("signature_s_high", SIGNED_LEN + 72 + 47, VERIFY, "signature_invalid"),
        ),
        reserved_flips=(
            Flip("signature_reserved_first", SIGNED_LEN + 144, FORMAT, "report_field_invalid"),
            Flip("signature_reserved_last", 0x49F, FORMAT, "report_field_invalid"),
        ),
        truncations=(
            (0, "report_length"),
            (1, "report_length"),
            (len(ev) // 2, "report_length"),
            (len(ev) - 1, "report_length"),
        ),
        appended_byte="report_length",
        wrong_roots=(
            WrongRoot(
                "genoa_only",
                dataclasses.replace(roots, amd_chains=(genoa,)),
                "untrusted_root",
                why="no pinned chain for a Milan VCEK",
            ),
            WrongRoot(
                "forged_same_name_milan_chain",
                dataclasses.replace(roots, amd_chains=(_forged_amd_chain(milan),)),
                "chain_invalid",
                why="by design the pinned ASK (not only the ARK) anchors the VCEK, so a "
                "forged pinned chain fails the VCEK<-ASK link: chain_invalid",
            ),
        ),
        out_of_window=(
            OutOfWindow(pin("2023-01-24T17:58:25Z"), "certificate_not_yet_valid"),
            OutOfWindow(pin("2030-01-24T17:58:27Z"), "certificate_expired"),
        ),
        distinct=5,
        debug=DebugCase(
            Subject(
                _read("sev-snp/milan_v2_gosevguest/report.bin"),
                {"vcek": _read("sev-snp/milan_v2_gosevguest/vcek.der")},
                pin("2023-01-01T00:00:00Z"),
                roots,
            ),
            {
                "measurement": [
                    "b07af9620f3b839b47996422ddec6058338951d984e312115131ea82705eaf5b"
                    "6bdf8a9ece31a5a608eb0cf2e4872b01"
                ]
            },
            "sev-snp/milan_v2_gosevguest (guest policy 0xb0000, bit 19 DEBUG)",
        ),
        tcb=TcbCase({"minimumTcb": {"snp": 9}}, "tcb_below_minimum"),  # reported snp SPL is 8
    )


def _dcap_debug(roots: TrustRoots, *, tdx: bool) -> DebugCase:
    pki = fx.Pki()
    if tdx:
        body = fx.td_report(td_attributes=bytes([0x01, 0, 0, 0x10, 0, 0, 0, 0]))
        refs: Mapping[str, object] = {"mrtd": ["91" * 48]}
    else:
        body = fx.enclave_report(attributes=bytes.fromhex("0700000000000000e700000000000000"))
        refs = {"mrenclave": ["aa" * 32]}
    return DebugCase(
        Subject(
            fx.build_quote(pki, tdx=tdx, body=body),
            {"collateral_json": fx.build_collateral(pki, tdx=tdx)},
            fx.NOW,
            dataclasses.replace(roots, intel_sgx_root=pki.root_der),
        ),
        refs,
        "synthetic quote with the DEBUG attribute, signed by a test PKI (dcap_fixtures); no "
        "real debug quote exists and a real one cannot be re-signed",
    )


def _dcap_wrong_roots(roots: TrustRoots) -> tuple[WrongRoot, ...]:
    return (
        WrongRoot(
            "nitro_root", dataclasses.replace(roots, intel_sgx_root=roots.nitro), "untrusted_root"
        ),
        WrongRoot(
            "forged_same_name_p256",
            dataclasses.replace(
                roots,
                intel_sgx_root=_forged_root(roots.intel_sgx_root, ec.SECP256R1(), hashes.SHA256()),
            ),
            "untrusted_root",
        ),
    )


def _tdx(roots: TrustRoots) -> Case:
    ev = _read("tdx/dcapqvl_v4/quote.bin")
    q = parse_quote(ev)
    signed = len(q.signed)
    sig = signed + 4
    pem = ev.index(q.signature.pck_chain_pem)
    spr = fx.vector("tdx/gotdxguest_v4_spr")
    return Case(
        tee=Tee.TDX,
        vector="tdx/dcapqvl_v4/quote.bin",
        subject=Subject(
            ev,
            {"collateral_json": _read("tdx/dcapqvl_v4/collateral.json")},
            pin("2025-06-20T00:00:00Z"),
            roots,
        ),
        section="tdx",
        refs={
            "mrtd": [
                "91eb2b44d141d4ece09f0c75c2c53d247a3c68edd7fafe8a3520c942a604a407de03ae6dc5f87f27428b2538873118b7"
            ],
            "rtmr0": [
                "44c0197b39157fdd7a4dcc44767f9d6b0bb3977c7a8e347b8492f827fe9d9e5c48aca29b220b80b6a540cf994b9bc9c0"
            ],
            "rtmr1": [
                "0084452c01668329d4bc06acdf58a7205c26743304509973949e5619bf81a6a7aea8c323c173019b3093d54e579e9378"
            ],
            "rtmr2": [
                "d833feef2cd945148aa38ead2c53e9b7f138190aaaebfc551dccd829fc207aa3ba80b70870d7330733642e01d48c3132"
            ],
        },
        signed_flips=(
            Flip("header_version", 0, FORMAT, "quote_unsupported"),  # v4 -> v5 needs a body type
            Flip("header_tee_type", 4, FORMAT, "quote_unsupported"),
            Flip("header_qe_svn", 8, VERIFY, "signature_invalid"),
            Flip("header_qe_vendor_id", 12, VERIFY, "signature_invalid"),
            Flip("header_user_data", 40, VERIFY, "signature_invalid"),
            Flip("body_tee_tcb_svn", 48, VERIFY, "signature_invalid"),
            Flip("body_td_attributes_debug_bit", 48 + 120, VERIFY, "signature_invalid"),
            Flip("measurement_mrtd", 48 + 136, VERIFY, "signature_invalid"),
            Flip("measurement_rtmr0", 48 + 328, VERIFY, "signature_invalid"),
            Flip("report_data", 48 + 520, VERIFY, "signature_invalid"),
            Flip("report_data_last", signed - 1, VERIFY, "signature_invalid"),
        ),
        signature_flips=tuple(
            Flip(f"signature+{k}", sig + k, VERIFY, "signature_invalid") for k in (0, 31, 32, 63)
        ),
        embedded_flips=(
            Flip("pck_leaf_pem", pem + 11, VERIFY, "chain_invalid"),
            Flip("pck_platform_ca_pem", pem + 1773, VERIFY, "untrusted_root"),
            # A certificate the strict parser cannot read whole is chain_invalid (DCAP's reason
            # for an unreadable certificate), whichever position it holds in the chain.
            Flip("pck_leaf_names", pem + 106, VERIFY, "chain_invalid"),  # undecodable name
            Flip("pck_leaf_names_warning", pem + 153, VERIFY, "chain_invalid"),  # C= length
            Flip("platform_ca_der_a", pem + 2215, VERIFY, "chain_invalid"),  # key type
            Flip("platform_ca_der_b", pem + 2346, VERIFY, "chain_invalid"),  # dup. extension
            Flip("platform_ca_der_c", pem + 2350, VERIFY, "chain_invalid"),  # extension value
            Flip("root_copy_der", pem + 3159, VERIFY, "chain_invalid"),  # key type
        ),
        truncations=(
            (0, "quote_truncated"),
            (1, "quote_truncated"),
            (len(ev) // 2, "quote_truncated"),
            (len(ev) - q.trailing - 1, "quote_truncated"),
        ),
        unsigned_trailer=q.trailing,
        appended_byte=None,
        wrong_roots=_dcap_wrong_roots(roots),
        out_of_window=(
            OutOfWindow(pin("2025-06-19T10:32:26Z"), "collateral_not_yet_valid"),  # QE identity
            OutOfWindow(pin("2025-07-19T10:00:36Z"), "collateral_expired"),  # PCK CRL
            OutOfWindow(pin("2032-02-07T00:00:00Z"), "certificate_expired"),  # PCK leaf
        ),
        distinct=5,
        debug=_dcap_debug(roots, tdx=True),
        tcb=TcbCase({"acceptedTcbStatuses": ["SWHardeningNeeded"]}, "tcb_status_not_accepted"),
        tcb_verifier=(Subject(spr.quote, spr.collateral, spr.pin, roots), "tcb_level_not_found"),
    )


def _sgx(roots: TrustRoots) -> Case:
    ev = _read("sgx-dcap/dcapqvl_sgx_v3/quote.bin")
    q = parse_quote(ev)
    signed = len(q.signed)
    sig = signed + 4
    pem = ev.index(q.signature.pck_chain_pem)
    return Case(
        tee=Tee.SGX,
        vector="sgx-dcap/dcapqvl_sgx_v3/quote.bin",
        subject=Subject(
            ev,
            {"collateral_json": _read("sgx-dcap/dcapqvl_sgx_v3/collateral.json")},
            pin("2025-06-20T00:00:00Z"),
            roots,
        ),
        section="sgx",
        refs={
            "mrenclave": ["33d8736db756ed4997e04ba358d27833188f1932ff7b1d156904d3f560452fbb"],
            "mrsigner": ["815f42f11cf64430c30bab7816ba596a1da0130c3b028b673133a66cf9a3e0e6"],
            "acceptedTcbStatuses": ["ConfigurationAndSWHardeningNeeded"],
            "allowedAdvisories": ["INTEL-SA-00289", "INTEL-SA-00615"],
        },
        signed_flips=(
            Flip("header_version", 0, FORMAT, "quote_unsupported"),  # v3 -> v2
            Flip("header_att_key_type", 2, FORMAT, "quote_unsupported"),
            Flip("header_qe_vendor_id", 12, VERIFY, "signature_invalid"),
            Flip("header_user_data", 40, VERIFY, "signature_invalid"),
            Flip("body_cpu_svn", 48, VERIFY, "signature_invalid"),
            Flip("body_attributes_debug_bit", 48 + 48, VERIFY, "signature_invalid", mask=0x02),
            Flip("measurement_mrenclave", 48 + 64, VERIFY, "signature_invalid"),
            Flip("measurement_mrsigner", 48 + 128, VERIFY, "signature_invalid"),
            Flip("body_isv_svn", 48 + 258, VERIFY, "signature_invalid"),
            Flip("report_data", 48 + 320, VERIFY, "signature_invalid"),
            Flip("report_data_last", signed - 1, VERIFY, "signature_invalid"),
        ),
        signature_flips=tuple(
            Flip(f"signature+{k}", sig + k, VERIFY, "signature_invalid") for k in (0, 31, 32, 63)
        ),
        embedded_flips=(
            Flip("pck_leaf_pem", pem + 11, VERIFY, "chain_invalid"),
            Flip("pck_processor_ca_pem", pem + 1639, VERIFY, "untrusted_root"),
            # As for TDX: an unreadable certificate anywhere in the chain is chain_invalid.
            Flip("pck_leaf_names", pem + 107, VERIFY, "chain_invalid"),  # undecodable name
            Flip("processor_ca_der_a", pem + 2082, VERIFY, "chain_invalid"),  # key type
            Flip("processor_ca_der_b", pem + 2214, VERIFY, "chain_invalid"),  # extension value
            Flip("processor_ca_der_c", pem + 2414, VERIFY, "chain_invalid"),  # dup. extension
            Flip("root_copy_der", pem + 3029, VERIFY, "chain_invalid"),  # key type
        ),
        truncations=(
            (0, "quote_truncated"),
            (1, "quote_truncated"),
            (len(ev) // 2, "quote_truncated"),
            (len(ev) - 1, "quote_truncated"),
        ),
        appended_byte=None,
        wrong_roots=_dcap_wrong_roots(roots),
        out_of_window=(
            OutOfWindow(pin("2025-06-19T10:30:00Z"), "collateral_not_yet_valid"),  # TCB info
            OutOfWindow(pin("2025-07-19T10:01:19Z"), "collateral_expired"),  # QE identity
            OutOfWindow(pin("2032-01-01T00:00:00Z"), "certificate_expired"),  # PCK leaf
        ),
        distinct=5,
        debug=_dcap_debug(roots, tdx=False),
        tcb=TcbCase({"acceptedTcbStatuses": ["UpToDate"]}, "tcb_status_not_accepted"),
    )


def _nvidia(roots: TrustRoots) -> Case:
    base = "nvidia/hopper_trustee"
    text = _read(f"{base}/report.hex")
    ev = bytes.fromhex(text.decode())
    chain = _read(f"{base}/cert_chain.pem")
    report = parse_measurement_report(ev)
    signed = len(report.signed)
    fwid = bytes.fromhex(
        "f5c384aebb579217a2c66b17ed0f28e6a9b8d639041acd7b4721cec004f7275494ba94bb5cdfdb3055ee051762b1f75d"
    )
    responder_nonce = ev.index(report.responder_nonce)
    subject = Subject(ev, {"cert_chain": chain}, pin("2026-01-01T00:00:00Z"), roots)

    def never_expires() -> None:
        certs = [x509.load_der_x509_certificate(d) for d in load_pem_chain(chain)]
        assert {c.not_valid_after_utc.year for c in certs} == {9999}

    def never_debug() -> None:
        from certs.evidence.registry import build_verifiers

        v = build_verifiers(roots)[Tee.NVIDIA_GPU]
        for name in ("hopper_trustee", "hopper_coco_trustee"):
            claims = v.verify(
                _read(f"nvidia/{name}/report.hex"),
                now=subject.now,
                collateral={"cert_chain": _read(f"nvidia/{name}/cert_chain.pem")},
            )
            assert claims.debug is False and claims.tcb == {} and claims.tcb_status is None

    return Case(
        tee=Tee.NVIDIA_GPU,
        vector=f"{base}/report.hex (decoded to binary; the hex text is checked as another form)",
        subject=subject,
        section="nvidiaGpu",
        refs=None,
        other_forms=(text,),
        signed_flips=(
            Flip("request_param1_signature_bit", 2, FORMAT, "spdm_invalid"),
            Flip("request_param2_operation", 3, VERIFY, "signature_invalid"),
            Flip("report_data_request_nonce", 4, VERIFY, "signature_invalid"),
            Flip("report_data_request_nonce_last", 35, VERIFY, "signature_invalid"),
            Flip("response_header", 37, FORMAT, "spdm_invalid"),
            Flip("response_block_count", 41, FORMAT, "truncated"),
            Flip("response_record_length", 42, FORMAT, "spdm_invalid"),
            Flip("measurement_block_0_value", 52, VERIFY, "signature_invalid"),
            Flip("responder_nonce", responder_nonce, VERIFY, "signature_invalid"),
            Flip("opaque_fwid", ev.index(fwid), VERIFY, "signature_invalid"),
            Flip("signed_last_byte", signed - 1, VERIFY, "signature_invalid"),
        ),
        signature_flips=tuple(
            Flip(f"signature+{k}", signed + k, VERIFY, "signature_invalid") for k in (0, 47, 48, 95)
        ),
        # one byte: not the binary magic, so it is read as (odd-length) hex text
        truncations=(
            (0, "truncated"),
            (1, "hex_invalid"),
            (len(ev) // 2, "truncated"),
            (len(ev) - 1, "truncated"),
        ),
        appended_byte=None,
        wrong_roots=(
            WrongRoot(
                "nitro_root", dataclasses.replace(roots, nvidia=roots.nitro), "untrusted_root"
            ),
            WrongRoot(
                "forged_same_name_p384",
                dataclasses.replace(
                    roots, nvidia=_forged_root(roots.nvidia, _p384(), hashes.SHA384())
                ),
                "untrusted_root",
            ),
        ),
        out_of_window=(OutOfWindow(pin("2022-02-28T23:59:59Z"), "certificate_not_yet_valid"),),
        distinct=3,
        absences=(
            Absence(
                "expiry",
                "every certificate of the device chain runs to 9999-12-31 (README "
                "section 5), so no time after the window exists",
                never_expires,
            ),
            Absence(
                "debug",
                "an SPDM measurement report has no debug indicator; the verifier "
                "always reports debug=False",
                never_debug,
            ),
            Absence(
                "tcb",
                "no TCB concept offline (no RIMs/OCSP in the vectors); the nvidiaGpu "
                "policy section has no TCB key",
                lambda: _expect_policy_error(
                    "nvidiaGpu",
                    {"measurements": {"0": ["00"]}, "minimumTcb": {"snp": 1}},
                    Tee.NVIDIA_GPU,
                ),
            ),
            Absence(
                "policy_refs",
                "the README gives no golden measurement values (no RIMs), so "
                "there is no README policy that admits the vector",
                lambda: None,
            ),
        ),
    )


def _sim_report(*, debug: bool) -> tuple[bytes, bytes, bytes]:
    spki = WORKLOAD_KEY.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    report = sim.build_report(
        SIM_KEY,
        report_data=expected_report_data(SIM_NONCE, spki),
        measurement=SIM_MEASUREMENT,
        debug=debug,
    )
    return report, SIM_NONCE, spki


def _first_digit_after(ev: bytes, marker: bytes) -> int:
    start = ev.index(marker) + len(marker)
    return next(i for i in range(start, len(ev)) if chr(ev[i]).isdigit())


def _sim(roots: TrustRoots) -> Case:
    ev, nonce, spki = _sim_report(debug=False)
    keys = sim_keys()
    now = pin("2026-01-01T00:00:00Z")
    sig = len(ev) - sim.SIG_LEN

    def timeless() -> None:
        from certs.evidence.registry import build_verifiers

        v = build_verifiers(roots, sim_keys=keys)[Tee.SIM]
        for when in (datetime(1970, 1, 1, tzinfo=UTC), datetime(9999, 1, 1, tzinfo=UTC)):
            assert v.verify(ev, now=when, collateral={}).tee is Tee.SIM

    return Case(
        tee=Tee.SIM,
        vector="built here with certs.evidence.sim.build_report and a derived P-256 key",
        subject=Subject(ev, {}, now, roots, keys),
        section="sim",
        refs={"measurement": [SIM_MEASUREMENT.hex()]},
        signed_flips=(
            Flip("header_magic", 0, FORMAT, "bad_magic"),
            Flip("header_body_length", len(sim.MAGIC) + 1, FORMAT, "truncated"),
            Flip("body_debug_literal", ev.index(b'"debug":') + 8, FORMAT, "body_invalid"),
            Flip(
                "measurement",
                _first_digit_after(ev, b'"measurement":"'),
                VERIFY,
                "signature_invalid",
            ),
            Flip(
                "report_data",
                _first_digit_after(ev, b'"report_data":"'),
                VERIFY,
                "signature_invalid",
            ),
            Flip("body_svn", _first_digit_after(ev, b'"svn":'), VERIFY, "signature_invalid"),
        ),
        signature_flips=tuple(
            Flip(f"signature+{k}", sig + k, VERIFY, "signature_invalid") for k in (0, 31, 32, 63)
        ),
        truncations=(
            (0, "bad_magic"),
            (1, "bad_magic"),
            (len(ev) // 2, "truncated"),
            (len(ev) - 1, "truncated"),
        ),
        appended_byte="truncated",
        wrong_roots=(
            WrongRoot(
                "other_platform_key",
                roots,
                "signature_invalid",
                sim_keys=(OTHER_SIM_KEY.public_key(),),
                why="the configured platform key is both root and signer: there is no "
                "chain, so a wrong key is a signature failure",
            ),
        ),
        out_of_window=(),
        distinct=1,
        shared=frozenset({"signature_invalid"}),
        debug=DebugCase(
            Subject(_sim_report(debug=True)[0], {}, now, roots, keys),
            {"measurement": [SIM_MEASUREMENT.hex()]},
            "sim report built with debug=True",
        ),
        binding=(nonce, spki),
        absences=(
            Absence(
                "window",
                "a simulated report has no certificates or collateral; the verifier ignores time",
                timeless,
            ),
            Absence(
                "tcb",
                "a simulated report has only an SVN and the sim policy section has no TCB/SVN key",
                lambda: _expect_policy_error(
                    "sim", {"measurement": ["00"], "minimumSvn": 2}, Tee.SIM
                ),
            ),
        ),
    )


@functools.cache
def all_cases() -> tuple[Case, ...]:
    """Every registered TEE's case, in ``SNIFFERS`` order."""
    roots = bundled_roots()
    return (_nitro(roots), _nvidia(roots), _snp(roots), _tdx(roots), _sgx(roots), _sim(roots))
