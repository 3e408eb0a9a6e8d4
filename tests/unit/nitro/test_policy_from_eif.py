"""``attestmesh policy from-eif``: nitro-cli's PCR0/1/2 -> an AttestationPolicy that the control
plane's parser accepts and that admits exactly a document of that image (signed by the test NSM,
verified by the real Nitro verifier anchored at the test root)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from attestmesh.cli import main
from attestmesh.nitro_cmd import policy_from_measurements
from certs.evidence.nitro import NitroVerifier
from certs.policy import Admitted, Rejected, appraise, parse_policies
from sidecar.nitro.nitrocli import NitroCliError
from tests.nitro_fake.nitro_cli import pcrs_for
from tests.nitro_fake.nsm import FakeNsm, make_test_pki

BUILD_OUTPUT = "Start building the Enclave Image...\nEnclave Image successfully created.\n" + (
    json.dumps({"Measurements": {"HashAlgorithm": "Sha384 { ... }", **pcrs_for("app:1")}}, indent=2)
)


def test_cli_writes_a_policy_that_parses_back(tmp_path: Path) -> None:
    src = tmp_path / "measurements.json"
    src.write_text(BUILD_OUTPUT)
    out = tmp_path / "policy.yaml"
    assert main(["policy", "from-eif", str(src), "--name", "enclave-app", "--namespace", "demo",
                 "--service-account", "enclave-app", "-o", str(out)]) == 0  # fmt: skip
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == "AttestationPolicy" and doc["spec"]["allowedTees"] == ["nitro"]
    assert doc["spec"]["referenceValues"]["nitro"] == {
        f"pcr{i}": [pcrs_for("app:1")[f"PCR{i}"]] for i in range(3)
    }
    (policy,) = parse_policies([doc])
    assert policy.name == "demo/enclave-app" and not policy.allow_debug


def test_the_policy_admits_that_image_only(tmp_path: Path) -> None:
    (policy,) = parse_policies([yaml.safe_load(policy_from_measurements(
        BUILD_OUTPUT, name="app", namespace="default", service_accounts=["app"]
    ))])  # fmt: skip
    roots = make_test_pki(tmp_path / "pki")
    verifier = NitroVerifier((roots / "aws_nitro_enclaves_root_g1.pem").read_bytes())
    now = datetime.now(UTC)

    def claims_of(uri: str) -> object:
        pcrs = {i: bytes.fromhex(v) for i, v in enumerate(pcrs_for(uri).values())}
        pcrs |= {i: bytes(48) for i in range(3, 16)}
        doc = FakeNsm(tmp_path / "pki", pcrs, "i-0-enc1").attest(
            user_data=b"u", nonce=b"n", public_key=None
        )
        return verifier.verify(doc, now=now, collateral={})

    assert isinstance(appraise(claims_of("app:1"), policy, now), Admitted)  # type: ignore[arg-type]
    rejected = appraise(claims_of("app:2"), policy, now)  # type: ignore[arg-type]
    assert isinstance(rejected, Rejected)
    assert any(r.startswith("measurement_not_allowed") for r in rejected.reasons)


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    debug = json.dumps({"Measurements": {f"PCR{i}": "00" * 48 for i in range(3)}})
    with pytest.raises(NitroCliError, match="debug"):
        policy_from_measurements(debug, name="a", namespace="default", service_accounts=["a"])
    src = tmp_path / "m.json"
    src.write_text("not json at all")
    assert main(["policy", "from-eif", str(src), "--name", "a", "--service-account", "a"]) == 2
    assert "nitro_cli_output" in capsys.readouterr().err
    assert main(["policy", "from-eif", str(tmp_path / "missing.json"), "--name", "a",
                 "--service-account", "a"]) == 2  # fmt: skip
    src.write_text(BUILD_OUTPUT)
    assert main(["policy", "from-eif", str(src), "--name", "Not_A_Name",
                 "--service-account", "a"]) == 2  # fmt: skip
    assert "metadata.name" in capsys.readouterr().err
