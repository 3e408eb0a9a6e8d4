"""nitro-cli: command lines and output parsing (pure), and the process adapter driven against
the fake ``nitro-cli`` (tests.nitro_fake.nitro_cli) at the process seam."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sidecar.nitro.config import EnclaveSize
from sidecar.nitro.nitrocli import (
    NitroCli,
    NitroCliError,
    RunningEnclave,
    parse_describe,
    parse_measurements,
    parse_run_enclave,
    run_enclave_args,
)

PCR = {f"PCR{i}": f"{i:x}" * 96 for i in range(3)}


def test_run_enclave_arguments() -> None:
    size = EnclaveSize(2, 4096)
    assert run_enclave_args(Path("/enclave/app.eif"), size) == [
        "run-enclave", "--eif-path", "/enclave/app.eif", "--cpu-count", "2", "--memory", "4096",
    ]  # fmt: skip
    args = run_enclave_args(Path("/e.eif"), size, cid=16, debug=True)
    assert args[-3:] == ["--enclave-cid", "16", "--debug-mode"]


def test_run_enclave_output_after_log_lines() -> None:
    out = "Start allocating memory...\nStarted enclave with enclave-cid: 16\n" + json.dumps(
        {
            "EnclaveName": "app",
            "EnclaveID": "i-0ab-enc01",
            "ProcessID": 7,
            "EnclaveCID": 16,
            "NumberOfCPUs": 2,
            "CPUIDs": [1, 3],
            "MemoryMiB": 4096,
        }
    )
    assert parse_run_enclave(out) == RunningEnclave("i-0ab-enc01", 16, 2, 4096)
    for bad in ("nothing", "{not json", "[1]", json.dumps({"EnclaveID": ""}),
                json.dumps({"EnclaveID": "i", "EnclaveCID": True, "NumberOfCPUs": 1,
                            "MemoryMiB": 1})):  # fmt: skip
        with pytest.raises(NitroCliError):
            parse_run_enclave(bad)


def test_describe_enclaves() -> None:
    out = json.dumps([{"EnclaveID": "a", "State": "RUNNING"}, {"EnclaveID": "b"}])
    assert parse_describe(out, "a") == "RUNNING"
    assert parse_describe(out, "b") == "UNKNOWN"
    assert parse_describe(out, "c") is None
    assert parse_describe("[]", "a") is None
    with pytest.raises(NitroCliError):
        parse_describe('{"EnclaveID": "a"}', "a")


def test_measurements_from_build_enclave_and_describe_eif() -> None:
    built = "Start building the Enclave Image...\n" + json.dumps(
        {"Measurements": {"HashAlgorithm": "Sha384 { ... }", **PCR}}
    )
    good = {**PCR, "PCR0": "AB" * 48}
    assert parse_measurements(json.dumps({"Measurements": good}))["pcr0"] == "ab" * 48
    described = json.dumps({"EifVersion": 4, "Measurements": good, "IsSigned": False})
    assert parse_measurements(described)["pcr2"] == "2" * 96
    with pytest.raises(NitroCliError, match="debug"):
        parse_measurements(built)  # PCR0 = zeros
    bads: list[object] = [{}, {"Measurements": []}, {"Measurements": {**good, "PCR1": "ab"}},
                          {"Measurements": {**good, "PCR2": "zz" * 48}}]  # fmt: skip
    for bad in bads:
        with pytest.raises(NitroCliError):
            parse_measurements(json.dumps(bad))


def fake(state: Path) -> NitroCli:
    return NitroCli([sys.executable, "-m", "tests.nitro_fake.nitro_cli", "--state", str(state)])


async def test_adapter_reports_failures_and_records_its_arguments(tmp_path: Path) -> None:
    (tmp_path / "allocator.json").write_text(json.dumps({"cpu_count": 2, "memory_mib": 512}))
    cli = fake(tmp_path)
    with pytest.raises(NitroCliError) as err:  # more than the allocator holds
        await cli.run_enclave(run_enclave_args(Path("/x.eif"), EnclaveSize(4, 512)))
    assert err.value.reason == "nitro_cli_failed" and "E26" in err.value.detail
    assert await cli.state("i-none") is None
    with pytest.raises(NitroCliError):
        await cli.terminate("i-none")
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls == [
        ["run-enclave", "--eif-path", "/x.eif", "--cpu-count", "4", "--memory", "512"],
        ["describe-enclaves"],
        ["terminate-enclave", "--enclave-id", "i-none"],
    ]


async def test_adapter_timeout_and_missing_binary(tmp_path: Path) -> None:
    slow = NitroCli([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    with pytest.raises(NitroCliError) as err:
        await slow.state("x")
    assert err.value.reason == "nitro_cli_timeout"
    with pytest.raises(NitroCliError) as err:
        await NitroCli([str(tmp_path / "no-such-nitro-cli")]).state("x")
    assert err.value.reason == "nitro_cli_failed"
