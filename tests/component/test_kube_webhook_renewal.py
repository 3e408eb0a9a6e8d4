"""The webhook's serving certificate is renewed from the mesh CA at half its lifetime; a failed
renewal is logged, counted and retried with backoff, and never ends the control plane (the
Kubernetes task group runs beside the API and xDS servers: one task's exception stops them all).
Real control plane in process, the fake API server, the real ``kubernetes`` client."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Sequence
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from kubernetes import client

import attestmesh.kube_mode as kube_mode
from attestmesh.kube_mode import KubeMode, KubeSettings, renewal_wait
from attestmesh.metrics import Metrics
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from certs.ca import CertificateAuthority
from certs.errors import AttestmeshError
from sidecar.inject import InjectConfig, SimInjection
from tests.component.test_kube_mode import GOOD, WEBHOOKS, free_port, seed, sim_key
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS
from xds.kube import KubeClient

__all__ = ["sim_key"]  # the module fixture, shared

RENEW_TTL = timedelta(seconds=0.4)  # renewed every 0.2 s
RETRY = (timedelta(seconds=0.05), timedelta(seconds=0.2))


def test_renewal_wait_doubles_from_the_first_retry_up_to_the_cap_and_resets() -> None:
    renew = timedelta(hours=12)
    first, cap = timedelta(seconds=10), timedelta(minutes=10)
    waits = [renewal_wait(n, renew, first, cap) for n in range(9)]
    assert waits[0] == renew  # no failure: the next renewal at half the lifetime
    assert waits[1:] == [timedelta(seconds=s) for s in (10, 20, 40, 80, 160, 320, 600, 600)]
    # never later than the regular renewal (a short-lived certificate is retried within it)
    assert renewal_wait(5, timedelta(seconds=30), first, cap) == timedelta(seconds=30)
    with pytest.raises(ValueError, match="failures"):
        renewal_wait(-1, renew, first, cap)


def renewals(metrics: Metrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "attestmesh_serving_cert_renewals_total", {"listener": "webhook", "result": result}
    )
    return value or 0.0


def served_serial(url: str) -> int:
    """The serial of the certificate the webhook presents to a new handshake."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    pem = ssl.get_server_certificate((host, int(port)), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


@contextlib.asynccontextmanager
async def plane(
    kube: FakeKube, state_dir: Path, sim_key: Path, metrics: Metrics
) -> AsyncIterator[tuple[asyncio.Task[None], KubeMode, Running]]:
    settings = ControlPlaneSettings(
        state_dir=state_dir,
        sim_platform_keys=(sim_key,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
    )
    kc = KubeClient(client.ApiClient(kube.configuration()), request_timeout=5)
    mode = KubeMode(
        kc,
        KubeSettings(
            identity="cp-0",
            webhook_host="127.0.0.1",
            webhook_port=free_port(),
            webhook_configuration="attestmesh-sidecar-injector",
            retry_period=timedelta(seconds=0.5),
            watch_timeout=5,
            webhook_cert_ttl=RENEW_TTL,
            webhook_cert_retry=RETRY,
            inject=InjectConfig(sim=SimInjection(GOOD.hex())),
        ),
        metrics,
        state_dir=state_dir,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_control_plane(settings, stop, ready, metrics=metrics, hooks=mode.hooks())
    )
    try:
        running = await asyncio.wait_for(ready, 10)
        await asyncio.wait_for(mode.synced.wait(), 5)
        yield task, mode, running
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_a_failed_webhook_renewal_is_retried_and_the_control_plane_keeps_running(
    tmp_path: Path, sim_key: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    issue = kube_mode._issue_webhook_tls
    calls: list[str] = []
    failing = asyncio.Event()

    def flaky(
        ca: CertificateAuthority,
        spiffe_id: str,
        dns_names: Sequence[str],
        now: datetime,
        directory: Path,
        ttl: timedelta = kube_mode.WEBHOOK_CERT_TTL,
    ) -> tuple[Path, Path]:
        if failing.is_set():
            calls.append("failed")
            raise AttestmeshError("the CA refused (test)")
        calls.append("issued")
        return issue(ca, spiffe_id, dns_names, now, directory, ttl)

    monkeypatch.setattr(kube_mode, "_issue_webhook_tls", flaky)
    metrics = Metrics()
    async with FakeKube(bookmark_interval=0.1, extra_resources=(WEBHOOKS, CONFIGMAPS)) as kube:
        await seed(kube)
        async with plane(kube, tmp_path, sim_key, metrics) as (task, mode, _):
            await check_renewal(task, mode, metrics, calls, failing)


async def check_renewal(
    task: asyncio.Task[None],
    mode: KubeMode,
    metrics: Metrics,
    calls: list[str],
    failing: asyncio.Event,
) -> None:
    assert mode.webhook_url is not None
    failing.set()
    async with asyncio.timeout(10):
        while calls.count("failed") < 1:
            await asyncio.sleep(0.02)
    before = await asyncio.to_thread(served_serial, mode.webhook_url)
    async with asyncio.timeout(10):
        while calls.count("failed") < 3:
            await asyncio.sleep(0.02)
    # renewals failed in a row: the control plane and its webhook are still up, serving the
    # certificate they had
    assert not task.done()
    assert renewals(metrics, "failed") == calls.count("failed") >= 3
    assert await asyncio.to_thread(served_serial, mode.webhook_url) == before
    ok = renewals(metrics, "ok")
    failing.clear()
    async with asyncio.timeout(10):
        while renewals(metrics, "ok") == ok:
            await asyncio.sleep(0.02)
    assert not task.done()
    # the renewed certificate is the one new handshakes get
    assert await asyncio.to_thread(served_serial, mode.webhook_url) != before
