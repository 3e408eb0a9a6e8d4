"""Scale benchmark (issue 7): a REAL ``attestmesh controlplane`` process driven only through its
public interfaces -- the workloads file, the HTTPS attestation API (sim TEE), mTLS ADS streams
(one TLS connection per Envoy-like stream, each presenting a workload certificate obtained
through the API) and the ops API -- with clients in separate processes and the server's CPU
read from /proc.

Scenario at mesh size N: workload i even is a caller of service ``target`` (N/2 callers, in
service accounts client-0..3); w1, w3, w5, w7 are ``target``'s members (w1 gets quarantined);
the other odd workloads form services svc-0..svc-6, each calling the next. Per N:

1. start, attest all N (+ a few registered-but-unattested newcomers), stop, start again: CPU
   until /healthz answers with N attested workloads in the store;
2. open N mTLS ADS streams (node = workload, certificate of its service account), wait until
   every stream has its configuration: CPU per new stream, RSS per idle stream;
3. quarantine w1 through the ops API: control-plane CPU until every caller stream has ACKed a
   response that removes w1's endpoint, and the wall time from the ops call returning (the
   decision is persisted by then) to the last such ACK. Meanwhile real traffic flows through
   ``--envoys`` real Envoys (benchmarks.scale_envoy: w1 and callers of ``target``, each with its
   app, agent and local SDS, on delta ADS among the lean streams): the time from the ops call
   returning to each caller Envoy refusing to reach w1, over ``--envoy-rounds`` quarantines
   (w1 released and re-attested by its agent in between), as a p99 and median;
4. the first attestation of a newcomer (a caller, like half the mesh): CPU, against the same
   at N=100;
5. issuance at 1 / 8 / 64 concurrent clients (full attestations through the API, round-robin
   over 10 / 45 / 45 % of the mesh, a workload the server rate-limits leaving the rotation),
   server CPU per attestation against the unavoidable crypto measured here, and /healthz p99
   under the 64-client load; the ADS responses each attestation caused are noted by type.

CPU is the control plane's process tree (worker processes included): per-thread run time from
/proc/<pid>/task/*/schedstat (ns), or utime+stime from /proc/<pid>/stat when those differ by
more than 20 ms (exited threads). Waits are capped (``--*-timeout``): a figure that did not
complete in time prints TIMEOUT; a phase that errors prints ERROR with a note.

Per N, right after the mesh's issuance phase: OpenBao PKI (raft storage, TLS,
``pki/sign/<role>`` with a CSR) at 8 and 64 clients, a fresh server each time, for the
issuance ratio (measured beside ours: this shared machine's speed drifts by up to a quarter
within minutes).

Run: ``python -m benchmarks.bench_scale --n 1000,10000`` (``--quick``: N=200, short phases;
``--json FILE`` writes every figure; ``--controlplane-cmd`` picks the executable under test,
default the venv's ``attestmesh`` console script, e.g. ``--controlplane-cmd "env
PYTHONPATH=/tmp/old-tree .venv/bin/attestmesh"`` for another source tree; ``--xds-protocol
sotw``; ``--cert-per-service-account``). ``make bench`` runs it with ``BENCH_SCALE_ARGS``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from attestmesh.demo import free_port
from benchmarks.scale_ads import raise_nofile
from benchmarks.scale_bao import start_bao
from benchmarks.scale_envoy import EnvoyMesh, EnvoyPorts, EnvoySpec
from benchmarks.scale_floor import push_floor
from benchmarks.scale_proc import ControlPlane, CpuMeter, Profiler, Worker
from sidecar.agent import build_csr

MEASUREMENT = "a1" * 48
# w1, w3, w5, w7: the quarantine leaves the members' identities the callers' cluster pins as
# they were (one service account), so a caller gets new endpoints only; with w1 alone the
# cluster changes too (CDS + EDS per caller: twice the pushes)
TARGET_MEMBERS = 4
OTHER_SERVICES = 7
CALLER_SAS = 4
VICTIM = "w1"
TIMEOUT = "TIMEOUT"
FIRST_N, FIRST_100 = "first_attest_cpu_ms", "first_attest_cpu_100_ms"


# -- the scenario --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    sa: str
    inbound_port: int
    outbound: tuple[str, ...]
    token: str
    caller: bool
    # a real sidecar (bench_scale's Envoys) needs ports of its own; lean streams bind nothing
    app_port: int | None = None
    outbound_port: int = 15001

    def doc(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "serviceAccount": self.sa,
            "service": self.sa,
            "inbound": f"127.0.0.1:{self.inbound_port}",
            "appPort": self.app_port or 40000 + (self.inbound_port - 20000) % 25000,
            "outbound": {s: self.outbound_port + i for i, s in enumerate(self.outbound)},
            "tokenSha256": hashlib.sha256(self.token.encode()).hexdigest(),
        }


def workload(i: int, seed: str, name: str | None = None) -> Workload:
    name = name or f"w{i}"
    token = hashlib.sha256(f"{seed}/{name}".encode()).hexdigest()
    if i % 2 == 0:
        return Workload(
            name, f"client-{(i // 2) % CALLER_SAS}", 20000 + i, ("target",), token, True
        )
    if i < 2 * TARGET_MEMBERS:
        return Workload(name, "target", 20000 + i, (), token, False)
    k = (i // 2) % OTHER_SERVICES
    return Workload(name, f"svc-{k}", 20000 + i, (f"svc-{(k + 1) % OTHER_SERVICES}",), token, False)


def scenario(n: int, newcomers: int, seed: str) -> tuple[list[Workload], list[Workload]]:
    mesh = [workload(i, seed) for i in range(n)]
    # newcomers join as callers (like half the mesh), with ports past the mesh's
    new = [workload(2 * (n + j), seed, f"new{j}") for j in range(newcomers)]
    return mesh, new


def write_config(
    d: Path, mesh: Sequence[Workload], new: Sequence[Workload], sim_pub: Path
) -> dict[str, Path]:
    sas = sorted({w.sa for w in (*mesh, *new)})
    policy = {
        "apiVersion": "attestmesh.dev/v1alpha1",
        "kind": "AttestationPolicy",
        "metadata": {"name": "bench", "namespace": "default"},
        "spec": {
            "selector": {"serviceAccounts": sas},
            "allowedTees": ["sim"],
            "certificateTTL": "24h",
            "reattestationInterval": "24h",
            "referenceValues": {"sim": {"measurement": [MEASUREMENT]}},
        },
    }

    def mesh_policy(dest: str, sources: Sequence[str]) -> dict[str, Any]:
        return {
            "apiVersion": "attestmesh.dev/v1alpha1",
            "kind": "MeshPolicy",
            "metadata": {"name": f"to-{dest}", "namespace": "default"},
            "spec": {
                "destination": {"serviceAccount": dest},
                "rules": [
                    {"from": [{"serviceAccount": s} for s in sources], "to": [{"methods": ["GET"]}]}
                ],
            },
        }

    mesh_docs = [mesh_policy("target", [f"client-{c}" for c in range(CALLER_SAS)])]
    mesh_docs += [
        mesh_policy(f"svc-{k}", [f"svc-{(k - 1) % OTHER_SERVICES}"]) for k in range(OTHER_SERVICES)
    ]
    files = {
        "policy": d / "policy.yaml",
        "mesh": d / "mesh.yaml",
        "workloads": d / "workloads.yaml",
    }
    files["policy"].write_text(yaml.safe_dump(policy))
    files["mesh"].write_text(yaml.safe_dump_all(mesh_docs))
    files["workloads"].write_text(
        yaml.safe_dump({"workloads": [w.doc() for w in (*mesh, *new)]}, sort_keys=False)
    )
    files["sim_pub"] = sim_pub
    return files


def source_address(i: int, per_source: int = 200) -> str:
    """Streams come from many loopback addresses (as Envoys come from many pods): at most
    ``per_source`` per address, well under any per-source connection cap."""
    b = i // per_source
    return f"127.0.{1 + b // 250}.{1 + b % 250}"


# -- figures --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    op: str  # "<=" or ">="
    limit: float
    unit: str

    def check(self, value: float) -> bool:
        return value <= self.limit if self.op == "<=" else value >= self.limit


@dataclass
class Figures:
    """Figure name -> value (float) or a string (TIMEOUT, or why it is missing)."""

    values: dict[str, float | str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: float | str | None) -> None:
        self.values[key] = TIMEOUT if value is None else value


# (key, label, unit, target or None)
FIGURES: list[tuple[str, str, str, Target | None]] = [
    (
        "startup_cpu_s",
        "start-up CPU until /healthz (N attested in store)",
        "s",
        Target("<=", 10.0, "s"),
    ),
    (
        "stream_cpu_ms",
        "CPU per new mTLS ADS stream (until configured)",
        "ms",
        Target("<=", 2.0, "ms"),
    ),
    (
        "stream_rss_kb",
        "memory per idle mTLS ADS stream (RSS delta / N)",
        "KB",
        Target("<=", 30.0, "KB"),
    ),
    ("quarantine_cpu_s", "one quarantine: control-plane CPU", "s", Target("<=", 0.2, "s")),
    (
        "quarantine_floor_cpu_s",
        "  floor: a TLS write + an ACK read per caller (same run)",
        "s",
        None,
    ),
    ("quarantine_floor_ratio", "  control-plane CPU / floor", "x", None),
    ("quarantine_ops_call_s", "one quarantine: ops API call (until it returned)", "s", None),
    (
        "quarantine_ack_s",
        "one quarantine: ops call returned -> last caller ACK",
        "s",
        Target("<=", 1.0, "s"),
    ),
    (
        "quarantine_clients_cpu_s",
        "  the lean ADS clients' CPU meanwhile (on the same cores)",
        "s",
        None,
    ),
    (
        "quarantine_floor_wall_s",
        "  floor: the same writes and reads, wall time",
        "s",
        None,
    ),
    (
        "envoy_refused_p99_ms",
        "quarantine: ops call returned -> refused by real Envoys, p99",
        "ms",
        Target("<=", 50.0, "ms"),
    ),
    (
        "envoy_refused_p50_ms",
        "quarantine: ops call returned -> refused by real Envoys, p50",
        "ms",
        None,
    ),
    (
        "envoy_routed_away_p99_ms",
        "quarantine: ops call returned -> caller Envoys' own EDS dropped w1, p99",
        "ms",
        None,
    ),
    ("first_attest_cpu_ms", "first attestation of a new workload: CPU at N", "ms", None),
    ("first_attest_cpu_100_ms", "first attestation of a new workload: CPU at N=100", "ms", None),
    ("first_attest_ratio", "first attestation CPU at N / at N=100", "x", Target("<=", 1.5, "x")),
    ("rate_1", "issuance, 1 client", "/s", None),
    ("rate_8", "issuance, 8 clients", "/s", None),
    ("rate_64", "issuance, 64 clients", "/s", None),
    ("cpu_per_attest_1_ms", "server CPU per attestation, 1 client", "ms", None),
    ("cpu_per_attest_8_ms", "server CPU per attestation, 8 clients", "ms", None),
    ("cpu_per_attest_64_ms", "server CPU per attestation, 64 clients", "ms", None),
    ("crypto_ms", "unavoidable crypto per attestation (in-process)", "ms", None),
    (
        "cpu_per_attest_ratio",
        "server CPU per attestation / crypto (worst level)",
        "x",
        Target("<=", 4.0, "x"),
    ),
    ("bao_rate_8", "OpenBao pki/sign (raft), 8 clients", "/s", None),
    ("bao_rate_64", "OpenBao pki/sign (raft), 64 clients", "/s", None),
    ("bao_ratio_8", "issuance ours / OpenBao, 8 clients", "x", Target(">=", 1.0, "x")),
    ("bao_ratio_64", "issuance ours / OpenBao, 64 clients", "x", Target(">=", 1.0, "x")),
    (
        "healthz_p99_ms",
        "/healthz p99 under 64-client attestation load",
        "ms",
        Target("<=", 20.0, "ms"),
    ),
]
FIGURE_KEYS = [k for k, *_ in FIGURES]


# -- the unavoidable crypto ----------------------------------------------------------------------


def crypto_lower_bound(n: int) -> float:
    """Median CPU of evidence signature verify + CSR signature verify + leaf signature (P-256),
    in this process: what any issuer of sim attestations must spend (as bench_attest)."""
    platform = ec.generate_private_key(ec.SECP256R1())
    signer = ec.generate_private_key(ec.SECP256R1())
    data, tbs = b"x" * 300, b"y" * 600
    sig = platform.sign(data, ec.ECDSA(hashes.SHA256()))
    csr = x509.load_pem_x509_csr(build_csr(ec.generate_private_key(ec.SECP256R1())))
    out = []
    for _ in range(n):
        t0 = time.process_time()
        platform.public_key().verify(sig, data, ec.ECDSA(hashes.SHA256()))
        assert csr.is_signature_valid
        signer.sign(tbs, ec.ECDSA(hashes.SHA256()))
        out.append(time.process_time() - t0)
    return statistics.median(out)


def write_sim_platform(workdir: Path) -> tuple[Path, Path]:
    """A fresh simulated TEE platform key: (private key PEM, public key PEM) in ``workdir``."""
    platform = ec.generate_private_key(ec.SECP256R1())
    sim_key, sim_pub = workdir / "sim.key", workdir / "sim.pub"
    sim_key.write_bytes(
        platform.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    sim_pub.write_bytes(
        platform.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return sim_key, sim_pub


# -- one mesh size --------------------------------------------------------------------------------


@dataclass
class Settings:
    command: list[str]
    extra_flags: list[str]
    workdir: Path
    seed: str
    newcomers: int
    load_s: float
    ads_workers: int
    protocol: str
    setup_timeout: float
    phase_timeout: float
    quarantine_timeout: float
    first_attest_timeout: float
    attest_concurrency: int
    cert_per_workload: bool = True  # False: one certificate per service account
    envoys: int = 10  # real Envoys among the streams (the victim and callers of its service)
    envoy_rounds: int = 3  # quarantines measured by them (release + re-attestation between)
    envoy_interval_s: float = 0.005  # between one caller Envoy's requests
    py_spy: Path | None = None  # profile the control plane's phases into this directory
    py_spy_phases: frozenset[str] | None = None  # which (None: streams, quarantine, first...)
    py_spy_gil: bool = False  # sample only the thread holding the GIL (py-spy --gil)
    py_spy_native: bool = False  # with C frames (py-spy --native)


def log(msg: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cp_supports(command: Sequence[str], flag: str) -> bool:
    out = subprocess.run(
        [*command, "controlplane", "--help"], capture_output=True, text=True, timeout=60
    )
    return flag in out.stdout


class MeshRun:
    def __init__(self, n: int, s: Settings, sim_key: Path, sim_pub: Path, envoys: int = 0) -> None:
        self.n, self.s = n, s
        self.d = s.workdir / f"n{n}"
        self.d.mkdir(parents=True, exist_ok=True)
        self.mesh, self.new = scenario(n, s.newcomers, s.seed)
        self.envoy_specs = self.pick_envoys(envoys)
        self.envoy_mesh: EnvoyMesh | None = None
        # ops call returned -> a caller Envoy refused (upper bounds: the refused answer's
        # arrival; lower bounds: the send time of the victim's last answer before it); and
        # from the ops call being sent
        self.refused_ms: list[float] = []
        self.refused_lo_ms: list[float] = []
        self.refused_sent_ms: list[float] = []
        self.routed_away_ms: list[float] = []  # the callers' own endpoints, not w1's RBAC
        self.files = write_config(self.d, self.mesh, self.new, sim_pub)
        self.sim_key = sim_key
        ports = {"api": free_port(), "xds": free_port(), "ops": free_port()}
        extra = list(s.extra_flags)
        if cp_supports(s.command, "--max-connections"):  # N streams on one listener
            extra += ["--max-connections", str(max(10_000, 2 * n + 1000))]
        self.cp = ControlPlane(
            s.command, self.d / "state", self.files, ports, self.d / "controlplane.log", extra
        )
        self.attesters: list[Worker] = []
        self.ads: list[Worker] = []
        self.certs = self.d / "certs"
        self.certs.mkdir(exist_ok=True)

    def pick_envoys(self, count: int) -> list[EnvoySpec]:
        """The workloads run as real sidecars: the victim and ``count - 1`` callers of its
        service (like half the mesh), each given ports of its own; the rest stay lean streams."""
        if count <= 0:
            return []
        callers = [w.name for w in self.mesh if w.caller][: count - 1]
        chosen = {VICTIM, *callers}
        specs = []
        for k, w in enumerate(self.mesh):
            if w.name not in chosen:
                continue
            ports = EnvoyPorts(free_port(), free_port(), free_port(), free_port())
            self.mesh[k] = replace(
                w, inbound_port=ports.inbound, app_port=ports.app, outbound_port=ports.outbound
            )
            specs.append(EnvoySpec(w.name, w.token, w.caller, ports))
        return specs

    @property
    def lean(self) -> list[Workload]:
        """The workloads whose stream is a lean client (all but the real sidecars')."""
        real = {e.name for e in self.envoy_specs}
        return [w for w in self.mesh if w.name not in real]

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.cp.ports['api']}"

    async def start_attesters(self, count: int) -> None:
        bundle = self.cp.state_dir / "ca" / "root.pem"
        while len(self.attesters) < count:
            self.attesters.append(
                await Worker.start(
                    "benchmarks.scale_attest",
                    str(self.sim_key),
                    str(bundle),
                    self.api_url,
                    log=self.d / "attest-worker.log",
                )
            )

    async def attest(self, items: list[dict[str, Any]], procs: int, conc: int, cap_s: float) -> int:
        """Attest every item once through the API; the number that succeeded (-1: timeout)."""
        await self.start_attesters(procs)
        parts = [items[i::procs] for i in range(procs)]
        try:
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        w.call({"cmd": "attest_all", "items": p, "concurrency": conc})
                        for w, p in zip(self.attesters, parts, strict=False)
                        if p
                    )
                ),
                cap_s,
            )
        except TimeoutError:
            return -1
        for o in outs:
            if o["n_errors"]:
                log(f"attestation errors: {o['n_errors']} e.g. {o['errors'][:2]}")
        return sum(int(o["ok"]) for o in outs)

    async def close_workers(self) -> None:
        if self.envoy_mesh is not None:
            await self.envoy_mesh.close()
            self.envoy_mesh = None
        for w in [*self.attesters, *self.ads]:
            await w.close()
        self.attesters, self.ads = [], []

    async def setup(self, f: Figures) -> bool:
        """First start, attest the whole mesh (saving one certificate per service account),
        stop, and start again: the start-up CPU figure. False if it could not be done in time."""
        log(f"N={self.n}: first start")
        if await self.cp.start(self.s.phase_timeout) is None:
            f.notes.append("first start: /healthz never answered")
            return False
        saved: set[str] = set()
        items = []
        for w in self.mesh:
            item = {"workload": w.name, "token": w.token}
            holder = self.cert_holder(w)
            if holder not in saved:
                saved.add(holder)
                item["save"] = str(self.certs / holder)
            items.append(item)
        log(f"N={self.n}: attesting {len(items)} workloads")
        t0 = time.monotonic()
        ok = await self.attest(items, 2, self.s.attest_concurrency, self.s.setup_timeout)
        log(f"N={self.n}: attested {ok} in {time.monotonic() - t0:.1f} s")
        await self.close_workers()
        if not self.cp.stop():
            f.notes.append("stop: the control plane did not exit within 5 s of SIGINT (killed)")
        if ok != len(items):
            f.notes.append(f"setup: attested {ok} of {len(items)} (-1: timeout)")
            return False
        log(f"N={self.n}: restart with {self.n} attested workloads in the store")
        f.set("startup_cpu_s", await self.cp.start(self.s.phase_timeout))
        hot = hot_path(self.d / "controlplane.log")
        log(f"N={self.n}: the control plane's ADS hot path: {hot}")
        f.notes.append(f"the control plane's ADS hot path (xds.native): {hot}")
        return f.values["startup_cpu_s"] != TIMEOUT

    def cert_holder(self, w: Workload) -> str:
        """Whose certificate a node's stream presents: its service account's (the control
        plane authorizes a node by the SPIFFE ID, today per service account), or its own."""
        return w.name if self.s.cert_per_workload else w.sa

    async def open_streams(self, f: Figures, streams: Sequence[Workload]) -> bool:
        bundle = str(self.cp.state_dir / "ca" / "root.pem")
        k = max(1, min(self.s.ads_workers, math.ceil(len(streams) / 250)))
        self.ads = [
            await Worker.start("benchmarks.scale_ads", log=self.d / "ads-worker.log")
            for _ in range(k)
        ]
        specs = [
            {
                "node": w.name,
                "caller": w.caller,
                "src": source_address(i),
                "cert": str(self.certs / f"{self.cert_holder(w)}.chain.pem"),
                "key": str(self.certs / f"{self.cert_holder(w)}.key.pem"),
            }
            for i, w in enumerate(streams)
        ]
        meter = self.cp.meter()
        await meter.settle()
        cpu0, rss0 = meter.sample(), meter.rss()
        t0 = time.monotonic()
        common = {
            "host": "127.0.0.1",
            "port": self.cp.ports["xds"],
            "ca": bundle,
            "protocol": self.s.protocol,
            "concurrency": 50,
            "timeout": 60,
        }
        opened = await asyncio.gather(
            *(
                w.call({"cmd": "open", "streams": specs[i::k], **common})
                for i, w in enumerate(self.ads)
            )
        )
        errors = sum(o["errors"] for o in opened)
        if errors:
            f.notes.append(
                f"streams: {errors} failed to connect, e.g. {opened[0]['error_samples']}"
            )
        synced = await asyncio.gather(
            *(w.call({"cmd": "wait_synced", "timeout": self.s.phase_timeout}) for w in self.ads)
        )
        n_synced = sum(o["synced"] for o in synced)
        n_closed = sum(o["closed"] for o in synced)
        samples = [o["closed_samples"] for o in synced if o["closed"]][:1]
        log(
            f"N={self.n}: {n_synced}/{len(streams)} streams configured in "
            f"{time.monotonic() - t0:.1f} s ({n_closed} closed {samples}); responses by type: "
            f"{await self.ads_stats()}"
        )
        await meter.settle(cap_s=self.s.phase_timeout)
        cpu1, rss1 = meter.sample(), meter.rss()
        if n_synced < len(streams):
            f.set("stream_cpu_ms", None)
            f.set("stream_rss_kb", None)
            f.notes.append(
                f"streams: only {n_synced} of {len(streams)} configured ({n_closed} closed)"
            )
            return bool(n_synced > 0)
        f.set("stream_cpu_ms", CpuMeter.delta(cpu0, cpu1) / len(streams) * 1e3)
        f.set("stream_rss_kb", (rss1 - rss0) / len(streams) / 1024)
        return True

    async def quarantine(self, f: Figures, session: aiohttp.ClientSession) -> None:
        victim = next(w for w in self.mesh if w.name == VICTIM)
        marks = await asyncio.gather(
            *(
                w.call({"cmd": "mark", "victim": ["127.0.0.1", victim.inbound_port]})
                for w in self.ads
            )
        )
        callers = sum(m["callers"] for m in marks)
        had = sum(m["had_victim"] for m in marks)
        if had < callers:
            f.notes.append(
                f"quarantine: {callers - had} of {callers} caller streams did not hold "
                "w1's endpoint before; for them the first response after the call counts"
            )
        em = self.envoy_mesh
        t0 = time.monotonic()
        if em is not None and not await em.wait_all_answered(self.s.phase_timeout):
            f.notes.append(
                "envoys: not every caller Envoy reached the victim before the quarantine"
            )
            await em.stop_traffic()
            em = None
        if em is not None:
            log(f"N={self.n}: every caller Envoy reaches w1 ({time.monotonic() - t0:.1f} s)")
        meter = self.cp.meter()
        await meter.settle()
        clients = [CpuMeter(w.proc.pid) for w in self.ads]
        client0 = [c.sample() for c in clients]
        cpu0 = meter.sample()
        t_send = time.monotonic()
        try:
            await asyncio.wait_for(
                self.cp.ops(
                    session,
                    "POST",
                    f"/v1/admin/workloads/{VICTIM}/quarantine",
                    {"reason": "bench_scale"},
                ),
                self.s.quarantine_timeout,
            )
        except TimeoutError:
            f.set("quarantine_ops_call_s", None)
            f.set("quarantine_cpu_s", None)
            f.set("quarantine_ack_s", None)
            return
        t_ret = time.monotonic()
        f.set("quarantine_ops_call_s", t_ret - t_send)
        left = max(1.0, self.s.quarantine_timeout - (t_ret - t_send))
        # the real Envoys watch the same quarantine the lean streams measure
        watch = asyncio.create_task(em.wait_refused(t_send, left)) if em is not None else None
        outs = await asyncio.gather(
            *(w.call({"cmd": "wait_taken", "timeout": left}) for w in self.ads)
        )
        cpu1 = meter.sample()
        client_cpu = sum(
            CpuMeter.delta(a, c.sample()) for a, c in zip(client0, clients, strict=True)
        )
        if em is not None and watch is not None:
            await watch
            self.record_refusals(f, em, t_send, t_ret, 1)
            await em.stop_traffic()
        taken = sum(o["taken"] for o in outs)
        lasts = [o["last"] for o in outs if o["last"] is not None]
        still = sum(o["victim_still_present"] for o in outs)
        touched = sum(o["noncallers_touched"] for o in outs)
        log(
            f"N={self.n}: quarantine taken by {taken}/{callers} callers; "
            f"{touched} non-caller streams got a response; {still} still see w1"
        )
        if taken < callers:
            f.set("quarantine_cpu_s", None)
            f.set("quarantine_ack_s", None)
            f.notes.append(
                f"quarantine: only {taken} of {callers} caller streams ACKed it within "
                f"{self.s.quarantine_timeout:.0f} s"
            )
            return
        f.set("quarantine_cpu_s", CpuMeter.delta(cpu0, cpu1))
        f.set("quarantine_ack_s", max(lasts) - t_ret)
        f.set("quarantine_clients_cpu_s", client_cpu)
        f.notes.append(
            f"quarantine: ops call sent -> last caller ACK {max(lasts) - t_send:.3f} s; "
            f"{touched} of {self.n - callers} other streams were sent something"
        )

    async def start_envoys(self, f: Figures) -> bool:
        """The real sidecars join the mesh (their streams among the lean ones)."""
        if not self.envoy_specs:
            return True
        # w3, w5, w7 are lean: nothing listens on their ports, a caller's Envoy answers 503 for
        # them; w1 answers one request in TARGET_MEMBERS until the quarantine
        em = EnvoyMesh(
            self.envoy_specs, VICTIM, self.d / "envoys", self.s.envoy_interval_s, TARGET_MEMBERS
        )
        try:
            took = await em.start(
                self.api_url,
                self.cp.ports["xds"],
                self.cp.state_dir / "ca" / "root.pem",
                self.sim_key,
                bytes.fromhex(MEASUREMENT),
                self.s.phase_timeout,
            )
        except BaseException:
            await em.close()
            raise
        self.envoy_mesh = em
        log(f"N={self.n}: {len(em.envoys)} real Envoys attested and ready in {took:.1f} s")
        f.notes.append(
            f"envoys: {len(em.envoys)} real Envoys (victim + {len(em.probers)} callers) among "
            f"{len(self.lean)} lean streams, ready in {took:.1f} s"
        )
        return True

    def record_refusals(
        self, f: Figures, em: EnvoyMesh, t_send: float, t_ret: float, round_no: int
    ) -> None:
        windows, flaps = em.refusals(t_send)
        em.dump(self.d / f"envoys-round-{round_no}.json", t_send - 0.1, t_ret)
        never = sum(w is None for w in windows)
        lat = [(w[1] - t_ret) * 1e3 for w in windows if w is not None]
        self.refused_ms += lat
        self.refused_lo_ms += [
            (w[0] - t_ret) * 1e3 for w in windows if w is not None and w[0] is not None
        ]
        self.refused_sent_ms += [(w[1] - t_send) * 1e3 for w in windows if w is not None]
        away = [math.inf if a is None else (a - t_ret) * 1e3 for a in em.routed_away(t_send)]
        self.routed_away_ms += away
        log(
            f"N={self.n}: round {round_no}: caller Envoys' own EDS dropped w1 after "
            f"{', '.join(f'{x:.1f}' for x in sorted(away))} ms"
        )
        early = sum(x < 0 for x in lat)
        log(
            f"N={self.n}: round {round_no}: caller Envoys refused after "
            f"{', '.join(f'{x:.1f}' for x in sorted(lat))} ms"
            + (f"; {never} never" if never else "")
        )
        if never:
            f.notes.append(f"envoys round {round_no}: {never} caller Envoys never refused")
            self.refused_ms.append(math.inf)
        if early:
            f.notes.append(
                f"envoys round {round_no}: {early} refused before the ops call returned "
                "(negative figures)"
            )
        if flaps:
            f.notes.append(
                f"envoys round {round_no}: {flaps} answers by the victim after a refusal"
            )

    async def envoy_rounds(self, f: Figures, session: aiohttp.ClientSession) -> None:
        """More quarantines for the real-Envoy figure: release the victim, its agent attests
        again, every caller Envoy reaches it again, quarantine; the figure over all rounds."""
        em = self.envoy_mesh
        if em is None:
            return
        meter = self.cp.meter()
        for r in range(2, self.s.envoy_rounds + 1):
            await self.cp.ops(session, "POST", f"/v1/admin/workloads/{VICTIM}/release", {})
            await em.reattest(VICTIM)
            if not await em.wait_all_answered(self.s.phase_timeout):
                await em.stop_traffic()
                f.notes.append(f"envoys round {r}: callers did not reach the released victim")
                break
            await meter.settle()
            t_send = time.monotonic()
            await self.cp.ops(
                session, "POST", f"/v1/admin/workloads/{VICTIM}/quarantine", {"reason": "bench"}
            )
            t_ret = time.monotonic()
            await em.wait_refused(t_send, self.s.quarantine_timeout)
            self.record_refusals(f, em, t_send, t_ret, r)
            await em.stop_traffic()
        if self.refused_ms:
            f.set("envoy_refused_p99_ms", percentile(self.refused_ms, 99))
            f.set("envoy_refused_p50_ms", statistics.median(self.refused_ms))
            if self.routed_away_ms:
                f.set("envoy_routed_away_p99_ms", percentile(self.routed_away_ms, 99))
            lo = percentile(self.refused_lo_ms, 99) if self.refused_lo_ms else math.nan
            f.notes.append(
                f"envoys: refusal measured {len(self.refused_ms)} times (callers x rounds), max "
                f"{max(self.refused_ms):.1f} ms; each figure is the arrival of the "
                f"{TARGET_MEMBERS}th answer in a row not the victim's (an upper bound); the "
                f"victim's last answer was sent at p99 {lo:.1f} ms (a lower "
                f"bound); from the ops call being sent: p50 "
                f"{statistics.median(self.refused_sent_ms):.1f} ms, p99 "
                f"{percentile(self.refused_sent_ms, 99):.1f} ms"
            )

    async def first_attestations(self, key: str, f: Figures) -> None:
        """CPU of each newcomer's first attestation, one at a time (until the server is quiet
        again, so the work it causes after answering counts): the median."""
        await self.start_attesters(1)
        meter = self.cp.meter()
        cpu: list[float] = []
        # (the quarantines before revoked certificates: the streams that deny the victim anyway
        # get the new CRL in one coalesced fan-out serve.TRUST_FANOUT_DELAY after the first, or
        # with the next patch they take; at N=10,000 a fan-out costs ~0.5-1 s CPU: in one
        # window of nine at most, which the median absorbs)
        for w in self.new:
            await meter.settle()
            c0 = meter.sample()
            ok = await self.attest(
                [{"workload": w.name, "token": w.token}], 1, 1, self.s.first_attest_timeout
            )
            if ok != 1:
                f.set(key, None)
                return
            await meter.settle(cap_s=self.s.first_attest_timeout)
            cpu.append(CpuMeter.delta(c0, meter.sample()))
        f.set(key, statistics.median(cpu) * 1e3)

    async def issuance(self, f: Figures, session: aiohttp.ClientSession, crypto_s: float) -> None:
        items = [{"workload": w.name, "token": w.token} for w in self.mesh if w.name != VICTIM]
        # Each level attests its own share of the mesh (10 / 45 / 45 %): a control plane may
        # rate-limit how often one workload attests (a workload it limits leaves the rotation).
        cut1, cut8 = len(items) // 10, len(items) * 55 // 100
        shares = {1: items[:cut1], 8: items[cut1:cut8], 64: items[cut8:]}
        meter = self.cp.meter()
        ratios = []
        for c in (1, 8, 64):
            procs = min(c, 4)
            await self.start_attesters(procs)
            await meter.settle()
            start_at = time.monotonic() + 0.5
            parts = [c // procs + (1 if i < c % procs else 0) for i in range(procs)]
            probe: asyncio.Task[list[float]] | None = None
            if c == 64:
                probe = asyncio.create_task(self.probe_healthz(session, start_at, self.s.load_s))
            await asyncio.sleep(max(0.0, start_at - time.monotonic() - 0.05))
            pushed0 = await self.ads_stats()
            c0, r0 = meter.sample(), meter.sample_root()
            outs = await asyncio.wait_for(
                asyncio.gather(
                    *(
                        w.call(
                            {
                                "cmd": "load",
                                "kind": "attest",
                                "items": shares[c][i::procs],
                                "concurrency": parts[i],
                                "duration": self.s.load_s,
                                "start_at": start_at,
                            }
                        )
                        for i, w in enumerate(self.attesters[:procs])
                    )
                ),
                self.s.load_s + self.s.phase_timeout,
            )
            c1, r1 = meter.sample(), meter.sample_root()
            await meter.settle()
            pushed = {k: v - pushed0.get(k, 0) for k, v in (await self.ads_stats()).items()}
            done = sum(o["done"] for o in outs)
            if any(pushed.values()):
                each = ", ".join(f"{k} {v / max(done, 1):.1f}" for k, v in pushed.items() if v)
                f.notes.append(f"issuance at {c}: ADS responses per attestation: {each}")
            errs = sum(o["n_errors"] for o in outs)
            if errs:
                f.notes.append(f"issuance at {c}: {errs} errors, e.g. {outs[0]['errors'][:1]}")
            asked = sum(o.get("challenges", 0) for o in outs)
            f.notes.append(
                f"issuance at {c}: {asked} challenge requests for {done} attestations (the"
                " others bound the next_nonce of the workload's last answer, as the agent does)"
            )
            limited = sum(o.get("rate_limited", 0) for o in outs)
            secs = max(o["seconds"] for o in outs)
            if limited:
                f.notes.append(
                    f"issuance at {c}: {limited} answers 429 (rate-limited workloads left the "
                    f"rotation); measured over {secs:.1f} s"
                )
            f.set(f"rate_{c}", done / secs if done else 0.0)
            per = CpuMeter.delta(c0, c1) / done if done else math.inf
            f.set(f"cpu_per_attest_{c}_ms", per * 1e3)
            if done:
                root = CpuMeter.delta(r0, r1) / done
                f.notes.append(
                    f"issuance at {c}: server CPU per attestation {per * 1e3:.2f} ms: the "
                    f"control plane's process {root * 1e3:.2f} ms, its worker processes "
                    f"{(per - root) * 1e3:.2f} ms"
                )
            ratios.append(per / crypto_s)
            if probe is not None:
                lat = await probe
                f.set("healthz_p99_ms", percentile(lat, 99) * 1e3 if lat else None)
                worst = sorted(sorted(self.healthz_slow, key=lambda x: -x[1])[:12])
                f.notes.append(
                    f"issuance at {c}: /healthz p50 {percentile(lat, 50) * 1e3:.1f} ms, "
                    f"{len(self.healthz_slow)} of {len(lat)} over 20 ms; the slowest (s into "
                    "the load: ms): " + " ".join(f"{at:.2f}s:{ms:.0f}" for at, ms in worst)
                )
            client = sum(o.get("client_cpu", 0.0) for o in outs) / secs
            f.notes.append(f"issuance at {c} clients: client processes used {client:.2f} cores")
            log(
                f"N={self.n}: {c} clients: {done / secs:.0f}/s, {per * 1e3:.2f} ms CPU each "
                f"(clients: {client:.2f} cores)"
            )
        f.set("cpu_per_attest_ratio", max(ratios))

    async def ads_stats(self) -> dict[str, int]:
        """Responses the streams have received so far, by resource type (summed)."""
        total: dict[str, int] = {}
        for out in await asyncio.gather(*(w.call({"cmd": "stats"}) for w in self.ads)):
            for k, v in out.items():
                total[k] = total.get(k, 0) + int(v)
        return total

    async def probe_healthz(
        self, session: aiohttp.ClientSession, start_at: float, seconds: float
    ) -> list[float]:
        url = f"http://127.0.0.1:{self.cp.ports['ops']}/healthz"
        await asyncio.sleep(max(0.0, start_at - time.monotonic()) + 0.2)
        end = start_at + seconds - 0.1
        out = []
        self.healthz_slow: list[tuple[float, float]] = []  # (s into the load, ms) over 20 ms
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                    await r.read()
                out.append(time.monotonic() - t0)
            except (aiohttp.ClientError, TimeoutError):
                out.append(10.0)
            if out[-1] > 0.02:
                self.healthz_slow.append((t0 - start_at, out[-1] * 1e3))
            await asyncio.sleep(0.01)
        return out

    def shutdown(self) -> None:
        self.cp.stop()


def percentile(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


async def _phase(f: Figures, name: str, step: Awaitable[Any]) -> Any:
    """One phase; an error in it (e.g. the server answers 500) is noted, not fatal: the figures
    it did not produce are reported as missing and the other phases still run."""
    try:
        return await step
    except (RuntimeError, OSError, KeyError, ValueError, TimeoutError, aiohttp.ClientError) as exc:
        f.notes.append(f"{name}: ERROR {exc!r}"[:400])
        log(f"{name}: ERROR {exc!r}"[:400])
        return None


async def run_mesh(
    n: int, s: Settings, sim_key: Path, sim_pub: Path, crypto_s: float, first_only: bool
) -> Figures:
    f = Figures()
    run = MeshRun(n, s, sim_key, sim_pub, envoys=0 if first_only else s.envoys)
    try:
        async with aiohttp.ClientSession() as session:
            if not await _phase(f, "setup", run.setup(f)):
                return f
            prof = Profiler(
                s.py_spy, phases=s.py_spy_phases, gil=s.py_spy_gil, native=s.py_spy_native
            )
            async with prof.phase(run.cp.pid, f"n{n}-streams"):
                if not await _phase(f, "streams", run.open_streams(f, run.lean)):
                    return f
            if first_only:
                async with prof.phase(run.cp.pid, f"n{n}-first-attestation"):
                    await _phase(f, "first attestation", run.first_attestations(FIRST_100, f))
                return f
            await _phase(f, "envoys", run.start_envoys(f))
            async with prof.phase(run.cp.pid, f"n{n}-quarantine"):
                await _phase(f, "quarantine", run.quarantine(f, session))
            await _phase(f, "envoy rounds", run.envoy_rounds(f, session))
            async with prof.phase(run.cp.pid, f"n{n}-first-attestation"):
                await _phase(f, "first attestation", run.first_attestations(FIRST_N, f))
            async with prof.phase(run.cp.pid, f"n{n}-issuance"):
                await _phase(f, "issuance", run.issuance(f, session, crypto_s))
    finally:
        await run.close_workers()
        run.shutdown()
    for key in FIGURE_KEYS:
        f.values.setdefault(key, "ERROR" if any("ERROR" in x for x in f.notes) else "-")
    return f


async def quarantine_floor(n: int, s: Settings, f: Figures) -> None:
    """The lower bound under the quarantine's CPU and time to the last ACK, measured now (the
    control plane stopped): ``scale_floor.push_floor`` with one connection per caller."""
    callers = sum(w.caller for w in scenario(n, s.newcomers, s.seed)[0])
    cpu, wall = await asyncio.to_thread(push_floor, callers)
    log(f"N={n}: floor of a write + an ACK read per caller ({callers}): {cpu:.3f} s CPU")
    f.set("quarantine_floor_cpu_s", cpu)
    f.set("quarantine_floor_wall_s", wall)
    ours = f.values.get("quarantine_cpu_s")
    if isinstance(ours, float) and cpu > 0:
        f.set("quarantine_floor_ratio", ours / cpu)


def hot_path(log_file: Path) -> str:
    """What the control plane's last start-up line says of its ADS hot path (``make native``:
    compiled, or why the sources ran)."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return "unknown (no control-plane log)"
    said = [line.split("ADS hot path: ", 1)[1] for line in lines if "ADS hot path: " in line]
    return said[-1] if said else "unknown (not in the control-plane log)"


async def run_bao(s: Settings, f: Figures, name: str = "openbao") -> None:
    """OpenBao's issuance at 8 and 64 clients (a fresh server in ``s.workdir / name``)."""
    bao = await start_bao(s.workdir / name, free_port(), free_port())
    workers: list[Worker] = []
    try:
        for c, warm_up in ((8, True), (8, False), (64, False)):  # a first unmeasured second
            procs = min(c, 4)
            while len(workers) < procs:
                workers.append(
                    await Worker.start(
                        "benchmarks.scale_attest",
                        "-",
                        str(bao.ca),
                        bao.url,
                        log=s.workdir / name / "worker.log",
                    )
                )
            start_at = time.monotonic() + 0.5
            parts = [c // procs + (1 if i < c % procs else 0) for i in range(procs)]
            meter = bao.meter()
            c0 = meter.sample()
            outs = await asyncio.gather(
                *(
                    w.call(
                        {
                            "cmd": "load",
                            "kind": "bao",
                            "items": [{}],
                            "concurrency": parts[i],
                            "duration": 1.0 if warm_up else s.load_s,
                            "start_at": start_at,
                            "bao_url": bao.sign_url,
                            "bao_token": bao.token,
                        }
                    )
                    for i, w in enumerate(workers[:procs])
                )
            )
            c1 = meter.sample()
            if warm_up:
                continue
            done = sum(o["done"] for o in outs)
            errs = sum(o["n_errors"] for o in outs)
            if errs:
                f.notes.append(f"OpenBao at {c}: {errs} errors, e.g. {outs[0]['errors'][:1]}")
            rate = done / max(o["seconds"] for o in outs)
            f.set(f"bao_rate_{c}", rate)
            cpu = CpuMeter.delta(c0, c1) / done * 1e3 if done else math.inf
            client = sum(o.get("client_cpu", 0.0) for o in outs) / max(o["seconds"] for o in outs)
            f.notes.append(
                f"OpenBao at {c} clients: {rate:.0f}/s, {cpu:.2f} ms server CPU each, "
                f"client processes used {client:.2f} cores"
            )
            log(f"OpenBao {c} clients: {rate:.0f}/s, {cpu:.2f} ms CPU each")
    finally:
        for w in workers:
            await w.close()
        bao.stop()


# -- report ---------------------------------------------------------------------------------------


def _fmt(v: float | str | None) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if v == 0 or abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) < 1 else f"{v:.2f}"


def report(results: dict[int, Figures], walls: dict[int, float]) -> str:
    ns = sorted(results)
    head = f"{'figure':<58}" + "".join(f"{'N=' + format(n, ','):>12}" for n in ns)
    lines = [head + f"  {'target':<12}" + "".join(f"{'N=' + str(n):>8}" for n in ns)]
    for key, label, unit, target in FIGURES:
        vals = [results[n].values.get(key) for n in ns]
        row = f"{label + ' [' + unit + ']':<58}" + "".join(f"{_fmt(v):>12}" for v in vals)
        if target is None:
            lines.append(row)
            continue
        verdicts = []
        for v in vals:
            if isinstance(v, float | int):
                verdicts.append("PASS" if target.check(float(v)) else "FAIL")
            else:
                verdicts.append(str(v or "-")[:7])
        lines.append(
            row
            + f"  {target.op} {_fmt(target.limit) + ' ' + target.unit:<9}"
            + "".join(f"{x:>8}" for x in verdicts)
        )
    lines.append("wall time per N: " + ", ".join(f"N={n}: {walls[n]:.0f} s" for n in ns))
    for n in ns:
        for note in results[n].notes:
            lines.append(f"  N={n}: {note}")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_scale", description=__doc__.split("\n")[0]
    )
    p.add_argument("--n", default="1000,10000", help="mesh sizes, comma-separated")
    p.add_argument("--quick", action="store_true", help="smoke run: N=200, short phases")
    p.add_argument(
        "--controlplane-cmd",
        default=str(Path(sys.executable).parent / "attestmesh"),
        help="the executable under test (shell words), run as CMD controlplane ...",
    )
    p.add_argument(
        "--controlplane-flag",
        action="append",
        default=[],
        help="an extra flag for the control plane (repeatable)",
    )
    p.add_argument(
        "--xds-protocol",
        choices=("delta", "sotw"),
        default="delta",
        help="ADS variant the streams use (delta: what the bootstrap uses)",
    )
    p.add_argument("--load-seconds", type=float, help="duration of each issuance level")
    p.add_argument("--ads-workers", type=int, default=4, help="client processes holding streams")
    p.add_argument(
        "--newcomers",
        type=int,
        help="first attestations measured (median; default 9, 2 with --quick)",
    )
    p.add_argument("--setup-timeout", type=float, default=3600, help="cap on attesting the mesh")
    p.add_argument("--phase-timeout", type=float, default=600, help="cap on start-up, streams")
    p.add_argument("--quarantine-timeout", type=float, default=300)
    p.add_argument("--first-attest-timeout", type=float, default=300)
    p.add_argument(
        "--cert-per-service-account",
        dest="cert_per_workload",
        action="store_false",
        help="streams of one service account share one certificate (for control planes that "
        "authorize xDS per service account; this one requires each node's own live "
        "certificate, so by default each stream presents its own workload's)",
    )
    p.add_argument("--cert-per-workload", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--envoys",
        type=int,
        default=10,
        help="real Envoys among the streams: the victim and callers of its service (0: none)",
    )
    p.add_argument("--envoy-rounds", type=int, default=3, help="quarantines they measure")
    p.add_argument(
        "--envoy-interval-ms", type=float, default=5.0, help="between a caller Envoy's requests"
    )
    p.add_argument(
        "--py-spy",
        type=Path,
        help="profile the control plane (py-spy record, folded stacks) during the streams, "
        "quarantine, first-attestation and issuance phases into this directory (slows what "
        "it samples)",
    )
    p.add_argument(
        "--py-spy-phases",
        help="comma-separated phases --py-spy profiles: streams, quarantine, "
        "first-attestation, issuance (default: all four)",
    )
    p.add_argument(
        "--py-spy-gil",
        action="store_true",
        help="sample only the thread holding the GIL (py-spy --gil): without it, a thread "
        "waiting for the GIL inside a C call counts as busy",
    )
    p.add_argument(
        "--py-spy-native",
        action="store_true",
        help="with C frames (py-spy --native): the compiled ADS path by function, OpenSSL, "
        "the collector; the profiled phases run several times slower",
    )
    p.add_argument("--no-openbao", action="store_true", help="skip OpenBao (ratios are missing)")
    p.add_argument("--workdir", type=Path, help="keep state and logs here (default: temp)")
    p.add_argument("--json", type=Path, help="write every figure here")
    return p.parse_args(argv)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    raise_nofile()
    sizes = [200] if args.quick else [int(x) for x in args.n.split(",") if x.strip()]
    load_s = args.load_seconds or (2.0 if args.quick else 6.0)
    # nine: a median of three was at the mercy of one background fan-out (the coalesced CRL
    # after the quarantine) landing in a window
    newcomers = args.newcomers or (2 if args.quick else 9)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-scale-"))
        )
        workdir.mkdir(parents=True, exist_ok=True)
        s = Settings(
            command=shlex.split(args.controlplane_cmd),
            extra_flags=list(args.controlplane_flag),
            workdir=workdir,
            seed=os.urandom(8).hex(),
            newcomers=newcomers,
            load_s=load_s,
            ads_workers=args.ads_workers,
            protocol=args.xds_protocol,
            setup_timeout=args.setup_timeout,
            phase_timeout=args.phase_timeout,
            quarantine_timeout=args.quarantine_timeout,
            first_attest_timeout=args.first_attest_timeout,
            attest_concurrency=4,
            cert_per_workload=args.cert_per_workload,
            envoys=args.envoys,
            envoy_rounds=max(1, args.envoy_rounds),
            envoy_interval_s=args.envoy_interval_ms / 1e3,
            py_spy=args.py_spy,
            py_spy_phases=frozenset(args.py_spy_phases.split(",")) if args.py_spy_phases else None,
            py_spy_gil=args.py_spy_gil,
            py_spy_native=args.py_spy_native,
        )
        sim_key, sim_pub = write_sim_platform(workdir)
        print(
            f"bench_scale: N={sizes}, {os.cpu_count()} cores, "
            f"control plane: {args.controlplane_cmd}, ADS {args.xds_protocol}, workdir {workdir}",
            flush=True,
        )
        crypto_s = crypto_lower_bound(2000)
        log(f"unavoidable crypto per attestation: {crypto_s * 1e3:.3f} ms")
        t0 = time.monotonic()
        base = await run_mesh(100, s, sim_key, sim_pub, crypto_s, first_only=True)
        log(
            f"N=100 baseline done in {time.monotonic() - t0:.0f} s: first attestation "
            f"{_fmt(base.values.get('first_attest_cpu_100_ms'))} ms"
        )
        results: dict[int, Figures] = {}
        walls: dict[int, float] = {}
        for n in sizes:
            t0 = time.monotonic()
            f = await run_mesh(n, s, sim_key, sim_pub, crypto_s, first_only=False)
            walls[n] = time.monotonic() - t0
            # OpenBao right after this mesh's issuance (its last phase): the shared machine's
            # speed drifts by a quarter within minutes, so the peer is measured beside ours
            bao = Figures()
            if not args.no_openbao:
                await _phase(bao, "OpenBao", run_bao(s, bao, f"openbao-n{n}"))
            await _phase(f, "quarantine floor", quarantine_floor(n, s, f))
            f.set("crypto_ms", crypto_s * 1e3)
            f.values[FIRST_100] = base.values.get(FIRST_100, "-")
            a, b = f.values.get(FIRST_N), f.values[FIRST_100]
            if isinstance(a, float) and isinstance(b, float) and b > 0:
                f.set("first_attest_ratio", a / b)
            else:
                f.values["first_attest_ratio"] = a if isinstance(a, str) else str(b)
            for c in (8, 64):
                ours, theirs = f.values.get(f"rate_{c}"), bao.values.get(f"bao_rate_{c}")
                f.values[f"bao_rate_{c}"] = "skipped" if theirs is None else theirs
                if isinstance(ours, float) and isinstance(theirs, float) and theirs > 0:
                    f.set(f"bao_ratio_{c}", ours / theirs)
                else:
                    f.values[f"bao_ratio_{c}"] = ours if isinstance(ours, str) else "-"
            f.notes += bao.notes
            for k in FIGURE_KEYS:
                f.values.setdefault(k, "-")
            results[n] = f
            log(f"N={n} done in {walls[n]:.0f} s")
        print()
        print(report(results, walls), flush=True)
        out = {
            str(n): {"figures": results[n].values, "notes": results[n].notes, "wall_s": walls[n]}
            for n in sizes
        }
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return out


def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(amain(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
