"""bench_scale's issuance phase alone (issue 7), for iterating on the attestation API: a real
``attestmesh controlplane`` with N attested workloads and N mTLS ADS streams, then 1 / 8 / 64
concurrent clients attesting through the HTTPS API (bench_scale phases 1, 2 and 5; no Envoys,
no quarantines; with ``--openbao``, OpenBao's pki/sign at 8 and 64 clients after it, as
bench_scale runs it). Prints the rates, server CPU per attestation and its ratio to the
unavoidable crypto measured in this run, and /healthz p99 under the 64-client load.

Run: ``python -m benchmarks.bench_issuance [--n 1000] [--load-seconds 6] [--no-streams]
[--openbao]``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from benchmarks.bench_scale import (
    Figures,
    MeshRun,
    Settings,
    crypto_lower_bound,
    run_bao,
    write_sim_platform,
)
from benchmarks.scale_ads import raise_nofile
from benchmarks.scale_proc import CpuMeter


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the live threads of ``pid``, summed by thread name (digits dropped)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip().rstrip("0123456789_")
            ns = int((task / "schedstat").read_text().split()[0])
            out[name] = out.get(name, 0.0) + ns / 1e9
    return out


async def amain(args: argparse.Namespace) -> Figures:
    raise_nofile()
    with tempfile.TemporaryDirectory(prefix="bench-issuance-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        s = Settings(
            command=shlex.split(args.controlplane_cmd),
            extra_flags=list(args.controlplane_flag),
            workdir=workdir,
            seed=os.urandom(8).hex(),
            newcomers=1,
            load_s=args.load_seconds,
            ads_workers=4,
            protocol="delta",
            setup_timeout=3600,
            phase_timeout=600,
            quarantine_timeout=300,
            first_attest_timeout=300,
            attest_concurrency=4,
            envoys=0,
        )
        sim_key, sim_pub = write_sim_platform(workdir)
        crypto_s = crypto_lower_bound(2000)
        f = Figures()
        run = MeshRun(args.n, s, sim_key, sim_pub, envoys=0)
        try:
            async with aiohttp.ClientSession() as session:
                if not await run.setup(f):
                    raise SystemExit(f"setup failed: {f.notes}")
                if not args.no_streams and not await run.open_streams(f, run.lean):
                    raise SystemExit(f"streams failed: {f.notes}")
                meter = run.cp.meter()
                await meter.settle()
                c0 = meter.sample()
                await asyncio.sleep(3.0)
                idle = CpuMeter.delta(c0, meter.sample()) / 3.0
                f.notes.append(f"idle before the load: {idle:.3f} cores")
                spy = None
                if args.py_spy is not None:  # folded stacks of the control plane, per thread
                    spy = await asyncio.create_subprocess_exec(
                        str(Path(sys.executable).parent / "py-spy"),
                        *("record", "--format", "raw", "--threads", "--gil", "--nonblocking"),
                        *("--pid", str(run.cp.pid), "--output", str(args.py_spy)),
                        stdout=asyncio.subprocess.DEVNULL,
                        stderr=asyncio.subprocess.DEVNULL,
                    )
                t0 = threads_cpu(run.cp.pid)
                await run.issuance(f, session, crypto_s)
                t1 = threads_cpu(run.cp.pid)
                per = {k: t1[k] - t0.get(k, 0.0) for k in t1}
                f.notes.append(
                    "issuance phase CPU by thread: "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(per.items()) if v > 0.005)
                )
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    await spy.wait()
        finally:
            await run.close_workers()
            run.shutdown()
        if args.openbao:  # after ours has stopped: the same machine, the same client processes
            await run_bao(s, f)
        v = f.values
        print(
            f"N={args.n} crypto {crypto_s * 1e3:.3f} ms | rate 1/8/64: "
            f"{v['rate_1']:.0f} / {v['rate_8']:.0f} / {v['rate_64']:.0f} /s | CPU per "
            f"attestation 1/8/64: {v['cpu_per_attest_1_ms']:.2f} / {v['cpu_per_attest_8_ms']:.2f}"
            f" / {v['cpu_per_attest_64_ms']:.2f} ms (ratio {v['cpu_per_attest_ratio']:.1f}x) | "
            f"/healthz p99 {v['healthz_p99_ms']} ms",
            flush=True,
        )
        if args.openbao and "bao_rate_8" in v and "bao_rate_64" in v:
            print(
                f"  OpenBao pki/sign 8/64: {v['bao_rate_8']:.0f} / {v['bao_rate_64']:.0f} /s; ours"
                f" / OpenBao: {v['rate_8'] / v['bao_rate_8']:.2f}x / "
                f"{v['rate_64'] / v['bao_rate_64']:.2f}x"
            )
        for note in f.notes:
            print(f"  {note}")
        return f


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_issuance")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--load-seconds", type=float, default=6.0)
    p.add_argument("--no-streams", action="store_true", help="no ADS streams connected")
    p.add_argument("--controlplane-cmd", default=str(Path(sys.executable).parent / "attestmesh"))
    p.add_argument("--controlplane-flag", action="append", default=[])
    p.add_argument("--workdir", type=Path)
    p.add_argument("--py-spy", type=Path, help="profile the issuance phase into this file")
    p.add_argument("--openbao", action="store_true", help="then OpenBao pki/sign, as bench_scale")
    asyncio.run(amain(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
