"""Secret release in Kubernetes mode end to end: the real control plane (run_control_plane with
KubeMode, the fake API server through the real client, TokenReview) with secret release on
(``--openbao-url``, no policy file) against a real OpenBao. The SecretPolicy CR decides: the
injected pod's agent, attested with its pod-bound token, gets the secret sealed to its key;
deleting the CR stops the release at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from attestmesh.controlplane.secrets import SecretPolicies
from attestmesh.secret_release import SecretReleaseSettings
from attestmesh.serve import Running, run_control_plane
from sidecar.agent import Agent, SimEvidenceSource, client_ssl_context
from sidecar.secrets import FanOut, SecretFetcher
from tests.bao_harness import start_bao
from tests.component.test_kube_mode import (
    GOOD,
    GROUP,
    PLATFORM,
    WEB_TOKEN,
    WEBHOOKS,
    WORKLOAD,
    free_port,
    policy_cr,
    seed,
    sim_key,
)
from tests.component.test_kube_secretpolicies import SECRETPOLICIES, secret_cr
from tests.fakekube import FakeKube
from tests.fakekube.server import CONFIGMAPS

__all__ = ["sim_key"]  # the module-scoped fixture, shared


class Sink:
    def update(self, cert_chain_pem: bytes, key_pem: bytes) -> None:
        pass


@contextlib.asynccontextmanager
async def control_plane(
    kube: FakeKube, state_dir: Path, sim_key: Path, secrets: SecretReleaseSettings
) -> AsyncIterator[tuple[Running, int]]:
    """The Kubernetes-mode control plane (as test_kube_mode's) with secret release on; yields
    it and its API port."""
    from kubernetes import client

    from attestmesh.kube_mode import KubeMode, KubeSettings
    from attestmesh.metrics import Metrics
    from attestmesh.serve import ControlPlaneSettings
    from sidecar.inject import InjectConfig, SimInjection
    from xds.kube import KubeClient

    settings = ControlPlaneSettings(
        state_dir=state_dir,
        sim_platform_keys=(sim_key,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
        secrets=secrets,
    )
    metrics = Metrics()
    mode = KubeMode(
        KubeClient(client.ApiClient(kube.configuration()), request_timeout=5),
        KubeSettings(
            identity="cp-0",
            webhook_host="127.0.0.1",
            webhook_port=free_port(),
            webhook_configuration="attestmesh-sidecar-injector",
            probe_host="127.0.0.1",
            probe_port=free_port(),
            watch_timeout=5,
            inject=InjectConfig(sim=SimInjection(GOOD.hex())),
        ),
        metrics,
        state_dir=state_dir,
        secret_policies=SecretPolicies(),
    )
    stop = asyncio.Event()
    ready: asyncio.Future[Running] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        run_control_plane(settings, stop, ready, metrics=metrics, hooks=mode.hooks())
    )
    try:
        running = await asyncio.wait_for(ready, 10)
        await asyncio.wait_for(mode.synced.wait(), 5)
        yield running, settings.api_port
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


async def test_secret_policy_resources_decide_release_in_kubernetes_mode(
    tmp_path: Path, sim_key: Path
) -> None:
    bao = await start_bao(tmp_path / "bao")
    try:
        await bao.kv_put("shop/db", {"password": "pw-kube"})
        (tmp_path / "tok").write_text(bao.root_token)
        secrets = SecretReleaseSettings(
            policy_file=None, openbao_url=bao.url, port=free_port(), token_file=tmp_path / "tok"
        )
        async with FakeKube(
            bookmark_interval=0.1, extra_resources=(WEBHOOKS, CONFIGMAPS, SECRETPOLICIES)
        ) as kube:
            await seed(kube, policy_cr("web"))
            await kube.put_object("secretpolicies", secret_cr("db"), GROUP)
            async with control_plane(kube, tmp_path / "state", sim_key, secrets) as (
                running,
                api_port,
            ):
                fetcher = SecretFetcher(
                    url=f"https://127.0.0.1:{secrets.port}",
                    workload=WORKLOAD,
                    secrets=["db"],
                    bundle_pem=running.bundle_pem,
                    directory=tmp_path / "secrets",
                    tls_dir=tmp_path / "tls",
                )
                agent = Agent(
                    url=f"https://127.0.0.1:{api_port}",
                    workload=WORKLOAD,
                    source=SimEvidenceSource(PLATFORM, GOOD),
                    sink=FanOut(Sink(), fetcher),
                    ssl_context=client_ssl_context(running.bundle_pem),
                    token=lambda: WEB_TOKEN,
                )
                async with aiohttp.ClientSession() as session:
                    await agent.attest_once(session)
                    async with asyncio.timeout(10):  # the CR reaches the holder
                        while "db" not in fetcher.held:
                            await fetcher.fetch_all(session)
                            await asyncio.sleep(0.05)
                    assert (tmp_path / "secrets" / "db" / "password").read_text() == "pw-kube"
                    await kube.delete_object("secretpolicies", "shop", "db", GROUP)
                    async with asyncio.timeout(10):
                        while "db" in fetcher.held:
                            await fetcher.fetch_all(session)
                            await asyncio.sleep(0.05)
                assert fetcher.last_error["db"].reason == "not_allowed"
                assert not (tmp_path / "secrets" / "db").exists()
    finally:
        bao.stop()
