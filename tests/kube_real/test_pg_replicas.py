"""Kubernetes mode on PostgreSQL, end to end: two control-plane replicas (what ``attestmesh
controlplane --kubernetes --store postgresql://...`` runs) against the real kube-apiserver 1.20.2
and one throwaway PostgreSQL cluster. One holds the Lease and is the only one to write to
Kubernetes; a pod attested at the other and quarantined there is quarantined on the leader too
(through the database's change feed), and the leader labels the pod and records the Event once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from attestmesh.kube_mode import KubeMode, KubeSettings, WorkKind, connect
from attestmesh.metrics import Metrics
from attestmesh.serve import ControlPlaneSettings, Running, run_control_plane
from sidecar.agent import Agent, AgentCertificate, AgentError
from sidecar.inject import InjectConfig, SimInjection
from tests.kube_real.cluster import free_port
from tests.kube_real.plane import (
    BAD,
    GOOD,
    WEBHOOK,
    Env,
    Plane,
    injected_fixture_pod,
    namespace_doc,
    pod_token,
    policy,
    running_pod,
    service_account_doc,
)
from tests.kube_real.rest import Rest, until
from tests.pg_harness import PgCluster, pg_cluster
from xds.kube import CONDITION_ATTESTED, LABEL_QUARANTINED
from xds.kube.conditions import micro_time
from xds.state import Status, Trigger

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pg() -> Iterator[PgCluster]:
    with pg_cluster() as cluster:
        yield cluster


@contextlib.asynccontextmanager
async def replica(
    env: Env, url: str, state_dir: Path, identity: str, webhook_port: int
) -> AsyncIterator[Plane]:
    """``controlplane --kubernetes --kubeconfig <the manifests' ServiceAccount> --store url``
    in this process, until its Kubernetes sources have synced."""
    settings = ControlPlaneSettings(
        state_dir=state_dir,
        sim_platform_keys=(env.sim_key,),
        api_port=free_port(),
        xds_port=free_port(),
        ops_port=free_port(),
        deadline_check=timedelta(seconds=1),
        store=url,
    )
    metrics = Metrics()
    mode = KubeMode(
        connect(env.kubeconfig, 10),
        KubeSettings(
            identity=identity,
            webhook_host="127.0.0.1",
            webhook_port=webhook_port,
            webhook_configuration=WEBHOOK,
            probe_host="127.0.0.1",
            probe_port=free_port(),
            retry_period=timedelta(seconds=0.5),
            watch_timeout=30,
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
        running = await asyncio.wait_for(ready, 30)
        await asyncio.wait_for(mode.synced.wait(), 30)
        yield Plane(running, mode, settings, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


def events(admin: Rest, ns: str, reason: str) -> list[dict[str, Any]]:
    return [e for e in admin.items("v1", "Event", ns) if e["reason"] == reason]


LEASE = ("coordination.k8s.io/v1", "Lease", "attestmesh-system", "attestmesh-controlplane-leader")


def hold_lease(admin: Rest, holder: str | None) -> None:
    """The Lease as another holder's (renewed now, for an hour), or released (None)."""
    now = micro_time(datetime.now(UTC))
    spec = {"holderIdentity": holder, "leaseDurationSeconds": 3600, "renewTime": now}
    current = admin.get_or_none(*LEASE)
    if current is None:
        admin.create(
            {
                "apiVersion": LEASE[0],
                "kind": LEASE[1],
                "metadata": {"name": LEASE[3], "namespace": LEASE[2]},
                "spec": {**spec, "acquireTime": now},
            }
        )
    else:
        admin.patch(*LEASE, {"spec": spec})


async def _attest(agent: Agent, session: aiohttp.ClientSession) -> AgentCertificate:
    """``attest_once``, again while the control plane answers 503 store_unavailable (what the
    agent's run loop does): A's own writes of web-0 (its pod watch registers it too) can land
    after B read the workload for this attestation, which B then refuses as a conflict."""
    for _ in range(4):
        try:
            return await agent.attest_once(session)
        except AgentError as exc:
            if exc.reason != "store_unavailable":
                raise
            await asyncio.sleep(0.5)
    return await agent.attest_once(session)


@contextlib.asynccontextmanager
async def two_replicas(env: Env, pg: PgCluster, tmp_path: Path, ns: str) -> AsyncIterator[Pair]:
    """A (holding the Lease) and B on one database, a pod ``web-0`` in ``ns`` registered on
    both and attested at B (the follower). ``Pair.stop_a`` stops A before B."""
    admin = env.admin
    await asyncio.to_thread(admin.apply, namespace_doc(ns))
    await asyncio.to_thread(admin.apply, service_account_doc(ns, "web"))
    await asyncio.to_thread(admin.apply, policy("web", ns))
    url = pg.create_database(ns.replace("-", "_"))
    async with contextlib.AsyncExitStack() as a_stack:  # closed early by Pair.stop_a
        a = await a_stack.enter_async_context(
            replica(env, url, tmp_path / "a", "cp-a", env.webhook_port)
        )
        await until(lambda: a.mode.elector.is_leader or None, timeout=40, what="A leads")
        async with replica(env, url, tmp_path / "b", "cp-b", free_port()) as b:
            stored = await running_pod(admin, injected_fixture_pod("web-0", ns=ns), "10.2.1.5")
            workload = f"{ns}/web-0"
            for plane in (a, b):  # each replica watches the pods
                await until(
                    lambda plane=plane: plane.running.cp.state.workloads.get(workload),
                    what="web-0 registered",
                )
            token = await asyncio.to_thread(pod_token, admin, stored)
            async with aiohttp.ClientSession() as session:  # attested at the follower
                issued = await _attest(b.agent(workload, token, GOOD), session)
            await until(  # the attestation reached the leader through the database
                lambda: a.running.cp.status_of(workload) is Status.ATTESTED or None,
                what="attested on A",
            )
            yield Pair(a, b, workload, token, issued.serial, url, a_stack.aclose)


@dataclass
class Pair:
    a: Plane  # holds the Lease
    b: Plane
    workload: str
    token: str
    serial: int  # of the certificate B issued
    url: str  # the database
    stop_a: Callable[[], Awaitable[None]]  # A stops (handing the Lease over); B runs on


def attested_condition(pod: dict[str, Any]) -> str | None:
    conds = [c for c in pod["status"].get("conditions") or [] if c["type"] == CONDITION_ATTESTED]
    return conds[-1]["status"] if conds else None


def labelled(admin: Rest, ns: str) -> dict[str, Any] | None:
    pod = admin.get("v1", "Pod", ns, "web-0")
    return pod if pod["metadata"]["labels"].get(LABEL_QUARANTINED) else None


async def test_one_lease_holder_one_trust_and_a_quarantine_on_either_reaches_the_other(
    env: Env, pg: PgCluster, tmp_path: Path
) -> None:
    admin, ns = env.admin, "pg-replicas"
    async with two_replicas(env, pg, tmp_path, ns) as r:
        a, b = r.a, r.b
        assert b.running.cp.ca.bundle_pem == a.running.cp.ca.bundle_pem  # B took A's CA
        lease = await asyncio.to_thread(
            admin.get,
            "coordination.k8s.io/v1",
            "Lease",
            "attestmesh-system",
            "attestmesh-controlplane-leader",
        )
        assert lease["spec"]["holderIdentity"] == "cp-a"  # one real Lease: A's
        assert not b.mode.elector.is_leader
        # the database's leader lock follows the Lease: A also rotates the CA and signs the CRL
        await until(lambda: a.running.cp.leads or None, what="A leads on the database too")
        assert not b.running.cp.leads

        # the leader quarantines (a failed attestation at A): it labels the pod and records
        # the Event once; B adopts the quarantine and writes nothing
        async with aiohttp.ClientSession() as session:
            with pytest.raises(AgentError) as exc:
                await a.agent(r.workload, r.token, BAD).attest_once(session)
            assert exc.value.status == 403
        await until(
            lambda: b.running.cp.status_of(r.workload) is Status.QUARANTINED or None,
            what="quarantine reached B",
        )
        await a.mode.drained()
        await b.mode.drained()
        pod = await until(lambda: labelled(admin, ns), what="pod labelled by the leader")
        conds = [c for c in pod["status"]["conditions"] if c["type"] == CONDITION_ATTESTED]
        assert [c["status"] for c in conds] == ["False"], conds
        (event,) = await until(
            lambda: events(admin, ns, "Quarantined") or None, what="Quarantined Event"
        )
        assert event["involvedObject"]["name"] == "web-0"
        await asyncio.sleep(1.0)
        assert len(await asyncio.to_thread(events, admin, ns, "Quarantined")) == 1
        # both refuse the workload; the certificate B issued is revoked on both
        async with aiohttp.ClientSession() as session:
            for plane in (a, b):
                with pytest.raises(AgentError) as exc:
                    await plane.agent(r.workload, r.token, GOOD).attest_once(session)
                assert exc.value.status == 403
        for plane in (a, b):
            await until(
                lambda plane=plane: r.serial in plane.running.cp.state.revoked_serials() or None,
                what="B's certificate revoked",
            )

        # an operator releases it on the follower: the release reaches the leader
        assert b.running.cp.release(r.workload)
        await b.running.cp.flushed()
        await until(
            lambda: a.running.cp.status_of(r.workload) is Status.PENDING or None,
            what="release reached A",
        )


async def test_a_quarantine_decided_on_the_follower_is_acted_on_once_by_the_leader(
    env: Env, pg: PgCluster, tmp_path: Path
) -> None:
    admin, ns = env.admin, "pg-follower-q"
    async with two_replicas(env, pg, tmp_path, ns) as r:
        assert r.b.running.cp.quarantine(r.workload, Trigger.OPERATOR, "compromised (on B)")
        await r.b.running.cp.flushed()
        await until(
            lambda: r.a.running.cp.status_of(r.workload) is Status.QUARANTINED or None,
            what="quarantine reached A",
        )
        await r.b.mode.drained()
        assert WorkKind.QUARANTINE in [w.kind for w in r.b.mode.completed]  # B's: no writes
        await r.a.mode.drained()
        await until(lambda: labelled(admin, ns), timeout=10, what="pod labelled by the leader")
        assert len(await asyncio.to_thread(events, admin, ns, "Quarantined")) == 1


def released(admin: Rest, ns: str) -> dict[str, Any] | None:
    pod = admin.get("v1", "Pod", ns, "web-0")
    unlabelled = LABEL_QUARANTINED not in pod["metadata"]["labels"]
    return pod if unlabelled and attested_condition(pod) == "True" else None


async def test_leadership_moving_after_a_followers_quarantine_keeps_one_event_and_moves_the_acting(
    env: Env, pg: PgCluster, tmp_path: Path
) -> None:
    """B (a follower) quarantines, A (the leader) acts; A stops and B takes the Lease: its
    re-apply on winning finds everything in place (one Event). A third replica C joins as a
    follower and releases the pod: B, leading now, acts on the release C decided."""
    admin, ns = env.admin, "pg-lead-moves"
    async with two_replicas(env, pg, tmp_path, ns) as r:
        a, b = r.a, r.b
        assert b.running.cp.quarantine(r.workload, Trigger.OPERATOR, "compromised (on B)")
        await b.running.cp.flushed()
        await until(
            lambda: a.running.cp.status_of(r.workload) is Status.QUARANTINED or None,
            what="quarantine reached A",
        )
        await a.mode.drained()
        await until(lambda: labelled(admin, ns), timeout=10, what="pod labelled by A")
        assert WorkKind.REAPPLY not in [w.kind for w in b.mode.completed]  # B never led

        await r.stop_a()  # A hands the Lease over; B takes it and re-applies on winning
        await until(lambda: b.mode.elector.is_leader or None, timeout=20, what="B leads")
        await until(lambda: b.running.cp.leads or None, timeout=10, what="B leads on the database")
        await until(
            lambda: WorkKind.REAPPLY in [w.kind for w in b.mode.completed] or None,
            what="B re-applied",
        )
        await b.mode.drained()
        pod = await asyncio.to_thread(labelled, admin, ns)
        assert pod is not None and attested_condition(pod) == "False"
        assert len(await asyncio.to_thread(events, admin, ns, "Quarantined")) == 1

        async with replica(env, r.url, tmp_path / "c", "cp-c", free_port()) as c:
            assert c.running.cp.status_of(r.workload) is Status.QUARANTINED  # from the store
            assert not c.mode.elector.is_leader
            assert c.running.cp.release(r.workload)  # an operator, on the follower C
            await c.running.cp.flushed()
            await until(
                lambda: b.running.cp.status_of(r.workload) is Status.PENDING or None,
                what="release reached B",
            )
            await b.mode.drained()
            await until(lambda: released(admin, ns), timeout=10, what="pod released by B")
            # B performed a release no event of its own asked for: the adopted row's
            assert WorkKind.RELEASE in [w.kind for w in b.mode.completed]
            await c.mode.drained()
        assert len(await asyncio.to_thread(events, admin, ns, "Quarantined")) == 1


async def test_a_quarantine_decided_while_no_replica_leads_is_applied_by_the_next_leader(
    env: Env, pg: PgCluster, tmp_path: Path
) -> None:
    """The Lease held by a replica that is gone (renewed for an hour): A stops leading; B
    quarantines, and no replica writes to Kubernetes. Once the Lease is free, the replica that
    takes it re-applies the quarantine on winning: the pod is labelled, one Event. Likewise a
    release decided while nobody leads: the next leader's re-apply removes the label."""
    admin, ns = env.admin, "pg-no-leader"
    try:
        async with two_replicas(env, pg, tmp_path, ns) as r:
            await asyncio.to_thread(hold_lease, admin, "cp-gone")
            await until(lambda: not r.a.mode.elector.is_leader or None, what="A stops leading")
            assert r.b.running.cp.quarantine(r.workload, Trigger.OPERATOR, "compromised")
            await r.b.running.cp.flushed()
            await until(
                lambda: r.a.running.cp.status_of(r.workload) is Status.QUARANTINED or None,
                what="quarantine reached A",
            )
            await r.a.mode.drained()
            await r.b.mode.drained()
            assert await asyncio.to_thread(labelled, admin, ns) is None  # nobody led
            assert await asyncio.to_thread(events, admin, ns, "Quarantined") == []

            await asyncio.to_thread(hold_lease, admin, None)  # the Lease is free
            leader = await until(
                lambda: next((p for p in (r.a, r.b) if p.mode.elector.is_leader), None),
                what="a replica leads",
            )
            pod = await until(  # the label, then the condition: two writes
                lambda: (
                    p if (p := labelled(admin, ns)) and attested_condition(p) == "False" else None
                ),
                timeout=10,
                what="pod labelled and its condition written",
            )
            assert attested_condition(pod) == "False"
            await leader.mode.drained()
            assert len(await asyncio.to_thread(events, admin, ns, "Quarantined")) == 1

            # the same for a release: decided while nobody leads, written by the next leader
            await asyncio.to_thread(hold_lease, admin, "cp-gone")
            await until(lambda: not leader.mode.elector.is_leader or None, what="it stops leading")
            follower = r.b if leader is r.a else r.a
            await until(  # the label is watched (the re-apply reads it there)
                lambda: (
                    all(
                        p.mode.source.pods[r.workload].labels.get(LABEL_QUARANTINED)
                        for p in (r.a, r.b)
                    )
                    or None
                ),
                what="the label watched",
            )
            assert follower.running.cp.release(r.workload)
            await follower.running.cp.flushed()
            await until(
                lambda: leader.running.cp.status_of(r.workload) is Status.PENDING or None,
                what="release reached the other",
            )
            await r.a.mode.drained()
            await r.b.mode.drained()
            assert await asyncio.to_thread(labelled, admin, ns) is not None  # nobody led
            await asyncio.to_thread(hold_lease, admin, None)
            await until(lambda: released(admin, ns), timeout=10, what="pod released")
    finally:
        await asyncio.to_thread(hold_lease, admin, None)  # never left to a holder that is gone
