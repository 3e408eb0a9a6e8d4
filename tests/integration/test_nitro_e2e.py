"""The Nitro runtime end to end, without Nitro hardware.

Real processes: the control plane (``attestmesh controlplane``, told to trust the test NSM's
root with ``--roots``: only here), ``attestmesh nitro-parent`` with the fake ``nitro-cli``
(``tests.nitro_fake.nitro_cli``), which starts the "enclave" in its own network namespace
(only loopback) running ``attestmesh enclave-init`` over the Unix-socket transport: its agent
attests with documents of the test NSM (real COSE_Sign1 format), then real Envoy and the test
app run inside. A peer (simulated TEE, its real Envoy on the host) talks to the enclave and the
enclave to the peer, over SPIFFE mTLS through the bridges.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import GOOD, free_port, join_token, sidecar
from attestmesh.serve import ControlPlaneSettings
from sidecar.agent import client_ssl_context
from tests.nitro_fake.nitro_cli import alive, pcrs_for
from tests.nitro_fake.nsm import make_test_pki

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
IMAGE = "registry.example/enclave-app:1.0"
ROGUE_IMAGE = "registry.example/enclave-app:tampered"


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "attestmesh.cli", *args],
        capture_output=True, text=True, timeout=30, check=False, input=stdin, cwd=REPO,
    )  # fmt: skip


async def eventually(check: Any, what: str, timeout_s: float = 30.0) -> Any:
    last: Any = None
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    last = await check()
                    if last:
                        return last
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"{what}: not within {timeout_s}s (last: {last!r})") from None


@dataclass
class Parent:
    proc: subprocess.Popen[bytes]
    ready_port: int
    log: Path

    async def readyz(self, session: aiohttp.ClientSession) -> tuple[int, dict[str, Any]]:
        url = f"http://127.0.0.1:{self.ready_port}/readyz"
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.json()

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"nitro-parent ignored SIGTERM:\n{self.log.read_text()}") from None


@dataclass
class Mesh:
    root: Path
    state: Path  # the fake nitro-cli's state
    settings: ControlPlaneSettings
    ports: dict[str, dict[str, int]]
    tokens: dict[str, str]
    vsock: Path
    session: aiohttp.ClientSession
    parents: list[Parent]

    def nitro_cli(self) -> str:
        return f"{PY} -m tests.nitro_fake.nitro_cli --state {self.state}"

    def build_eif(self, uri: str, name: str) -> tuple[Path, str]:
        """``nitro-cli build-enclave`` of image ``uri``: the EIF and what nitro-cli printed."""
        eif = self.root / f"{name}.eif"
        out = subprocess.run(
            [*self.nitro_cli().split(), "build-enclave", "--docker-uri", uri,
             "--output-file", str(eif)],
            capture_output=True, text=True, check=True, timeout=30, cwd=REPO,
        )  # fmt: skip
        return eif, out.stdout

    def start_parent(self, name: str, eif: Path) -> Parent:
        s, p = self.settings, self.ports[name]
        token = self.root / f"{name}.token"
        token.write_text(self.tokens[name])
        log = self.root / f"parent-{name}.log"
        args = [
            PY, "-m", "attestmesh.cli", "nitro-parent", "--eif", str(eif),
            "--granted-cpus", "2", "--granted-memory-mib", "512",
            "--workload", name, "--control-plane", f"https://127.0.0.1:{s.api_port}",
            "--xds", f"127.0.0.1:{s.xds_port}", "--token-file", str(token),
            "--peer", f"127.0.0.1:{self.ports['peer']['inbound']}",
            "--inbound-address", "127.0.0.1", "--inbound-port", str(p["inbound"]),
            "--inbound-listen", "127.0.0.1", "--envoy-admin-port", str(p["admin"]),
            "--ready-host", "127.0.0.1", "--ready-port", str(p["ready"]),
            "--nitro-cli", self.nitro_cli(), "--transport", f"unix:{self.vsock}",
            "--backoff-initial", "0.2", "--boot-timeout", "60", "--grace", "10",
        ]  # fmt: skip
        with log.open("ab") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=f, stdin=subprocess.DEVNULL, cwd=REPO)
        parent = Parent(proc, p["ready"], log)
        self.parents.append(parent)
        return parent

    def enclaves(self) -> dict[str, Any]:
        path = self.state / "enclaves.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in (self.state / "calls.jsonl").read_text().splitlines()]

    async def metric(self, prefix: str) -> float:
        async with self.session.get(f"http://127.0.0.1:{self.settings.ops_port}/metrics") as r:
            text = await r.text()
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
        )

    async def get(self, port: int, path: str) -> tuple[int, str]:
        url = f"http://127.0.0.1:{port}{path}"
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
            return r.status, (await r.text()).strip()

    def diagnostics(self) -> str:
        out = []
        for path in sorted([*self.root.glob("*.log"), *self.state.glob("enclave-*/console.log")]):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)


def _write_config(root: Path, ports: dict[str, dict[str, int]], tokens: dict[str, str],
                  sim_pub: Path, roots: Path, nitro_policy: str) -> ControlPlaneSettings:  # fmt: skip
    sim_policy = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": "peer", "namespace": "default"},
        "spec": {
            "selector": {"serviceAccounts": ["peer"]},
            "allowedTees": ["sim"],
            "referenceValues": {"sim": {"measurement": [GOOD.hex()]}},
        },
    }
    (root / "policy.yaml").write_text(
        yaml.safe_dump_all([sim_policy, yaml.safe_load(nitro_policy)])
    )
    mesh = [
        {
            "apiVersion": "attestmesh.dev/v1alpha1",
            "kind": "MeshPolicy",
            "metadata": {"name": f"{dst}-callers", "namespace": "default"},
            "spec": {
                "destination": {"serviceAccount": dst},
                "rules": [{"from": [{"serviceAccount": src}]}],
            },
        }
        for src, dst in (("peer", "enclave"), ("enclave", "peer"))
    ]
    (root / "mesh.yaml").write_text(yaml.safe_dump_all(mesh))
    other = {"enclave": "peer", "rogue": "peer", "peer": "enclave"}
    regs = {
        "workloads": [
            {
                "name": n,
                "namespace": "default",
                "serviceAccount": "enclave" if n == "rogue" else n,
                "inbound": f"127.0.0.1:{p['inbound']}",
                "appPort": p["app"],
                "outbound": {other[n]: p["outbound"]},
                "tokenSha256": hashlib.sha256(tokens[n].encode()).hexdigest(),
            }
            for n, p in ports.items()
        ]
    }
    (root / "workloads.yaml").write_text(yaml.safe_dump(regs))
    return ControlPlaneSettings(
        state_dir=root / "state",
        policy_file=root / "policy.yaml",
        mesh_policy_file=root / "mesh.yaml",
        registrations_file=root / "workloads.yaml",
        sim_platform_keys=(sim_pub,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
        roots_dir=roots,
    )


@contextlib.asynccontextmanager
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    vsock = Path(tempfile.mkdtemp(prefix="amv-", dir="/tmp"))  # Unix socket paths stay short
    state = tmp_path / "nitro-cli"
    state.mkdir()
    (state / "allocator.json").write_text(json.dumps({"cpu_count": 2, "memory_mib": 512}))
    pki = tmp_path / "pki"
    roots = make_test_pki(pki)
    platform = ec.generate_private_key(ec.SECP256R1())
    sim_pub = tmp_path / "sim.pub.pem"
    sim_pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    names = ("enclave", "rogue", "peer")
    ports = {
        n: {k: free_port() for k in ("inbound", "app", "outbound", "admin", "ready")} for n in names
    }
    tokens = {n: join_token(n) for n in names}
    # the enclave image's policy: what `attestmesh policy from-eif` makes of nitro-cli's output
    measurements = json.dumps({"Measurements": pcrs_for(IMAGE)})
    made = cli("policy", "from-eif", "-", "--name", "enclave", "--service-account", "enclave",
               stdin=measurements)  # fmt: skip
    assert made.returncode == 0, made.stderr
    settings = _write_config(tmp_path, ports, tokens, sim_pub, roots, made.stdout)
    log = tmp_path / "controlplane.log"
    cp_args = [
        PY, "-m", "attestmesh.cli", "controlplane", "--state-dir", str(settings.state_dir),
        "--policy", str(settings.policy_file), "--mesh-policy", str(settings.mesh_policy_file),
        "--workloads", str(settings.registrations_file), "--api-port", str(settings.api_port),
        "--xds-port", str(settings.xds_port), "--ops-port", str(settings.ops_port),
        "--sim-platform-key", str(sim_pub), "--roots", str(roots),
    ]  # fmt: skip
    with log.open("ab") as f:
        cp = subprocess.Popen(cp_args, stdout=f, stderr=f, stdin=subprocess.DEVNULL, cwd=REPO)
    m: Mesh | None = None
    try:
        async with aiohttp.ClientSession() as session, contextlib.AsyncExitStack() as stack:

            async def healthy() -> bool:
                assert cp.poll() is None, log.read_text()
                url = f"http://127.0.0.1:{settings.ops_port}/healthz"
                async with session.get(url) as r:
                    return r.status == 200

            await eventually(healthy, "control plane healthy")
            ca_root = settings.state_dir / "ca" / "root.pem"
            # the "docker images": enclave-init with the mesh root pinned, then the app
            for uri in (IMAGE, ROGUE_IMAGE):
                name = "rogue" if uri == ROGUE_IMAGE else "enclave"
                app = [PY, "-m", "tests.nitro_fake.app", "--port", str(ports[name]["app"]),
                       "--outbound", str(ports[name]["outbound"])]  # fmt: skip
                images = (
                    json.loads((state / "images.json").read_text())
                    if (state / "images.json").exists()
                    else {}
                )
                images[uri] = {
                    "pki": str(pki), "vsock_dir": str(vsock), "cwd": str(REPO),
                    "enclave_init_args": ["--ca-bundle", str(ca_root), "--", *app],
                }  # fmt: skip
                (state / "images.json").write_text(json.dumps(images))
            tls = client_ssl_context(ca_root.read_bytes())
            peer = await stack.enter_async_context(
                sidecar("peer", settings, ports["peer"], tmp_path, platform, tokens["peer"], tls)
            )
            await peer.agent.attest_once(session)
            await peer.envoy.start()
            await peer.envoy.wait_ready()
            m = Mesh(tmp_path, state, settings, ports, tokens, vsock, session, [])
            try:
                yield m
            except BaseException:
                print(m.diagnostics())
                raise
            finally:
                for parent in m.parents:
                    with contextlib.suppress(AssertionError):
                        parent.stop()
    finally:
        if m is not None:
            for e in m.enclaves().values():  # whatever a failed test left behind
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(e["pid"], signal.SIGKILL)
        cp.kill()
        cp.wait(10)
        shutil.rmtree(vsock, ignore_errors=True)


async def test_enclave_attests_serves_mtls_both_ways_and_is_restarted(tmp_path: Path) -> None:
    async with mesh(tmp_path) as m:
        eif, printed = m.build_eif(IMAGE, "enclave")
        parent = m.start_parent("enclave", eif)

        async def ready() -> dict[str, Any] | None:
            assert parent.proc.poll() is None, parent.log.read_text()
            status, view = await parent.readyz(m.session)
            return view if status == 200 else None

        first = await eventually(ready, "the enclave attested (parent /readyz)", 120)
        assert first["attested"] and first["running"] and first["restarts"] == 0
        # sized from the grant: all of it, as nitro-cli was told
        run = [c for c in m.calls() if c[0] == "run-enclave"]
        assert run == [["run-enclave", "--eif-path", str(eif), "--cpu-count", "2",
                        "--memory", "512"]]  # fmt: skip
        assert await m.metric('attestmesh_attestations_total{reason="ok",result="admitted",'
                              'tee="nitro"}') == 1  # fmt: skip

        to_enclave = m.ports["peer"]["outbound"]

        async def hello() -> bool:
            return await m.get(to_enclave, "/hello") == (200, "hello from the enclave")

        # peer -> peer's Envoy -mTLS-> parent -> vsock -> enclave's Envoy -> app
        await eventually(hello, "peer -> enclave over mTLS", 60)
        # ... and the enclave's app -> its Envoy -> vsock -> parent -mTLS-> peer's Envoy -> peer
        status, body = await m.get(to_enclave, "/call")
        assert (status, body) == (200, "enclave called peer: 200 hello from peer"), body
        # the peer's Envoy verified the enclave's SPIFFE certificate on its inbound listener
        peer_stats = await m.get(m.ports["peer"]["admin"], "/stats?filter=ssl.handshake")
        assert "ssl.handshake" in peer_stats[1]

        # kill the enclave (its whole process tree): the parent restarts it, and the new
        # enclave attests afresh before it is ready again
        ((enclave_id, first_enclave),) = m.enclaves().items()
        os.killpg(first_enclave["pid"], signal.SIGKILL)

        async def restarted() -> dict[str, Any] | None:
            status, view = await parent.readyz(m.session)
            return view if status == 200 and view["enclave_id"] != enclave_id else None

        second = await eventually(restarted, "a restarted, re-attested enclave", 120)
        assert second["restarts"] == 1 and second["serial"] != first["serial"]
        assert await m.metric('attestmesh_attestations_total{reason="ok",result="admitted",'
                              'tee="nitro"}') == 2  # fmt: skip
        assert not alive(first_enclave["pid"])
        await eventually(hello, "peer -> restarted enclave over mTLS", 60)
        assert (await m.get(to_enclave, "/call"))[0] == 200

        # SIGTERM: the parent terminates the enclave within its grace period and exits 0
        assert parent.stop() == 0
        assert m.enclaves() == {}
        assert [c[0] for c in m.calls()].count("terminate-enclave") >= 2
        assert "PCR0" in printed


async def test_enclave_with_wrong_pcrs_is_refused_and_a_swapped_image_quarantined(
    tmp_path: Path,
) -> None:
    async with mesh(tmp_path) as m:
        good, _ = m.build_eif(IMAGE, "enclave")
        tampered, _ = m.build_eif(ROGUE_IMAGE, "rogue")
        parent = m.start_parent("enclave", good)
        rogue = m.start_parent("rogue", tampered)
        rejected = ('attestmesh_attestations_total{reason="measurement_not_allowed",'
                    'result="rejected",tee="nitro"}')  # fmt: skip

        async def ready() -> dict[str, Any] | None:
            status, view = await parent.readyz(m.session)
            return view if status == 200 else None

        first = await eventually(ready, "the good enclave attested", 120)

        # 1. an enclave whose PCRs the policy does not list gets no certificate, ever
        async def refused() -> bool:
            return await m.metric(rejected) >= 1

        await eventually(refused, "the rogue enclave's evidence refused", 120)
        status, view = await rogue.readyz(m.session)
        assert status == 503 and view["running"] and not view["attested"]

        to_enclave = m.ports["peer"]["outbound"]

        async def hello() -> bool:
            return await m.get(to_enclave, "/hello") == (200, "hello from the enclave")

        await eventually(hello, "peer -> enclave over mTLS", 60)

        # 2. the attested workload's image is swapped on the node; its enclave restarts from
        #    it: the appraisal fails, and the workload is quarantined (traffic cut)
        shutil.copyfile(tampered, good)
        ((enclave_id, e),) = [
            (k, v) for k, v in m.enclaves().items() if v["cid"] == first["enclave_cid"]
        ]
        os.killpg(e["pid"], signal.SIGKILL)

        async def quarantined() -> bool:
            return await m.metric("attestmesh_quarantined_workloads") == 1

        await eventually(quarantined, "the swapped enclave quarantined", 120)
        out = cli("quarantine", "list", "--json", "--ops-port", str(m.settings.ops_port),
                  "--state-dir", str(m.settings.state_dir))  # fmt: skip
        assert out.returncode == 0, out.stderr
        (item,) = json.loads(out.stdout)
        assert item["name"] == "enclave"
        assert item["quarantine"]["trigger"] == "appraisal_failed"
        assert "pcr0" in item["quarantine"]["reason"]

        async def cut() -> bool:
            return (await m.get(to_enclave, "/hello"))[0] != 200

        await eventually(cut, "peer -> quarantined enclave refused", 30)
        status, view = await parent.readyz(m.session)
        assert status == 503 and view["enclave_id"] != enclave_id and not view["attested"]
        assert await m.metric(rejected) >= 2
