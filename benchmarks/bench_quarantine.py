"""Focused driver for bench_scale's quarantine figure (phase 3): one real control plane with N
attested workloads and N mTLS ADS streams (bench_scale's scenario, no real Envoys), then the
members of ``target`` (w1, w3, w5, w7) quarantined in turn through the ops API, each released
and attested again after its round (unmeasured), so that every round quarantines one member of
four, as bench_scale does; each round measured as bench_scale measures it: control-plane CPU
until every caller stream (N/2) has ACKed a response without that member's endpoint. Prints
each round and the median.

(Until 2026-12-07 the members stayed quarantined until the fifth round: the fourth round and
every round after it quarantined the service's last attested member, a dearer case: the
callers' cluster then pins no identity any more, so every caller's cluster changes too and is
patched into its snapshot (at N = 10,000, 0.33-0.40 s against 0.27-0.29 s for the other
rounds). The median of the default 8 rounds was that case's.)

Run: ``python -m benchmarks.bench_quarantine --n 2000`` (``--py-spy DIR``: the last round is
profiled with py-spy into ``DIR/quarantine-<round>-<victim>.txt``, folded stacks, and left out of
the median; ``--py-spy-rounds K``: the last K rounds; ``--py-spy-native``: with C frames, the
compiled ADS path by function; ``--controlplane-cmd``: the executable under test, as in
bench_scale).

``--in-process``: no process, no streams: the publisher's part of one quarantine, timed in
this process. bench_scale's mesh of N workloads (N/2 callers of ``target``, whose members are
w1, w3, w5, w7) is published, every node's snapshot is held (as its stream holds it), and w1
is quarantined (with a new CRL) and released and attested again in turn: each ``publish``
wakes the N/2 held callers (their endpoints and the CRL are read through layers: nothing of
theirs is patched), then the coalesced CRL fan-out wakes every other held node. Prints the
CPU time of both (median, and the minimum: the machine is shared), per quarantine and per
node woken.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp

from benchmarks.bench_scale import (
    CALLER_SAS,
    TARGET_MEMBERS,
    Figures,
    MeshRun,
    Settings,
    log,
    scenario,
    write_sim_platform,
)
from benchmarks.scale_ads import raise_nofile
from benchmarks.scale_proc import CLK_TCK, Profiler
from xds.state import MeshState


def user_sys(pid: int) -> tuple[float, float]:
    """utime, stime of the process (s, 1/CLK_TCK steps): how much of it is the kernel's."""
    text = Path(f"/proc/{pid}/stat").read_text()
    parts = text[text.rindex(")") + 2 :].split()
    return int(parts[11]) / CLK_TCK, int(parts[12]) / CLK_TCK


async def rounds(
    run: MeshRun,
    session: aiohttp.ClientSession,
    py_spy: Path | None,
    count: int,
    profiled_rounds: int = 1,
    rate: int = 500,
    native: bool = False,
) -> list[float]:
    members = [w for w in run.mesh if w.name in {f"w{2 * k + 1}" for k in range(TARGET_MEMBERS)}]
    cpus: list[float] = []
    for k in range(count):
        victim = members[k % len(members)]
        profiled = py_spy is not None and k >= count - profiled_rounds
        # (the coalesced CRL fan-out to the streams that deny the victim anyway comes
        # serve.TRUST_FANOUT_DELAY after the first quarantine: in one round's window at most,
        # which the median absorbs)
        mark = {"cmd": "mark", "victim": ["127.0.0.1", victim.inbound_port]}
        await asyncio.gather(*(w.call(mark) for w in run.ads))
        meter = run.cp.meter()
        await meter.settle()
        prof = Profiler(py_spy if profiled else None, rate=rate, native=native)
        async with prof.phase(run.cp.pid, f"quarantine-{k}-{victim.name}"):
            cpu0, us0 = meter.sample(), user_sys(run.cp.pid)
            t0 = time.monotonic()
            await run.cp.ops(
                session, "POST", f"/v1/admin/workloads/{victim.name}/quarantine", {"reason": "b"}
            )
            t_ret = time.monotonic()
            outs = await asyncio.gather(
                *(w.call({"cmd": "wait_taken", "timeout": 120}) for w in run.ads)
            )
            cpu1, us1 = meter.sample(), user_sys(run.cp.pid)
        taken = sum(o["taken"] for o in outs)
        callers = sum(o["callers"] for o in outs)
        touched = sum(o["noncallers_touched"] for o in outs)
        last = max((o["last"] for o in outs if o["last"] is not None), default=t_ret)
        cpu = meter.delta(cpu0, cpu1)
        log(
            f"quarantine {victim.name}: CPU {cpu:.3f} s "
            f"({1e6 * cpu / max(1, callers):.0f} us per caller; user {us1[0] - us0[0]:.2f}, "
            f"sys {us1[1] - us0[1]:.2f}), ops call {t_ret - t0:.3f} s, "
            f"-> last ACK {last - t_ret:.3f} s, taken {taken}/{callers}, "
            f"{touched} non-callers touched{' (profiled)' if profiled else ''}"
        )
        if not profiled:
            cpus.append(cpu)
        if k < count - 1:  # released and attested again: its endpoint is back for the next
            await run.cp.ops(session, "POST", f"/v1/admin/workloads/{victim.name}/release", {})
            ok = await run.attest([{"workload": victim.name, "token": victim.token}], 1, 1, 60)
            if ok != 1:
                raise SystemExit(f"{victim.name} did not attest again")
    return cpus


async def amain(args: argparse.Namespace) -> None:
    raise_nofile()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-quarantine-"))
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    s = Settings(
        command=shlex.split(args.controlplane_cmd),
        extra_flags=[],
        workdir=workdir,
        seed=os.urandom(8).hex(),
        newcomers=0,
        load_s=1.0,
        ads_workers=4,
        protocol=args.xds_protocol,
        setup_timeout=3600,
        phase_timeout=600,
        quarantine_timeout=120,
        first_attest_timeout=60,
        attest_concurrency=4,
        envoys=0,
    )
    sim_key, sim_pub = write_sim_platform(workdir)
    run = MeshRun(args.n, s, sim_key, sim_pub, envoys=0)
    f = Figures()
    try:
        async with aiohttp.ClientSession() as session:
            if not await run.setup(f) or not await run.open_streams(f, run.lean):
                raise SystemExit(f"setup failed: {f.notes}")
            log(f"N={args.n}: {f.values}")
            cpus = await rounds(
                run,
                session,
                args.py_spy,
                args.rounds,
                args.py_spy_rounds,
                args.py_spy_rate,
                args.py_spy_native,
            )
    finally:
        await run.close_workers()
        run.shutdown()
    if not cpus:
        return
    print(
        f"N={args.n} quarantine CPU s: median {statistics.median(cpus):.3f} "
        f"({1e6 * statistics.median(cpus) / (args.n // 2):.0f} us per caller) "
        f"of {[round(c, 3) for c in cpus]} (workdir {workdir})",
        flush=True,
    )


def attested_mesh(
    n: int, seed: str, now: datetime
) -> tuple[MeshState, list[str], list[str], Callable[[MeshState, str], MeshState]]:
    """bench_scale's mesh of ``n`` workloads as a mesh state, every one attested: (state, the
    workload names, the callers of ``target``, ``attest(state, name)`` for another
    attestation)."""
    from xds.state import (
        AttestationRecord,
        Endpoint,
        IssuedCert,
        Registration,
        record_attestation,
        register_all,
    )

    mesh, _ = scenario(n, 0, seed)
    regs = [
        Registration(
            w.name,
            "default",
            w.sa,
            w.sa,
            Endpoint("127.0.0.1", w.inbound_port),
            40000 + (w.inbound_port - 20000) % 25000,
            {s: w.outbound_port + i for i, s in enumerate(w.outbound)},
        )
        for w in mesh
    ]
    state, _, _ = register_all(MeshState("bench.test"), regs, now)
    serial = 0

    def attest(state: MeshState, name: str) -> MeshState:
        nonlocal serial
        serial += 1
        later = now + timedelta(hours=1)
        record = AttestationRecord("sim", {}, "bench", "0", now)
        state, _ = record_attestation(state, name, record, IssuedCert(serial, later), later, now)
        return state

    for r in regs:
        state = attest(state, r.name)
    return state, [w.name for w in mesh], [w.name for w in mesh if w.caller], attest


def in_process(n: int, count: int) -> None:
    """The publisher's part of a quarantine (see the module's docstring)."""
    from dataclasses import replace

    from xds.build import TrustMaterial
    from xds.cache import SnapshotCache
    from xds.meshpolicy import MeshPolicy, Rule, Source
    from xds.publisher import XdsPublisher
    from xds.state import Trigger, quarantine, release

    now = datetime(2026, 1, 1, tzinfo=UTC)
    state, names, callers, attest = attested_mesh(n, "in-process", now)
    sources = tuple(Source("default", f"client-{k}") for k in range(CALLER_SAS))
    policies = [MeshPolicy("to-target", "default", "target", (Rule(sources, None, ()),))]
    trust = TrustMaterial(b"bundle", b"crl-0")
    deferred: list[Callable[[], None]] = []
    cache = SnapshotCache()
    pub = XdsPublisher(cache, defer=deferred.append)  # no loop runs: every chunk at once
    pub.publish(state, policies, trust)
    for name in names:  # every node's snapshot held, as its stream holds it
        cache.get(name)
    times: list[float] = []
    fanouts: list[float] = []
    for k in range(count):
        quarantined, _ = quarantine(state, "w1", Trigger.OPERATOR, "bench", now)
        crl = replace(trust, crl_pem=f"crl-{2 * k + 1}".encode())
        t0 = time.thread_time()  # CPU time: the machine is shared, wall time is noisier
        pub.publish(quarantined, policies, crl, {"w1"})
        times.append(time.thread_time() - t0)
        if pub.woken_nodes != len(callers):
            raise SystemExit(f"woke {pub.woken_nodes} of {len(callers)} callers")
        t0 = time.thread_time()
        for fanout in deferred:  # the coalesced CRL fan-out, a moment later
            fanout()
        fanouts.append(time.thread_time() - t0)
        deferred.clear()
        # every node but w1 (rebuilt, with the new CRL) and its callers (which took it with
        # the endpoint change)
        others = n - 1 - len(callers)
        if pub.fanned_out != others:
            raise SystemExit(f"CRL fanned out to {pub.fanned_out} of {others} nodes")
        released, _ = release(quarantined, "w1", now)
        state = attest(released, "w1")
        trust = replace(trust, crl_pem=f"crl-{2 * k + 2}".encode())
        pub.publish(state, policies, trust, {"w1"})
        for fanout in deferred:
            fanout()
        deferred.clear()
    med, fan = statistics.median(times), statistics.median(fanouts)
    print(
        f"N={n} in process: publish of one quarantine, {len(callers)} held callers, CPU: "
        f"median {1e3 * med:.1f} ms ({1e6 * med / len(callers):.2f} us per caller; "
        f"min {1e6 * min(times) / len(callers):.2f}) of {count}: "
        f"{[round(1e3 * t, 1) for t in times]}; its CRL fan-out to {others} other held nodes: "
        f"median {1e3 * fan:.1f} ms ({1e6 * fan / others:.2f} us per node; "
        f"min {1e6 * min(fanouts) / others:.2f})",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_quarantine")
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--xds-protocol", choices=("delta", "sotw"), default="delta")
    p.add_argument("--controlplane-cmd", default=str(Path(sys.executable).parent / "attestmesh"))
    p.add_argument("--rounds", type=int, default=8, help="quarantines measured")
    p.add_argument("--py-spy", type=Path, help="profile the last round into this directory")
    p.add_argument("--py-spy-rounds", type=int, default=1, help="the last K rounds profiled")
    p.add_argument("--py-spy-rate", type=int, default=500, help="samples per second")
    p.add_argument(
        "--py-spy-native", action="store_true", help="with C frames (py-spy --native; slower)"
    )
    p.add_argument("--workdir", type=Path)
    p.add_argument("--in-process", action="store_true", help="the publisher's part alone")
    args = p.parse_args(argv)
    if args.in_process:
        in_process(args.n, args.rounds)
    else:
        asyncio.run(amain(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
