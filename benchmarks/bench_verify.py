"""Verification cost per TEE, against the cost of the signatures alone.

Run: ``.venv/bin/python -m benchmarks.bench_verify [--rounds N] [--json]``

For every TEE with a real vector (``../shared/vectors``), at the vector's pin time:

* **cold**: median (and minimum) ``verify`` time on a freshly constructed verifier
  (construction not timed; nothing cached yet, the first call parses and verifies everything;
  note SevSnpVerifier checks its pinned ARK/ASK at construction). On a busy machine cold
  samples are bimodal, so the minimum is printed too;
* **warm**: median ``verify`` time on one verifier called repeatedly (caches warm);
* **sig all**: median time of every signature verification the evidence depends on, done directly
  with ``cryptography`` with keys pre-loaded (the lower bound of a verifier without caches);
* **sig evidence**: the signature over the evidence itself (what no cache can avoid when the
  evidence is fresh, i.e. the lower bound for a warm verifier);
* **dcap-qvl**: for SGX/TDX, ``dcap_qvl.verify`` (Rust) on the same quote and collateral, if
  installed.

Ratios: cold / sig all (median and min), warm / sig all, warm / sig evidence.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from certs.collateral.roots import TrustRoots, bundled_roots
from certs.evidence import dcap, nitro, nvidia_gpu, sev_snp
from certs.evidence.claims import Verifier
from certs.evidence.registry import build_verifiers, detect_tee

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO.parent / "shared" / "vectors"

Check = Callable[[], None]


@dataclass(frozen=True)
class Case:
    label: str
    evidence: bytes
    collateral: Mapping[str, bytes]
    now: datetime
    signatures_all: tuple[Check, ...]
    signatures_evidence: tuple[Check, ...]
    dcap_qvl: Check | None = None


def _at(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _raw_ecdsa(key: ec.EllipticCurvePublicKey, rs: bytes, data: bytes) -> Check:
    """Check for a raw big-endian r||s signature."""
    half = len(rs) // 2
    r, s = int.from_bytes(rs[:half]), int.from_bytes(rs[half:])
    der = encode_dss_signature(r, s)
    algorithm = ec.ECDSA(hashes.SHA384() if key.curve.key_size == 384 else hashes.SHA256())
    return lambda: key.verify(der, data, algorithm)


def _cert_link(child: x509.Certificate, parent: x509.Certificate) -> Check:
    key = parent.public_key()
    sig, tbs = child.signature, child.tbs_certificate_bytes
    hash_algorithm = child.signature_hash_algorithm
    assert hash_algorithm is not None
    if isinstance(key, ec.EllipticCurvePublicKey):
        ecdsa = ec.ECDSA(hash_algorithm)
        return lambda: key.verify(sig, tbs, ecdsa)
    assert isinstance(key, rsa.RSAPublicKey)
    pss = padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=48)
    return lambda: key.verify(sig, tbs, pss, hashes.SHA384())


def _crl_check(data: bytes, issuer: x509.Certificate) -> Check:
    crl = (
        x509.load_pem_x509_crl(data)
        if data.lstrip().startswith(b"-----")
        else x509.load_der_x509_crl(data)
    )
    key = issuer.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    ecdsa = ec.ECDSA(hashes.SHA256())
    sig, tbs = crl.signature, crl.tbs_certlist_bytes
    return lambda: key.verify(sig, tbs, ecdsa)


def nitro_case() -> Case:
    evidence = (VECTORS / "nitro/veracruz_eu-west-1_20221109.cbor").read_bytes()
    doc = nitro.parse_attestation_document(evidence)
    certs = [x509.load_der_x509_certificate(d) for d in doc.chain()]  # leaf first, root last
    links = tuple(_cert_link(certs[i], certs[i + 1]) for i in range(len(certs) - 1))
    leaf_key = certs[0].public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
    cose = _raw_ecdsa(leaf_key, doc.signature, doc.signed_bytes())
    return Case(
        "nitro veracruz", evidence, {}, _at("2022-11-09T23:00:00Z"), (*links, cose), (cose,)
    )


def nvidia_case() -> Case:
    folder = VECTORS / "nvidia/hopper_trustee"
    evidence = (folder / "report.hex").read_bytes()
    pem = (folder / "cert_chain.pem").read_bytes()
    report = nvidia_gpu.parse_measurement_report(evidence)
    certs = x509.load_pem_x509_certificates(pem)
    links = tuple(_cert_link(certs[i], certs[i + 1]) for i in range(len(certs) - 1))
    leaf_key = certs[0].public_key()
    assert isinstance(leaf_key, ec.EllipticCurvePublicKey)
    spdm = _raw_ecdsa(leaf_key, report.signature, report.signed)
    return Case(
        "nvidia hopper",
        evidence,
        {"cert_chain": pem},
        _at("2025-01-01T00:00:00Z"),
        (*links, spdm),
        (spdm,),
    )


def snp_case(roots: TrustRoots) -> Case:
    folder = VECTORS / "sev-snp/milan_v2_gosevguest"
    evidence = (folder / "report.bin").read_bytes()
    vcek_der = (folder / "vcek.der").read_bytes()
    report = sev_snp.parse_report(evidence)
    ask, ark = x509.load_pem_x509_certificates(roots.amd_chains[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # VCEKs carry serial number 0
        vcek = x509.load_der_x509_certificate(vcek_der)
        vcek_key = vcek.public_key()
    assert isinstance(vcek_key, ec.EllipticCurvePublicKey)
    rs = report.signature_r[:48][::-1] + report.signature_s[:48][::-1]  # LE 72 -> BE 48
    sig = _raw_ecdsa(vcek_key, rs, report.signed)
    links = (_cert_link(ark, ark), _cert_link(ask, ark), _cert_link(vcek, ask))
    return Case(
        "sev-snp milan v2",
        evidence,
        {"vcek": vcek_der},
        _at("2023-01-01T00:00:00Z"),
        (*links, sig),
        (sig,),
    )


def _dcap_qvl(quote: bytes, collateral_json: bytes, now: datetime) -> Check | None:
    try:
        import dcap_qvl
    except ImportError:
        return None
    collateral = dcap_qvl.QuoteCollateralV3.from_json(collateral_json.decode())
    seconds = int(now.timestamp())
    return lambda: dcap_qvl.verify(quote, collateral, seconds)


def dcap_case(label: str, folder: str, root_der: bytes) -> Case:
    quote_bytes = (VECTORS / folder / "quote.bin").read_bytes()
    collateral_json = (VECTORS / folder / "collateral.json").read_bytes()
    now = _at("2025-06-20T00:00:00Z")
    quote = dcap.parse_quote(quote_bytes)
    coll = dcap.parse_collateral({"collateral_json": collateral_json})
    root = x509.load_der_x509_certificate(root_der)
    pck_leaf, pck_ca = x509.load_pem_x509_certificates(quote.signature.pck_chain_pem)[:2]
    pck_key = pck_leaf.public_key()
    assert isinstance(pck_key, ec.EllipticCurvePublicKey)
    att_key = ec.EllipticCurvePublicKey.from_encoded_point(
        ec.SECP256R1(), b"\x04" + quote.signature.attestation_key
    )
    quote_sig = _raw_ecdsa(att_key, quote.signature.signature, quote.signed)
    checks: list[Check] = [
        _cert_link(pck_leaf, pck_ca),
        _cert_link(pck_ca, root),
        _raw_ecdsa(pck_key, quote.signature.qe_report_signature, quote.signature.qe_report_raw),
        quote_sig,
    ]
    assert coll.tcb_info is not None and coll.qe_identity is not None
    signing = x509.load_pem_x509_certificates(coll.tcb_info.issuer_chain_pem)[0]
    signing_key = signing.public_key()
    assert isinstance(signing_key, ec.EllipticCurvePublicKey)
    checks += [
        _cert_link(signing, root),
        _raw_ecdsa(signing_key, coll.tcb_info.signature, coll.tcb_info.body),
        _raw_ecdsa(signing_key, coll.qe_identity.signature, coll.qe_identity.body),
    ]
    if coll.pck_crl is not None and coll.root_ca_crl is not None:
        checks += [_crl_check(coll.pck_crl, pck_ca), _crl_check(coll.root_ca_crl, root)]
    return Case(
        label,
        quote_bytes,
        {"collateral_json": collateral_json},
        now,
        tuple(checks),
        (quote_sig,),
        _dcap_qvl(quote_bytes, collateral_json, now),
    )


def _median_ms(fn: Callable[[], Any], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1e6


def _all(checks: tuple[Check, ...]) -> Callable[[], None]:
    def run() -> None:
        for check in checks:
            check()

    return run


def measure(case: Case, roots: TrustRoots, rounds: int) -> dict[str, Any]:
    tee = detect_tee(case.evidence)

    def fresh() -> Verifier:
        return build_verifiers(roots)[tee]

    cold_samples = []
    for _ in range(max(20, rounds // 10)):
        verifier = fresh()
        start = time.perf_counter_ns()
        verifier.verify(case.evidence, now=case.now, collateral=case.collateral)
        cold_samples.append(time.perf_counter_ns() - start)
    cold = statistics.median(cold_samples) / 1e6
    cold_min = min(cold_samples) / 1e6
    warm_verifier = fresh()
    warm_verifier.verify(case.evidence, now=case.now, collateral=case.collateral)
    warm = _median_ms(
        lambda: warm_verifier.verify(case.evidence, now=case.now, collateral=case.collateral),
        rounds,
    )
    sig_all = _median_ms(_all(case.signatures_all), rounds)
    sig_evidence = _median_ms(_all(case.signatures_evidence), rounds)
    qvl = _median_ms(case.dcap_qvl, rounds) if case.dcap_qvl else None
    return {
        "tee": str(tee),
        "vector": case.label,
        "cold_ms": cold,
        "cold_min_ms": cold_min,
        "warm_ms": warm,
        "sig_all_ms": sig_all,
        "sig_all_count": len(case.signatures_all),
        "sig_evidence_ms": sig_evidence,
        "dcap_qvl_ms": qvl,
        "cold_over_sig_all": cold / sig_all,
        "cold_min_over_sig_all": cold_min / sig_all,
        "warm_over_sig_all": warm / sig_all,
        "warm_over_sig_evidence": warm / sig_evidence,
    }


def cases(roots: TrustRoots) -> list[Case]:
    return [
        nitro_case(),
        nvidia_case(),
        snp_case(roots),
        dcap_case("tdx dcap-qvl v4", "tdx/dcapqvl_v4", roots.intel_sgx_root),
        dcap_case("sgx dcap-qvl v3", "sgx-dcap/dcapqvl_sgx_v3", roots.intel_sgx_root),
    ]


def render(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'tee':<11} {'vector':<17} {'cold ms':>8} {'(min)':>6} {'warm ms':>8} "
        f"{'sig all ms':>13} {'sig ev ms':>9} {'cold/all':>8} {'min/all':>7} {'warm/all':>8} "
        f"{'warm/ev':>8} {'dcap-qvl ms':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        qvl = f"{r['dcap_qvl_ms']:.3f}" if r["dcap_qvl_ms"] is not None else "-"
        sig_all = f"{r['sig_all_ms']:.3f} ({r['sig_all_count']})"
        lines.append(
            f"{r['tee']:<11} {r['vector']:<17} {r['cold_ms']:>8.3f} {r['cold_min_ms']:>6.2f} "
            f"{r['warm_ms']:>8.3f} {sig_all:>13} {r['sig_evidence_ms']:>9.3f} "
            f"{r['cold_over_sig_all']:>8.2f} {r['cold_min_over_sig_all']:>7.2f} "
            f"{r['warm_over_sig_all']:>8.2f} {r['warm_over_sig_evidence']:>8.2f} {qvl:>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_verify")
    parser.add_argument("--rounds", type=int, default=200, help="timed calls per measurement")
    parser.add_argument("--json", action="store_true", help="print JSON rows")
    args = parser.parse_args(argv)
    if not VECTORS.is_dir():
        print(f"vectors not found at {VECTORS}", file=sys.stderr)
        return 2
    roots = bundled_roots()
    rows = [measure(case, roots, args.rounds) for case in cases(roots)]
    print(json.dumps(rows, indent=2) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
