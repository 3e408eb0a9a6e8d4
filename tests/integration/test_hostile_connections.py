"""Unauthenticated exhaustion against a real ``attestmesh controlplane`` process (issue 8,
item 2): 2,000 hostile connections of each kind are held while legitimate attestations of
three distinct workloads all succeed (the best of them in under a second) and the process
stays under 300 MB; then the listener's timeouts close every one of them; excess
connections from one source are closed at accept."""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import hashlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import yaml

from attestmesh.demo import free_port, join_token
from benchmarks.bench_connections import (
    HOSTILE_KINDS,
    ControlPlaneProcess,
    Held,
    close_all,
    control_plane,
    open_hostile,
    raise_fd_limit,
    rss_kb,
)

pytestmark = pytest.mark.integration

N = 2000
TIMEOUT = 12.0  # every timeout of the process under test (production defaults are 10-60 s)
SLACK = 4.0
# no hostile connection is closed sooner: the client notes a connection as opened after its
# TLS handshake, the server starts its timer at accept, and under load that gap reached 1.3 s
MIN_LIFE = TIMEOUT * 0.75
SOURCES = tuple(f"127.0.0.{i}" for i in range(2, 10))  # 250 each: under the per-source cap
FLAGS = [
    "--handshake-timeout", str(TIMEOUT), "--header-timeout", str(TIMEOUT),
    "--body-timeout", str(TIMEOUT), "--idle-timeout", str(TIMEOUT),
]  # fmt: skip


# Distinct workloads, one attestation of each per measurement: the control plane allows a
# workload 8 attestations at once (then one a minute), so measuring one workload several
# times per kind would be answered too_many_attestations. Each probe attests 1 + 5 times.
PROBES = ("probe0", "probe1", "probe2")
ATTEST_WITHIN = 10.0  # a starved API fails the test here instead of hanging it


class ProbedControlPlane(ControlPlaneProcess):
    """The demo's control plane with PROBES registered too (same policy, own join tokens)."""

    def _spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        regs_file, policy_file = self.s.registrations_file, self.s.policy_file
        assert regs_file is not None and policy_file is not None  # write_config's local mode
        regs = yaml.safe_load(regs_file.read_text())
        policy = yaml.safe_load(policy_file.read_text())
        for name in PROBES:
            self.tokens[name] = join_token(name)
            regs["workloads"].append(
                {
                    "name": name,
                    "namespace": "default",
                    "serviceAccount": name,
                    "inbound": f"127.0.0.1:{free_port()}",
                    "appPort": free_port(),
                    "outbound": {},
                    "tokenSha256": hashlib.sha256(self.tokens[name].encode()).hexdigest(),
                }
            )
            policy["spec"]["selector"]["serviceAccounts"].append(name)
        regs_file.write_text(yaml.safe_dump(regs))
        policy_file.write_text(yaml.safe_dump(policy))
        return super()._spawn(args)


@contextlib.asynccontextmanager
async def probed_control_plane(flags: Sequence[str]) -> AsyncIterator[ControlPlaneProcess]:
    with tempfile.TemporaryDirectory(prefix="hostile-conn-") as tmp:
        cp = ProbedControlPlane(Path(tmp), flags)
        try:
            await cp.start()
            yield cp
        finally:
            cp.stop()


async def attest_seconds(cp: ControlPlaneProcess, name: str = "frontend") -> float:
    """One attestation of ``name``; it must succeed (right identity) within ATTEST_WITHIN."""
    t0 = time.perf_counter()
    async with asyncio.timeout(ATTEST_WITHIN):
        cert = await cp.attest(name, source="127.0.0.1")
    assert cert.spiffe_id.endswith(f"/sa/{name}")
    return time.perf_counter() - t0


async def attest_probes(cp: ControlPlaneProcess) -> list[float]:
    """Each of PROBES attested once, one after another; every one must succeed."""
    return [await attest_seconds(cp, name) for name in PROBES]


def lasted_s(h: Held) -> float:
    assert h.closed_at is not None
    return h.closed_at - h.opened_at


async def all_closed(held: Sequence[Held], within: float) -> None:
    async with asyncio.timeout(within):
        while any(h.closed_at is None for h in held):
            await asyncio.sleep(0.2)


async def test_hostile_connections_are_held_cheaply_and_timed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raise_fd_limit(3 * N + 1000)
    # this test process is the client: 16 KiB TLS read buffers let it open 2,000 quickly
    monkeypatch.setattr(asyncio.sslproto.SSLProtocol, "max_size", 16 * 1024)
    async with probed_control_plane(FLAGS) as cp:
        await attest_probes(cp)  # warm: each probe has attested once before any load
        report = [f"baseline {rss_kb(cp.pid) / 1024:.0f} MB"]
        for kind in HOSTILE_KINDS:
            t0 = time.monotonic()
            held = await open_hostile(kind, cp, N, SOURCES)
            opening = time.monotonic() - t0
            try:
                await asyncio.sleep(0.5)
                alive = sum(1 for h in held if h.closed_at is None)
                rss = rss_kb(cp.pid) / 1024
                took = await attest_probes(cp)  # each succeeds while all N are held
                report.append(
                    f"{kind}: {alive} held (opened in {opening:.1f} s), {rss:.0f} MB, "
                    f"attest {' '.join(f'{t:.3f}' for t in took)} s"
                )
                # none closed before its own timeout: all N are held unless opening them took
                # longer than the timeout (a loaded machine), when the first ones expired
                early = [h for h in held if h.closed_at is not None and lasted_s(h) < MIN_LIFE]
                assert not early, (report, len(early))
                assert alive == N or opening > MIN_LIFE, report
                assert alive > 0, report
                assert rss < 300, report
                # the best of three distinct workloads: one unlucky scheduling slice on a
                # loaded machine does not fail it, a starved API still does
                assert min(took) < 1.0, report
                assert statistics.median(took) < 3.0, report
                # every one is closed by the server, within its timeout (from when it opened)
                await all_closed(held, TIMEOUT + opening + SLACK)
                lasted = [h.closed_at - h.opened_at for h in held if h.closed_at is not None]
                assert min(lasted) >= MIN_LIFE, (kind, min(lasted))
                assert max(lasted) <= TIMEOUT + SLACK, (kind, max(lasted))
            finally:
                await close_all(held)
        print("\n".join(report))
        assert rss_kb(cp.pid) / 1024 < 300


async def test_connections_over_the_per_source_cap_are_closed_at_accept() -> None:
    raise_fd_limit(4000)
    flags = [*FLAGS, "--max-connections-per-source", "300"]
    async with control_plane(flags) as cp:
        held = await open_hostile("tcp_xds", cp, 350, ["127.0.0.2"])
        try:
            await asyncio.sleep(1.0)
            refused = [h for h in held if h.closed_at is not None]
            assert len(refused) == 50
            assert all(h.closed_at - h.opened_at < 1.0 for h in refused)  # type: ignore[operator]
            assert await attest_seconds(cp) < 1.0  # another source is unaffected
        finally:
            await close_all(held)
