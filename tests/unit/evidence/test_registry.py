from __future__ import annotations

import base64
import contextlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from certs.collateral.roots import TrustRoots, bundled_roots, load_roots
from certs.errors import CollateralError, EvidenceFormatError
from certs.evidence import sim
from certs.evidence.claims import Tee
from certs.evidence.registry import SNIFFERS, build_verifiers, detect_tee
from tests.vectors import VECTORS, pin

# (evidence path, TEE, pin time, collateral files: name -> path)
CASES = [
    ("nitro/veracruz_eu-west-1_20221109.cbor", Tee.NITRO, "2022-11-09T23:00:00Z", {}),
    ("nitro/evervault_us-east-1_20221013.cbor", Tee.NITRO, "2022-10-13T09:00:00Z", {}),
    (
        "nvidia/hopper_trustee/report.hex",
        Tee.NVIDIA_GPU,
        "2025-01-01T00:00:00Z",
        {"cert_chain": "nvidia/hopper_trustee/cert_chain.pem"},
    ),
    (
        "nvidia/hopper_coco_trustee/report.hex",
        Tee.NVIDIA_GPU,
        "2025-01-01T00:00:00Z",
        {"cert_chain": "nvidia/hopper_coco_trustee/cert_chain.pem"},
    ),
    (
        "sev-snp/milan_v2_gosevguest/report.bin",
        Tee.SEV_SNP,
        "2023-01-01T00:00:00Z",
        {"vcek": "sev-snp/milan_v2_gosevguest/vcek.der"},
    ),
    (
        "sev-snp/genoa_v3_azure_trustee/hcl_report.bin",
        Tee.SEV_SNP,
        "2026-02-01T00:00:00Z",
        {"vcek": "sev-snp/genoa_v3_azure_trustee/vcek.pem"},
    ),
    (
        "sev-snp/milan_v3_vlek_aws_trustee/report.bin",
        Tee.SEV_SNP,
        "2025-05-28T00:00:00Z",
        {"vlek": "sev-snp/milan_v3_vlek_aws_trustee/vlek.der"},
    ),
    (
        "tdx/dcapqvl_v4/quote.bin",
        Tee.TDX,
        "2025-06-20T00:00:00Z",
        {"collateral_json": "tdx/dcapqvl_v4/collateral.json"},
    ),
    (
        "sgx-dcap/dcapqvl_sgx_v3/quote.bin",
        Tee.SGX,
        "2025-06-20T00:00:00Z",
        {"collateral_json": "sgx-dcap/dcapqvl_sgx_v3/collateral.json"},
    ),
]


@pytest.fixture(scope="module")
def roots() -> TrustRoots:
    return bundled_roots()


@pytest.mark.parametrize(("path", "tee"), [(c[0], c[1]) for c in CASES])
def test_detect_every_vector(path: str, tee: Tee) -> None:
    evidence = (VECTORS / path).read_bytes()
    assert detect_tee(evidence) is tee
    assert [t for t, looks_like in SNIFFERS if looks_like(evidence)] == [tee]


def test_detect_other_vectors() -> None:
    assert detect_tee((VECTORS / "tdx/gotdxguest_v5/quote.bin").read_bytes()) is Tee.TDX
    assert detect_tee((VECTORS / "tdx/gotdxguest_v4_spr/quote.bin").read_bytes()) is Tee.TDX
    b64 = (VECTORS / "nitro/evervault_debug_us-east-1_20230918.cbor.b64").read_bytes()
    assert detect_tee(base64.b64decode(b64)) is Tee.NITRO


def test_detect_sim_evidence() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    report = sim.build_report(key, report_data=bytes(64), measurement=bytes(48))
    assert detect_tee(report) is Tee.SIM


@pytest.mark.parametrize(
    "evidence",
    [
        b"",
        b"\x00" * 64,
        b"hello",
        (VECTORS / "nitro/evervault_debug_us-east-1_20230918.cbor.b64").read_bytes(),
        (VECTORS / "sev-snp/genoa_v3_azure_trustee/evidence.json").read_bytes(),
    ],
    ids=["empty", "zeros", "text", "base64-text", "azure-json"],
)
def test_unknown_format(evidence: bytes) -> None:
    with pytest.raises(EvidenceFormatError) as err:
        detect_tee(evidence)
    assert err.value.reason == "unknown_format"


def test_build_verifiers_without_sim_keys(roots: TrustRoots) -> None:
    verifiers = build_verifiers(roots)
    assert set(verifiers) == {Tee.NITRO, Tee.SEV_SNP, Tee.TDX, Tee.SGX, Tee.NVIDIA_GPU}
    for tee, verifier in verifiers.items():
        assert verifier.tee is tee


def test_sim_only_when_keys_are_given(roots: TrustRoots) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    verifiers = build_verifiers(roots, sim_keys=[key.public_key()])
    assert verifiers[Tee.SIM].tee is Tee.SIM
    report = sim.build_report(key, report_data=bytes(range(64)), measurement=bytes(48))
    claims = verifiers[Tee.SIM].verify(report, now=pin("2030-01-01T00:00:00Z"), collateral={})
    assert claims.report_data == bytes(range(64))
    assert Tee.SIM not in build_verifiers(roots, sim_keys=[])


@pytest.mark.parametrize(("path", "tee", "at", "files"), CASES, ids=[c[0] for c in CASES])
def test_every_vector_verifies_through_the_registry(
    roots: TrustRoots, path: str, tee: Tee, at: str, files: dict[str, str]
) -> None:
    evidence = (VECTORS / path).read_bytes()
    verifiers = build_verifiers(roots)
    collateral = {name: (VECTORS / f).read_bytes() for name, f in files.items()}
    claims = verifiers[detect_tee(evidence)].verify(evidence, now=pin(at), collateral=collateral)
    assert claims.tee is tee


def test_bundled_roots_match_the_vectors(roots: TrustRoots) -> None:
    assert roots.nitro == (VECTORS / "nitro/aws_nitro_enclaves_root_g1.pem").read_bytes()
    assert roots.nvidia == (VECTORS / "nvidia/nvidia_device_identity_root.pem").read_bytes()
    assert roots.intel_sgx_root == (VECTORS / "sgx-dcap/Intel_SGX_RootCA.der").read_bytes()
    assert roots.amd_chains[0] == (VECTORS / "sev-snp/amd/ask_ark_milan.pem").read_bytes()


def test_load_roots_override_and_fallback(tmp_path: Path) -> None:
    directory = tmp_path
    nitro_root = (VECTORS / "nvidia/nvidia_device_identity_root.pem").read_bytes()
    (directory / "aws_nitro_enclaves_root_g1.pem").write_bytes(nitro_root)
    roots = load_roots(directory)
    assert roots.nitro == nitro_root
    assert roots.nvidia == bundled_roots().nvidia
    (directory / "Intel_SGX_RootCA.der").write_bytes(b"not a certificate")
    with pytest.raises(CollateralError) as err:
        load_roots(directory)
    assert err.value.reason == "root_invalid"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_detect_raises_only_format_errors(data: bytes) -> None:
    with contextlib.suppress(EvidenceFormatError):
        assert detect_tee(data) in set(Tee)
