"""examples/nitro: the enclave image's entrypoint and the build script's attestmesh commands are
accepted by the real CLI; the script is valid sh."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

from attestmesh.cli import build_parser
from attestmesh.nitro_cmd import run_enclave_init, run_nitro_parent, run_policy_from_eif

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "nitro"


def stage(name: str) -> list[str]:
    text = (EXAMPLE / "Dockerfile").read_text()
    start = text.index(f" AS {name}\n")
    end = text.find("\nFROM ", start)
    return text[start : end if end > 0 else None].splitlines()


def exec_form(lines: list[str], instruction: str) -> list[str]:
    (line,) = [x for x in lines if x.startswith(f"{instruction} ")]
    value: list[str] = json.loads(line[len(instruction) + 1 :])
    return value


def test_enclave_entrypoint_is_enclave_init_with_a_pinned_root_then_the_app() -> None:
    lines = stage("enclave")
    argv = exec_form(lines, "ENTRYPOINT") + exec_form(lines, "CMD")
    assert argv[0] == "attestmesh"
    args = build_parser().parse_args(argv[1:])
    assert args.func is run_enclave_init
    assert args.transport == "vsock" and not args.accept_parent_ca
    assert str(args.ca_bundle) == "/etc/attestmesh/root.pem"
    assert f"COPY examples/nitro/mesh-root.pem {args.ca_bundle}" in lines
    assert args.app == ["--", "python", "/app/app.py"]
    assert "COPY examples/nitro/app.py /app/app.py" in lines


def test_parent_image_runs_nitro_parent_with_the_eif_where_the_webhook_expects_it() -> None:
    lines = stage("parent")
    assert exec_form(lines, "ENTRYPOINT") == ["attestmesh", "nitro-parent"]
    assert "COPY ${EIF} /enclave/app.eif" in lines
    args = build_parser().parse_args(["nitro-parent", "--eif", "/enclave/app.eif",
                                      "--granted-cpus", "2", "--granted-memory-mib", "4096",
                                      "--workload", "demo/p", "--control-plane", "https://cp:8443",
                                      "--xds", "cp:18000", "--inbound-address", "10.0.0.1",
                                      "--inbound-port", "15006"])  # fmt: skip
    assert args.func is run_nitro_parent


def test_build_script() -> None:
    script = EXAMPLE / "build.sh"
    subprocess.run(["sh", "-n", str(script)], check=True, timeout=10)
    text = script.read_text().replace("\\\n", " ")
    (line,) = [x for x in text.splitlines() if x.startswith("attestmesh policy from-eif")]
    argv = [re.sub(r"\$HERE", str(EXAMPLE), a) for a in shlex.split(line)]
    args = build_parser().parse_args(argv[1:])
    assert args.func is run_policy_from_eif and args.service_account == ["enclave-app"]
    assert "nitro-cli build-enclave --docker-uri" in text
