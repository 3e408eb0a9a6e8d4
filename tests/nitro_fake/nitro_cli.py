"""A fake ``nitro-cli`` at the process seam (``python -m tests.nitro_fake.nitro_cli --state DIR
<nitro-cli arguments>``): records every call in ``DIR/calls.jsonl`` and acts like nitro-cli.

- ``build-enclave --docker-uri URI --output-file EIF``: writes the "EIF" (JSON: PCR0/1/2
  derived from the URI, the enclave-init command line of the image) and prints the
  measurements as nitro-cli does;
- ``run-enclave --eif-path EIF --cpu-count N --memory MIB [--enclave-cid CID]``: refuses more
  CPUs or memory than ``DIR/allocator.json`` holds (what the node's allocator reserved), then
  starts the "enclave" as a process tree in its own network namespace with only loopback
  (``unshare --net --map-root-user``) running ``attestmesh enclave-init`` over the Unix-socket
  transport, its NSM the test device of the EIF's PCRs; prints the enclave JSON;
- ``describe-enclaves``: the enclaves whose process is alive (``RUNNING``);
- ``terminate-enclave --enclave-id ID``: ends that process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _load(path: Path, default: Any) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return default


def _save(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def pcrs_for(uri: str) -> dict[str, str]:
    return {f"PCR{i}": hashlib.sha384(f"{uri}/{i}".encode()).hexdigest() for i in (0, 1, 2)}


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def build(state: Path, args: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--docker-uri", required=True)
    p.add_argument("--output-file", type=Path, required=True)
    a = p.parse_args(args)
    image = _load(state / "images.json", {})[a.docker_uri]  # the "docker image" of this URI
    pcrs = pcrs_for(a.docker_uri)
    a.output_file.write_text(json.dumps({"pcrs": pcrs, **image}))
    print("Start building the Enclave Image...", file=sys.stderr)
    print(json.dumps({"Measurements": {"HashAlgorithm": "Sha384 { ... }", **pcrs}}, indent=2))
    return 0


def run(state: Path, args: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--eif-path", type=Path, required=True)
    p.add_argument("--cpu-count", type=int, required=True)
    p.add_argument("--memory", type=int, required=True)
    p.add_argument("--enclave-cid", type=int)
    p.add_argument("--debug-mode", action="store_true")
    a = p.parse_args(args)
    allocator = _load(state / "allocator.json", {"cpu_count": 2, "memory_mib": 512})
    if a.cpu_count > allocator["cpu_count"] or a.memory > allocator["memory_mib"]:
        print("[ E26 ] Insufficient memory or CPUs requested.", file=sys.stderr)
        return 1
    eif = json.loads(a.eif_path.read_text())
    enclaves = _load(state / "enclaves.json", {})
    cid = a.enclave_cid or _load(state / "next_cid.json", 16)
    _save(state / "next_cid.json", cid + 1)
    enclave_id = f"i-0fa4e-enc{cid:016x}"
    home = state / f"enclave-{cid}"
    home.mkdir(exist_ok=True)
    pcrs = {0: eif["pcrs"]["PCR0"], 1: eif["pcrs"]["PCR1"], 2: eif["pcrs"]["PCR2"]}
    if a.debug_mode:
        pcrs = {i: "00" * 48 for i in (0, 1, 2)}
    device = {"pki": eif["pki"], "module_id": enclave_id,
              "pcrs": {**{i: "00" * 48 for i in range(3, 16)}, **pcrs}}  # fmt: skip
    (home / "nsm.json").write_text(json.dumps(device))
    cmd = [
        "unshare", "--net", "--map-root-user",
        sys.executable, "-m", "attestmesh.cli", "enclave-init",
        "--transport", f"unix:{eif['vsock_dir']}", "--cid", str(cid),
        "--nsm-device", str(home / "nsm.json"), "--run-dir", str(home / "run"),
        "--attestmesh-command", f"{sys.executable} -m tests.nitro_fake.agent",
        *eif["enclave_init_args"],
    ]  # fmt: skip
    log = (home / "console.log").open("ab")
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        cwd=eif["cwd"],
    )  # fmt: skip
    enclaves[enclave_id] = {"pid": proc.pid, "cid": cid, "cpus": a.cpu_count, "mib": a.memory}
    _save(state / "enclaves.json", enclaves)
    print("Start allocating memory...", file=sys.stderr)
    print(json.dumps({
        "EnclaveName": "app", "EnclaveID": enclave_id, "ProcessID": proc.pid,
        "EnclaveCID": cid, "NumberOfCPUs": a.cpu_count, "CPUIDs": list(range(1, a.cpu_count + 1)),
        "MemoryMiB": a.memory,
    }, indent=2))  # fmt: skip
    return 0


def describe(state: Path) -> int:
    out = [
        {"EnclaveName": "app", "EnclaveID": eid, "ProcessID": e["pid"], "EnclaveCID": e["cid"],
         "NumberOfCPUs": e["cpus"], "MemoryMiB": e["mib"], "State": "RUNNING", "Flags": "NONE"}
        for eid, e in _load(state / "enclaves.json", {}).items()
        if alive(e["pid"])
    ]  # fmt: skip
    print(json.dumps(out, indent=2))
    return 0


def kill_tree(pid: int, grace_s: float = 5.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def terminate(state: Path, args: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--enclave-id", required=True)
    a = p.parse_args(args)
    enclaves = _load(state / "enclaves.json", {})
    e = enclaves.pop(a.enclave_id, None)
    if e is None:
        print(f"[ E11 ] enclave {a.enclave_id} not found", file=sys.stderr)
        return 1
    kill_tree(e["pid"])
    _save(state / "enclaves.json", enclaves)
    print(json.dumps({"EnclaveID": a.enclave_id, "Terminated": True}))
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if len(argv) < 3 or argv[0] != "--state":
        print("usage: nitro_cli --state DIR COMMAND ...", file=sys.stderr)
        return 2
    state, command, rest = Path(argv[1]), argv[2], argv[3:]
    with (state / "calls.jsonl").open("a") as f:
        f.write(json.dumps([command, *rest]) + "\n")
    if command == "build-enclave":
        return build(state, rest)
    if command == "run-enclave":
        return run(state, rest)
    if command == "describe-enclaves":
        return describe(state)
    if command == "terminate-enclave":
        return terminate(state, rest)
    print(f"unknown command {command}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
