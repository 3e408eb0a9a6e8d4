from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh import verify_cmd
from certs.collateral.roots import bundled_roots
from certs.evidence import sim
from certs.evidence.nitro import NitroVerifier
from tests.vectors import VECTORS, pin
from xds.store import claims_from_doc

NITRO = VECTORS / "nitro"
VERACRUZ = NITRO / "veracruz_eu-west-1_20221109.cbor"
VERACRUZ_AT = "2022-11-09T23:00:00Z"
VERACRUZ_PCR0 = (
    "22f9e1c949208da55eb01b9b9fc88f87454f77ba133f0d82"
    "320b509621c92482152a99d0a12335b97178c02d6f977d01"
)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="attestmesh")
    sub = root.add_subparsers(dest="command", required=True)
    verify_cmd.add_parser(sub)
    return root


def run(*argv: str | Path) -> tuple[int, str, str]:
    args = parser().parse_args(["verify", *map(str, argv)])
    out, err = io.StringIO(), io.StringIO()
    status = verify_cmd.run(args, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


def run_json(*argv: str | Path) -> tuple[int, dict[str, Any]]:
    status, out, _ = run(*argv, "--json")
    return status, json.loads(out)


def policy_yaml(
    pcr0: str, *, name: str = "nitro-app", namespace: str = "shop", sa: str = "web"
) -> str:
    return f"""
apiVersion: attestmesh.dev/v1alpha1
kind: AttestationPolicy
metadata: {{name: {name}, namespace: {namespace}}}
spec:
  selector: {{serviceAccounts: [{sa}]}}
  allowedTees: [nitro]
  referenceValues:
    nitro:
      pcr0: ["{pcr0}"]
"""


# ---------------------------------------------------------------------------------------------
# valid evidence, each TEE


def test_nitro_vector_is_valid_and_prints_claims() -> None:
    status, out, err = run(VERACRUZ, "--at", VERACRUZ_AT)
    assert status == verify_cmd.EXIT_OK, err
    assert "result:    VALID" in out.splitlines()
    assert f"  pcr0: {VERACRUZ_PCR0}" in out.splitlines()
    assert 'platform_id: "i-04fd167167daacf3b-enc01845e97d0b3eb4e"' in out.splitlines()


def test_base64_text_evidence_is_decoded() -> None:
    status, report = run_json(
        NITRO / "evervault_debug_us-east-1_20230918.cbor.b64", "--at", "2023-09-18T15:10:00Z"
    )
    assert status == verify_cmd.EXIT_OK
    assert report["tee"] == "nitro"
    assert report["claims"]["debug"] is True
    assert report["claims"]["details"]["user_data_len"] == 91


def test_printed_claims_are_the_stores_encoding_of_the_verifiers_claims() -> None:
    """The JSON claims are xds.store's document for the claims the verifier returned: read back
    with the store's decoder they equal the verifier's own result, field for field."""
    status, report = run_json(VERACRUZ, "--at", VERACRUZ_AT)
    assert status == verify_cmd.EXIT_OK
    direct = NitroVerifier(bundled_roots().nitro).verify(
        VERACRUZ.read_bytes(), now=pin(VERACRUZ_AT), collateral={}
    )
    assert claims_from_doc(report["claims"]) == direct


@pytest.mark.parametrize(
    ("evidence", "collateral", "at", "tee"),
    [
        ("nvidia/hopper_coco_trustee/report.hex", "nvidia/hopper_coco_trustee", None, "nvidia-gpu"),
        ("tdx/dcapqvl_v4/quote.bin", "tdx/dcapqvl_v4", "2025-06-20T00:00:00Z", "tdx"),
        (
            "sgx-dcap/dcapqvl_sgx_v3/quote.bin",
            "sgx-dcap/dcapqvl_sgx_v3",
            "2025-06-20T00:00:00Z",
            "sgx",
        ),
        (
            "sev-snp/milan_v3_vlek_aws_trustee/report.bin",
            "sev-snp/milan_v3_vlek_aws_trustee",
            "2025-05-28T00:00:00Z",
            "sev-snp",
        ),
    ],
)
def test_other_tees_with_collateral_dir(
    evidence: str, collateral: str, at: str | None, tee: str
) -> None:
    extra = ["--at", at] if at else []
    status, report = run_json(VECTORS / evidence, "--collateral", VECTORS / collateral, *extra)
    assert status == verify_cmd.EXIT_OK, report
    assert report["tee"] == tee
    assert report["valid"] is True


def test_raw_pcs_collateral_names_are_mapped() -> None:
    status, report = run_json(
        VECTORS / "tdx/gotdxguest_v4_spr/quote.bin",
        "--collateral",
        VECTORS / "tdx/gotdxguest_v4_spr",
        "--at",
        "2023-07-01T01:00:00Z",
    )
    assert set(report["collateral"]) == {
        "pck_crl",
        "pck_crl_issuer_chain",
        "qe_identity",
        "qe_identity_issuer_chain",
        "root_ca_crl",
        "tcb_info",
        "tcb_info_issuer_chain",
    }
    # The README documents this vector as "signature valid, no TCB level matches".
    assert status == verify_cmd.EXIT_INVALID
    assert report["error"]["reason"] == "tcb_level_not_found"


def test_sim_needs_an_explicit_key(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    evidence = tmp_path / "sim.bin"
    evidence.write_bytes(sim.build_report(key, report_data=bytes(64), measurement=bytes(48)))
    status, report = run_json(evidence)
    assert status == verify_cmd.EXIT_INVALID
    assert report["error"]["reason"] == "tee_unsupported"
    pem = tmp_path / "platform.pem"
    pem.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    status, report = run_json(evidence, "--sim-key", pem, "--tee", "sim")
    assert status == verify_cmd.EXIT_OK
    assert report["claims"]["tee"] == "sim"


# ---------------------------------------------------------------------------------------------
# invalid evidence: exit 2


def test_bad_signature_is_invalid() -> None:
    status, report = run_json(
        NITRO / "veracruz_eu-west-1_20221109_bad_sig.cbor", "--at", VERACRUZ_AT
    )
    assert status == verify_cmd.EXIT_INVALID
    assert report["valid"] is False
    assert report["error"] == {
        "kind": "verification",
        "reason": "signature_invalid",
        "detail": "COSE_Sign1 ES384 signature does not verify",
    }


def test_expired_at_time_is_invalid() -> None:
    status, report = run_json(VERACRUZ, "--at", "2022-11-11T00:00:00Z")
    assert status == verify_cmd.EXIT_INVALID
    assert report["error"]["reason"] == "certificate_expired"


def test_missing_collateral_is_invalid() -> None:
    status, out, _ = run(VECTORS / "nvidia/hopper_trustee/report.hex")
    assert status == verify_cmd.EXIT_INVALID
    assert "result:    INVALID (verification): collateral_missing" in out


def test_unknown_format_and_forced_wrong_tee(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00" * 100)
    status, report = run_json(junk)
    assert status == verify_cmd.EXIT_INVALID
    assert report["error"]["reason"] == "unknown_format"
    status, report = run_json(VERACRUZ, "--tee", "sev-snp", "--at", VERACRUZ_AT)
    assert status == verify_cmd.EXIT_INVALID
    assert report["error"]["kind"] == "format"


# ---------------------------------------------------------------------------------------------
# policy: exit 0 admitted / 1 rejected


def test_policy_admits_matching_pcr0(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(VERACRUZ_PCR0))
    status, report = run_json(VERACRUZ, "--at", VERACRUZ_AT, "--policy", policy)
    assert status == verify_cmd.EXIT_OK
    assert report["policy"]["decision"] == "admitted"
    assert report["policy"]["policies"] == ["shop/nitro-app"]


def test_policy_rejects_other_pcr0_with_reasons(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml("ab" * 48))
    status, out, _ = run(VERACRUZ, "--at", VERACRUZ_AT, "--policy", policy)
    assert status == verify_cmd.EXIT_REJECTED
    assert "policy:    REJECTED by shop/nitro-app" in out
    assert f"  - measurement_not_allowed: pcr0={VERACRUZ_PCR0}" in out


def test_every_policy_in_file_must_admit_without_identity(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        policy_yaml(VERACRUZ_PCR0) + "---" + policy_yaml("ab" * 48, name="other", sa="api")
    )
    status, report = run_json(VERACRUZ, "--at", VERACRUZ_AT, "--policy", policy)
    assert status == verify_cmd.EXIT_REJECTED
    assert report["policy"]["policies"] == ["shop/other"]
    # With an identity, only the matching policy governs.
    status, report = run_json(
        VERACRUZ,
        "--at",
        VERACRUZ_AT,
        "--policy",
        policy,
        "--namespace",
        "shop",
        "--service-account",
        "web",
    )
    assert status == verify_cmd.EXIT_OK
    assert report["policy"]["policies"] == ["shop/nitro-app"]
    # An identity no policy governs is rejected.
    status, report = run_json(
        VERACRUZ,
        "--at",
        VERACRUZ_AT,
        "--policy",
        policy,
        "--namespace",
        "shop",
        "--service-account",
        "nobody",
    )
    assert status == verify_cmd.EXIT_REJECTED
    assert report["policy"]["reason"] == "no_policy"


def test_debug_enclave_is_rejected_by_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml("00" * 48))
    status, report = run_json(
        NITRO / "evervault_debug_us-east-1_20221012.cbor",
        "--at",
        "2022-10-12T14:00:00Z",
        "--policy",
        policy,
    )
    assert status == verify_cmd.EXIT_REJECTED
    assert report["policy"]["reason"] == "debug_not_allowed"


def test_invalid_evidence_wins_over_policy(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(policy_yaml(VERACRUZ_PCR0))
    status, report = run_json(
        NITRO / "veracruz_eu-west-1_20221109_bad_sig.cbor", "--at", VERACRUZ_AT, "--policy", policy
    )
    assert status == verify_cmd.EXIT_INVALID
    assert "policy" not in report


# ---------------------------------------------------------------------------------------------
# usage errors: exit 3


@pytest.mark.parametrize(
    "argv",
    [
        ["--at", "yesterday"],
        ["--at", "2022-11-09T23:00:00"],  # no offset
        ["--namespace", "shop"],
        ["--namespace", "shop", "--service-account", "web"],  # no --policy
        ["--collateral", "/nonexistent-dir"],
        ["--policy", "/nonexistent.yaml"],
        ["--label", "novalue"],
    ],
)
def test_usage_errors(argv: list[str]) -> None:
    status, _, err = run(VERACRUZ, *argv)
    assert status == verify_cmd.EXIT_USAGE
    assert err.startswith("attestmesh verify: ")


def test_missing_evidence_file_and_bad_policy(tmp_path: Path) -> None:
    status, _, err = run(tmp_path / "absent.bin")
    assert status == verify_cmd.EXIT_USAGE
    bad = tmp_path / "policy.yaml"
    bad.write_text("apiVersion: attestmesh.dev/v1alpha1\nkind: AttestationPolicy\n")
    status, _, err = run(VERACRUZ, "--policy", bad, "--at", VERACRUZ_AT)
    assert status == verify_cmd.EXIT_USAGE
    assert "metadata.name" in err
    bad.write_text("{unclosed")
    status, report = run_json(VERACRUZ, "--policy", bad, "--at", VERACRUZ_AT)
    assert status == verify_cmd.EXIT_USAGE
    assert report["error"]["kind"] == "usage"


def test_standalone_main_maps_argparse_errors_to_usage() -> None:
    assert verify_cmd.main(["--tee", "nope", str(VERACRUZ)]) == verify_cmd.EXIT_USAGE


# ---------------------------------------------------------------------------------------------
# pure helpers


def test_collateral_mapping_aliases_and_precedence() -> None:
    mapped = verify_cmd.map_collateral(
        {
            "vcek.der": b"v",
            "collateral.json": b"c",
            "tcb_info_response.json": b"t",
            "tcb_info_issuer_chain_2025.pem": b"old",
            "tcb_info_issuer_chain.pem": b"exact",
            "pck_crl_platform.der": b"p",
            "report.bin": b"evidence",
        }
    )
    assert mapped == {
        "vcek": b"v",
        "collateral_json": b"c",
        "tcb_info": b"t",
        "tcb_info_issuer_chain": b"exact",
        "pck_crl": b"p",
    }
    with pytest.raises(verify_cmd.UsageError):
        verify_cmd.map_collateral({"vcek.der": b"a", "vcek.pem": b"b"})


def test_select_evidence_prefers_raw_bytes() -> None:
    hex_text = (VECTORS / "nvidia/hopper_trustee/report.hex").read_bytes()
    tee, chosen = verify_cmd.select_evidence(hex_text, None)
    assert (tee, chosen) == ("nvidia-gpu", hex_text)  # hex text is valid base64 too
