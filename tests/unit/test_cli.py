"""The command line: every command has --help, and errors are clear, not tracebacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attestmesh.cli import build_parser, main

CONTROL_PLANE_ID = "spiffe://attestmesh.local/ns/attestmesh-system/sa/controlplane"
COMMANDS = ["controlplane", "agent", "bootstrap", "demo", "quarantine", "verify", "lint"]


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
        assert f"usage: attestmesh {command}" in capsys.readouterr().out
    assert set(COMMANDS) <= set(build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_missing_required_argument_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bootstrap", "--node", "a"])
    assert exc.value.code == 2
    assert "--xds" in capsys.readouterr().err


def test_bootstrap_renders_json_with_mutual_tls_to_the_control_plane(tmp_path: Path) -> None:
    out = tmp_path / "envoy.json"
    code = main(["bootstrap", "--node", "web", "--xds", "127.0.0.1:18000",
                 "--sds-socket", str(tmp_path / "s.sock"), "--xds-ca", "/etc/mesh/root.pem",
                 "-o", str(out)])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["node"]["id"] == "web"
    (xds,) = [c for c in doc["static_resources"]["clusters"] if c["name"] == "xds"]
    tls = xds["transport_socket"]["typed_config"]["common_tls_context"]
    assert tls["validation_context"]["trusted_ca"] == {"filename": "/etc/mesh/root.pem"}
    assert tls["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "URI", "matcher": {"exact": CONTROL_PLANE_ID}}
    ]
    assert tls["tls_certificate_sds_secret_configs"][0]["name"] == "workload-leaf-cert"
    assert tls["alpn_protocols"] == ["h2"]


def test_bootstrap_refuses_plaintext_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bootstrap", "--node", "web", "--xds", "127.0.0.1:18000", "--sds-socket", "s"]
    assert main(args) == 2
    assert "--xds-ca" in capsys.readouterr().err
    out = tmp_path / "plain.json"
    assert main([*args, "--xds-plaintext", "-o", str(out)]) == 0
    (xds,) = [
        c for c in json.loads(out.read_text())["static_resources"]["clusters"] if c["name"] == "xds"
    ]
    assert "transport_socket" not in xds


def test_bootstrap_bad_address(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        main(
            ["bootstrap", "--node", "w", "--xds", "nohost", "--sds-socket", "s", "--xds-plaintext"]
        )
        == 2
    )
    assert "--xds must be host:port" in capsys.readouterr().err


def test_quarantine_without_control_plane_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["quarantine", "list", "--ops-port", "1"]) == 2
    err = capsys.readouterr().err
    assert "control_plane_unreachable" in err and "Traceback" not in err


def test_release_needs_a_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quarantine", "release", "--ops-port", "1"]) == 2
    assert "needs a workload NAME" in capsys.readouterr().err


def test_controlplane_refuses_invalid_policy_listing_every_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "apiVersion: attestmesh.dev/v1alpha1\nkind: AttestationPolicy\n"
        "metadata: {name: Bad_Name}\n"
        "spec: {allowedTees: [sim, quantum], mode: yolo, certificateTTL: forever}\n"
    )
    code = main(["controlplane", "--state-dir", str(tmp_path / "st"), "--policy", str(policy)])
    assert code == 2
    err = capsys.readouterr().err
    for fragment in ("metadata.name", "quantum", "spec.mode", "certificateTTL", "selector",
                     "referenceValues.sim"):  # fmt: skip
        assert fragment in err, fragment


def test_verify_usage_error_exits_3_not_the_invalid_evidence_status() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify"])
    assert exc.value.code == 3


@pytest.mark.parametrize("count", ["-1", "65"])
def test_controlplane_refuses_a_worker_process_count_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], count: str
) -> None:
    code = main(["controlplane", "--state-dir", str(tmp_path / "st"), "--policy",
                 str(tmp_path / "p.yaml"), "--attest-processes", count])  # fmt: skip
    assert code != 0
    assert "--attest-processes must be between 0 and 64" in capsys.readouterr().err
    assert not (tmp_path / "st").exists()  # refused before anything was made
