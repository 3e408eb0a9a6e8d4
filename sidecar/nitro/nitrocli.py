"""``nitro-cli``: command lines (pure), output parsing (pure) and a thin process adapter.

``nitro-cli run-enclave`` prints log lines and then a JSON object (``EnclaveID``,
``EnclaveCID``, ``NumberOfCPUs``, ``MemoryMiB``...); ``describe-enclaves`` prints a JSON array
of enclaves with their ``State``; ``build-enclave``/``describe-eif`` print ``Measurements``
with ``PCR0``, ``PCR1``, ``PCR2`` (SHA-384, hex).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from certs.errors import AttestmeshError
from sidecar.nitro.config import EnclaveSize

MAX_OUTPUT = 1024 * 1024


class NitroCliError(AttestmeshError):
    """nitro-cli failed or printed something unexpected."""


@dataclass(frozen=True, slots=True)
class RunningEnclave:
    enclave_id: str
    cid: int
    cpu_count: int
    memory_mib: int


def run_enclave_args(
    eif: Path, size: EnclaveSize, *, cid: int | None = None, debug: bool = False
) -> list[str]:
    """``run-enclave`` arguments; ``--debug-mode`` only when asked (a debug enclave reports
    all-zero PCRs and is refused by any policy that does not allow debug)."""
    args = [
        "run-enclave",
        "--eif-path",
        str(eif),
        "--cpu-count",
        str(size.cpu_count),
        "--memory",
        str(size.memory_mib),
    ]
    if cid is not None:
        args += ["--enclave-cid", str(cid)]
    if debug:
        args.append("--debug-mode")
    return args


def _json_tail(text: str, opener: str) -> Any:
    start = text.find(opener)
    if start < 0:
        raise NitroCliError("nitro_cli_output", "no JSON in nitro-cli output")
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        raise NitroCliError("nitro_cli_output", "nitro-cli printed invalid JSON") from None
    return value


def _int(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NitroCliError("nitro_cli_output", f"{key} is not a number")
    return value


def parse_run_enclave(output: str) -> RunningEnclave:
    doc = _json_tail(output, "{")
    if not isinstance(doc, dict):
        raise NitroCliError("nitro_cli_output", "run-enclave output is not an object")
    enclave_id = doc.get("EnclaveID")
    if not isinstance(enclave_id, str) or not 0 < len(enclave_id) <= 128:
        raise NitroCliError("nitro_cli_output", "no EnclaveID")
    return RunningEnclave(
        enclave_id, _int(doc, "EnclaveCID"), _int(doc, "NumberOfCPUs"), _int(doc, "MemoryMiB")
    )


def parse_describe(output: str, enclave_id: str) -> str | None:
    """The State of ``enclave_id`` in ``describe-enclaves`` output, None when absent."""
    doc = _json_tail(output, "[")
    if not isinstance(doc, list):
        raise NitroCliError("nitro_cli_output", "describe-enclaves output is not a list")
    for item in doc:
        if isinstance(item, dict) and item.get("EnclaveID") == enclave_id:
            state = item.get("State")
            return state if isinstance(state, str) else "UNKNOWN"
    return None


def parse_measurements(output: str) -> dict[str, str]:
    """``{"pcr0": hex, "pcr1": hex, "pcr2": hex}`` from build-enclave / describe-eif output."""
    doc = _json_tail(output, "{")
    measurements = doc.get("Measurements") if isinstance(doc, dict) else None
    if not isinstance(measurements, dict):
        raise NitroCliError("nitro_cli_output", "no Measurements object")
    out: dict[str, str] = {}
    for i in (0, 1, 2):
        value = measurements.get(f"PCR{i}")
        if not isinstance(value, str) or len(value) != 96:
            raise NitroCliError("nitro_cli_output", f"PCR{i} is not 48 bytes of hex")
        try:
            bytes.fromhex(value)
        except ValueError:
            raise NitroCliError("nitro_cli_output", f"PCR{i} is not hex") from None
        out[f"pcr{i}"] = value.lower()
    if out["pcr0"] == "0" * 96:
        raise NitroCliError("nitro_cli_output", "PCR0 is zero (a debug measurement)")
    return out


class NitroCli:
    """Runs the ``nitro-cli`` command (``command`` is the seam: tests give a fake)."""

    def __init__(self, command: Sequence[str] = ("nitro-cli",), timeout_s: float = 120.0):
        self._command = list(command)
        self._timeout = timeout_s

    async def _run(self, args: Sequence[str], timeout_s: float | None = None) -> str:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise NitroCliError("nitro_cli_failed", f"{self._command[0]}: {exc}") from None
        try:
            async with asyncio.timeout(timeout_s or self._timeout):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise NitroCliError("nitro_cli_timeout", f"nitro-cli {args[0]} timed out") from None
        if proc.returncode != 0:
            tail = err.decode(errors="replace")[-500:].strip()
            raise NitroCliError("nitro_cli_failed", f"nitro-cli {args[0]}: {tail}")
        return out[:MAX_OUTPUT].decode(errors="replace")

    async def run_enclave(self, args: Sequence[str]) -> RunningEnclave:
        return parse_run_enclave(await self._run(args))

    async def state(self, enclave_id: str) -> str | None:
        return parse_describe(await self._run(["describe-enclaves"], 10.0), enclave_id)

    async def terminate(self, enclave_id: str, timeout_s: float | None = None) -> None:
        await self._run(["terminate-enclave", "--enclave-id", enclave_id], timeout_s)
