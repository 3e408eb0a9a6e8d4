"""Certificates under mutation: every verifier raises only the project's errors, never accepts.

A single-bit flip scan over the certificates of every vector (all 8 bits of every byte: about
115,000 verifications, 40 s) found foreign exceptions and warnings escaping from certificate
handling in x509chain, dcap and sev_snp, and flips that were accepted (the VCEK's unsigned
outer RSASSA-PSS parameters, the unused-bits byte of ECDSA signatures, SNP's reserved signature
bytes). This file keeps that scan, sampled to stay fast: every certificate byte of every target
is flipped at least once per two bytes (one bit, rotating), hypothesis draws further flips and
multi-byte mutations, and the strict parser meets arbitrary bytes. ``python -W error -m
tests.unit.evidence.test_cert_robustness`` runs the full scan over the targets below (every bit
of every byte: 155,152 verifications, about a minute; at this commit every one ends in a project
error and none is accepted).

Targets (certificates as the verifier receives them):

- Nitro: the leaf and CA bundle inside the COSE document (flipped in place in the evidence);
- TDX / SGX: the PCK chain inside the quote (flipped in the DER, PEM re-encoded in place);
- SEV-SNP: the ``vcek`` collateral (DER) and a ``cert_chain`` override (ASK + ARK, PEM);
- NVIDIA: the device chain collateral ``cert_chain`` (PEM);
- Intel DCAP collateral: the root CA and PCK CRLs (DER, hex in the collateral JSON).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certs.errors import (
    AttestmeshError,
    CollateralError,
    EvidenceFormatError,
    EvidenceVerificationError,
)
from certs.evidence.claims import Tee, Verifier
from certs.evidence.dcap import parse_quote
from certs.evidence.nitro import parse_attestation_document
from certs.evidence.registry import build_verifiers
from certs.evidence.sev_snp import REPORT_SIZE, SIGNED_LEN, load_amd_certificate
from certs.evidence.x509chain import ParsedCertificate, parse_certificate, parse_certificates
from tests.unit.evidence.conformance_cases import Case, Subject, all_cases
from tests.vectors import VECTORS

PROJECT_ERRORS = (EvidenceFormatError, EvidenceVerificationError, CollateralError)

Collateral = Mapping[str, bytes]


def _case(tee: Tee) -> Case:
    return next(c for c in all_cases() if c.tee is tee)


def _der(pem: bytes) -> tuple[bytes, ...]:
    return tuple(c.der for c in parse_certificates(pem, allow_nonpositive_serial=True))


def _pem(ders: tuple[bytes, ...]) -> bytes:
    return b"".join(
        b"-----BEGIN CERTIFICATE-----\n" + base64.encodebytes(d) + b"-----END CERTIFICATE-----\n"
        for d in ders
    )


def _flip(data: bytes, offset: int, mask: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= mask
    return bytes(out)


@dataclass(frozen=True, eq=False)
class Target:
    """Certificates (DER) a verifier reads, and how mutated ones go back into its input."""

    name: str
    tee: Tee
    subject: Subject
    ders: tuple[bytes, ...]
    rebuild: Callable[[tuple[bytes, ...]], tuple[bytes, Collateral]]
    """Same-length DERs -> (evidence, collateral)."""


def _nitro() -> Target:
    case = _case(Tee.NITRO)
    ev = case.subject.evidence
    doc = parse_attestation_document(ev)
    ders = (doc.certificate, *doc.cabundle)
    spans = [ev.index(d) for d in ders]

    def rebuild(new: tuple[bytes, ...]) -> tuple[bytes, Collateral]:
        out = bytearray(ev)
        for at, der in zip(spans, new, strict=True):
            out[at : at + len(der)] = der
        return bytes(out), case.subject.collateral

    return Target("nitro-cabundle", Tee.NITRO, case.subject, ders, rebuild)


def _dcap(tee: Tee) -> Target:
    """PCK chain in the quote: each PEM block re-encoded with the original line layout, so the
    quote's lengths stay valid."""
    case = _case(tee)
    ev = case.subject.evidence
    pem = parse_quote(ev).signature.pck_chain_pem
    at = ev.index(pem)
    ders = _der(pem)
    blocks: list[tuple[int, int]] = []
    end = 0
    for _ in ders:
        start = pem.index(b"-----BEGIN CERTIFICATE-----", end)
        end = pem.index(b"-----END CERTIFICATE-----", start) + len(b"-----END CERTIFICATE-----")
        blocks.append((start, end))

    def rebuild(new: tuple[bytes, ...]) -> tuple[bytes, Collateral]:
        out = bytearray(pem)
        for (start, stop), der in zip(blocks, new, strict=True):
            lines = pem[start:stop].split(b"\n")
            body = base64.b64encode(der)
            parts, pos = [], 0
            for line in lines[1:-1]:
                parts.append(body[pos : pos + len(line)])
                pos += len(line)
            out[start:stop] = b"\n".join([lines[0], *parts, lines[-1]])
        return ev[:at] + bytes(out) + ev[at + len(pem) :], case.subject.collateral

    return Target(f"{tee.value}-pck-chain", tee, case.subject, ders, rebuild)


def _vcek() -> Target:
    case = _case(Tee.SEV_SNP)
    vcek = case.subject.collateral["vcek"]
    return Target(
        "sev-snp-vcek",
        Tee.SEV_SNP,
        case.subject,
        (vcek,),
        lambda new: (case.subject.evidence, {**case.subject.collateral, "vcek": new[0]}),
    )


def _amd_cert_chain() -> Target:
    case = _case(Tee.SEV_SNP)
    ders = _der((VECTORS / "sev-snp/amd/ask_ark_milan.pem").read_bytes())
    return Target(
        "sev-snp-cert-chain",
        Tee.SEV_SNP,
        case.subject,
        ders,
        lambda new: (case.subject.evidence, {**case.subject.collateral, "cert_chain": _pem(new)}),
    )


def _nvidia() -> Target:
    case = _case(Tee.NVIDIA_GPU)
    return Target(
        "nvidia-cert-chain",
        Tee.NVIDIA_GPU,
        case.subject,
        _der(case.subject.collateral["cert_chain"]),
        lambda new: (case.subject.evidence, {"cert_chain": _pem(new)}),
    )


def _dcap_crls() -> Target:
    """The TDX collateral's two CRLs (not certificates, but read by the same strict guard)."""
    case = _case(Tee.TDX)
    doc = json.loads(case.subject.collateral["collateral_json"])
    names = ("root_ca_crl", "pck_crl")
    ders = tuple(bytes.fromhex(doc[n]) for n in names)

    def rebuild(new: tuple[bytes, ...]) -> tuple[bytes, Collateral]:
        edited = {**doc, **{n: d.hex() for n, d in zip(names, new, strict=True)}}
        return case.subject.evidence, {"collateral_json": json.dumps(edited).encode()}

    return Target("tdx-collateral-crls", Tee.TDX, case.subject, ders, rebuild)


@functools.cache
def targets() -> tuple[Target, ...]:
    return (
        _nitro(),
        _dcap(Tee.TDX),
        _dcap(Tee.SGX),
        _vcek(),
        _amd_cert_chain(),
        _nvidia(),
        _dcap_crls(),
    )


_VERIFIERS: dict[str, Verifier] = {}


def _verifier(target: Target) -> Verifier:
    """One verifier per target, built once (its caches warm across mutations, as in service)."""
    if target.name not in _VERIFIERS:
        subject = target.subject
        registry = build_verifiers(subject.roots, sim_keys=subject.sim_keys or None)
        _VERIFIERS[target.name] = registry[target.tee]
    return _VERIFIERS[target.name]


def _outcome(target: Target, ders: tuple[bytes, ...]) -> str:
    """The project error's ``Type:reason``; fails on acceptance or anything foreign."""
    evidence, collateral = target.rebuild(ders)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning escaping the verifier is a failure too
        try:
            _verifier(target).verify(evidence, now=target.subject.now, collateral=collateral)
        except PROJECT_ERRORS as exc:
            return f"{type(exc).__name__}:{exc.reason}"
    raise AssertionError(f"{target.name}: mutated certificate accepted")


def _mutated(target: Target, index: int, der: bytes) -> tuple[bytes, ...]:
    return tuple(der if i == index else d for i, d in enumerate(target.ders))


def _ids(target: Target) -> str:
    return target.name


# ---------------------------------------------------------------------------------------------
# the real inputs verify through the rebuild (so a failure below is the mutation's doing)


@pytest.mark.parametrize("target", targets(), ids=_ids)
def test_unmutated_rebuild_verifies(target: Target) -> None:
    evidence, collateral = target.rebuild(target.ders)
    claims = _verifier(target).verify(evidence, now=target.subject.now, collateral=collateral)
    assert claims.tee is target.tee


# ---------------------------------------------------------------------------------------------
# single-bit flips: deterministic sweep (half the bytes, every bit position) and hypothesis


def _sweep(target: Target, *, every: int) -> Iterator[tuple[int, int, int]]:
    """(certificate index, offset, mask): every ``every``-th byte, the bit rotating."""
    for index, der in enumerate(target.ders):
        for offset in range(index % every, len(der), every):
            yield index, offset, 1 << ((offset // every) % 8)


@pytest.mark.parametrize("target", targets(), ids=_ids)
def test_single_bit_flip_sweep_raises_only_project_errors(target: Target) -> None:
    seen: Counter[str] = Counter()
    for index, offset, mask in _sweep(target, every=2):
        der = _flip(target.ders[index], offset, mask)
        seen[_outcome(target, _mutated(target, index, der))] += 1
    assert sum(seen.values()) >= sum(len(d) for d in target.ders) // 2
    # The flips reach past parsing into the chain checks, not only the DER decoder.
    verification = {k for k in seen if k.startswith("EvidenceVerificationError:")}
    assert verification, seen


@st.composite
def _flip_in(draw: st.DrawFn, target: Target) -> tuple[int, bytes]:
    index = draw(st.integers(0, len(target.ders) - 1))
    der = target.ders[index]
    offset = draw(st.integers(0, len(der) - 1))
    return index, _flip(der, offset, 1 << draw(st.integers(0, 7)))


@st.composite
def _scribble_in(draw: st.DrawFn, target: Target) -> tuple[int, bytes]:
    """1-4 bytes overwritten with arbitrary values (same length)."""
    index = draw(st.integers(0, len(target.ders) - 1))
    out = bytearray(target.ders[index])
    for _ in range(draw(st.integers(1, 4))):
        out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
    return index, bytes(out)


@pytest.mark.parametrize("target", targets(), ids=_ids)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_certificate_mutations_raise_only_project_errors(
    target: Target, data: st.DataObject
) -> None:
    index, der = data.draw(st.one_of(_flip_in(target), _scribble_in(target)))
    if der == target.ders[index]:
        return  # a scribble that wrote back the original bytes
    _outcome(target, _mutated(target, index, der))


# ---------------------------------------------------------------------------------------------
# the specific gaps the scan found, pinned


def _outer_algorithm_span(der: bytes) -> range:
    """Offsets of the outer signatureAlgorithm (after tbsCertificate, before the signature)."""
    tbs = parse_certificate(der, allow_nonpositive_serial=True).cert.tbs_certificate_bytes
    start = der.index(tbs) + len(tbs)
    return range(start, start + 2 + der[start + 1])


def test_vcek_outer_pss_parameters_are_not_malleable() -> None:
    """The outer copy of the RSASSA-PSS AlgorithmIdentifier is not signed; cryptography does
    not use its MGF/salt fields, so flips there (VCEK bytes 809-842) used to be accepted. The
    strict parser now requires it to equal the signed copy in tbsCertificate."""
    target = _vcek()
    vcek = target.ders[0]
    span = _outer_algorithm_span(vcek)
    assert (span.start, span.stop) == (771, 843)  # the accepted flips were at 809-842
    outcomes = {
        _outcome(target, (_flip(vcek, offset, 1 << bit),)) for offset in span for bit in range(8)
    }
    assert outcomes <= {"EvidenceFormatError:certificate_invalid"}, outcomes


@pytest.mark.parametrize(
    "target", [t for t in targets() if t.tee is not Tee.SEV_SNP and "crl" not in t.name], ids=_ids
)
def test_signature_unused_bits_are_not_malleable(target: Target) -> None:
    """An ECDSA signature BIT STRING's unused-bits byte is outside the signature; cryptography
    ignored a non-zero value (the certificate then differed but verified). Now rejected."""
    for index, der in enumerate(target.ders):
        span = _outer_algorithm_span(der)
        unused_bits = span.stop + 2 if der[span.stop + 1] < 0x80 else span.stop + 3
        assert der[span.stop] == 0x03 and der[unused_bits] == 0
        outcome = _outcome(target, _mutated(target, index, _flip(der, unused_bits, 0x01)))
        assert outcome.split(":")[1] in {"certificate_invalid", "chain_invalid"}, outcome


def test_snp_report_every_byte_is_covered() -> None:
    """Every byte of the SNP report: signed (0x000-0x29F), R/S (0x2A0-0x32F), or reserved and
    required zero (0x330-0x49F). No flip is accepted; reserved ones are format errors."""
    case = _case(Tee.SEV_SNP)
    verifier = build_verifiers(case.subject.roots)[Tee.SEV_SNP]
    ev = case.subject.evidence
    assert not any(ev[SIGNED_LEN + 144 :])
    for offset in range(REPORT_SIZE):
        mutated = _flip(ev, offset, 1 << (offset % 8))
        with pytest.raises(AttestmeshError) as info:
            verifier.verify(mutated, now=case.subject.now, collateral=case.subject.collateral)
        assert isinstance(info.value, PROJECT_ERRORS)
        if offset >= SIGNED_LEN + 144:
            assert (type(info.value), info.value.reason) == (
                EvidenceFormatError,
                "report_field_invalid",
            )


def test_every_snp_vector_has_zero_reserved_signature_bytes() -> None:
    for name in (
        "milan_v2_gosevguest/report.bin",
        "milan_v2_idblock_trustee/report.bin",
        "milan_v3_vlek_aws_trustee/report.bin",
        "genoa_v3_azure_trustee/report.bin",
    ):
        report = (VECTORS / "sev-snp" / name).read_bytes()
        assert len(report) == REPORT_SIZE and not any(report[SIGNED_LEN + 144 :]), name
    hcl = (VECTORS / "sev-snp/genoa_v3_azure_trustee/hcl_report.bin").read_bytes()
    assert not any(hcl[32 + SIGNED_LEN + 144 : 32 + REPORT_SIZE])


# ---------------------------------------------------------------------------------------------
# the strict parser itself


def _all_vector_certificates() -> list[tuple[str, bytes]]:
    found = []
    for path in sorted(VECTORS.rglob("*")):
        if path.suffix not in {".pem", ".der"} or "crl" in path.name:
            continue
        data = path.read_bytes()
        ders = _der(data) if b"-----BEGIN" in data else (data,)
        found += [(f"{path.relative_to(VECTORS)}#{i}", d) for i, d in enumerate(ders)]
    return found


def _read_everything(parsed: ParsedCertificate) -> None:
    """Every attribute the verifiers read, straight from the cryptography object."""
    cert = parsed.cert
    cert.subject.rfc4514_string()
    cert.issuer.rfc4514_string()
    cert.public_key()
    cert.signature_hash_algorithm  # noqa: B018
    cert.signature_algorithm_parameters  # noqa: B018
    list(cert.extensions)
    cert.not_valid_before_utc  # noqa: B018
    cert.not_valid_after_utc  # noqa: B018
    cert.tbs_certificate_bytes  # noqa: B018


def test_every_vector_certificate_parses_strictly() -> None:
    """The canonical-form checks hold for every real certificate; AMD's serial-0 warning is
    tolerated only when asked (``load_amd_certificate``)."""
    certs = _all_vector_certificates()
    assert len(certs) >= 30
    for name, der in certs:
        amd = "sev-snp" in name
        parsed = (
            parse_certificate(der, allow_nonpositive_serial=True) if amd else parse_certificate(der)
        )
        assert parsed.der == der, name
        if amd:
            load_amd_certificate(der)
        if parsed.serial_number <= 0:
            with pytest.raises(EvidenceFormatError, match="serial number"):
                parse_certificate(der)


def test_the_guard_leaves_the_warning_filters_alone() -> None:
    vcek = _vcek().ders[0]
    before = list(warnings.filters)
    parse_certificate(vcek, allow_nonpositive_serial=True)
    with pytest.raises(EvidenceFormatError):
        parse_certificate(vcek)
    assert warnings.filters == before


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_parse_certificate_on_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        parse_certificates(data)
    with contextlib.suppress(EvidenceFormatError):
        parse_certificate(b"-----BEGIN CERTIFICATE-----\n" + data)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_parse_certificate_on_mutated_vector_certificates(data: st.DataObject) -> None:
    """Mutated real certificates either fail as certificate_invalid or parse to a certificate
    whose every read attribute decodes without error or warning afterwards."""
    certs = _all_vector_certificates()
    name, der = data.draw(st.sampled_from(certs))
    out = bytearray(der)
    for _ in range(data.draw(st.integers(1, 3))):
        out[data.draw(st.integers(0, len(out) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        parsed = parse_certificate(bytes(out), allow_nonpositive_serial="sev-snp" in name)
    except EvidenceFormatError as exc:
        assert exc.reason == "certificate_invalid"
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if parsed.serial_number <= 0:
            warnings.filterwarnings("ignore", message="Parsed a serial number")
        _read_everything(parsed)


# ---------------------------------------------------------------------------------------------
# the full scan (not run by pytest: about 40 s)


def full_scan() -> dict[str, Counter[str]]:
    """Every bit of every byte of every target's certificates; outcomes per target."""
    results: dict[str, Counter[str]] = {}
    for target in targets():
        seen: Counter[str] = Counter()
        for index, der in enumerate(target.ders):
            for offset in range(len(der)):
                for bit in range(8):
                    mutated = _mutated(target, index, _flip(der, offset, 1 << bit))
                    try:
                        seen[_outcome(target, mutated)] += 1
                    except Exception as exc:  # report everything, stop at nothing
                        seen[f"FAIL {type(exc).__name__}: {str(exc)[:80]}"] += 1
        results[target.name] = seen
    return results


if __name__ == "__main__":
    failed = False
    for name, seen in full_scan().items():
        print(f"{name}: {sum(seen.values())} flips")
        for outcome, count in seen.most_common():
            failed |= outcome.startswith("FAIL")
            print(f"  {count:7d}  {outcome}")
    sys.exit(1 if failed else 0)
