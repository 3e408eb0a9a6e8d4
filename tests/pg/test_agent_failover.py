"""The agent with several control-plane replicas (two real control planes on one PostgreSQL
database, each serving the attestation API over HTTPS on loopback): an outage moves it to the
next replica, a refusal does not; a host name resolving to several addresses is tried address
by address while TLS keeps verifying the name."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from attestmesh.controlplane.http import build_app
from attestmesh.demo import free_port as free_port  # one port picker (see there)
from sidecar.agent import Agent, AgentError, SimEvidenceSource, client_ssl_context
from tests.component.test_agent import RecordingSink, _server_tls
from tests.pg.replicas import PLATFORM, Replica
from tests.polling import until
from tests.unit.fixtures_core import MEASUREMENT, Clock, registration
from xds.state import Status, Trigger

until = partial(until, within=10)

pytestmark = pytest.mark.integration


class Served:
    def __init__(self, replica: Replica, tmp: Path, clock: Clock) -> None:
        self.replica = replica
        self.paths: list[str] = []
        self._tls = _server_tls(replica.cp.ca, tmp, clock())
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        @web.middleware
        async def record(
            request: web.Request,
            handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
        ) -> web.StreamResponse:
            self.paths.append(request.path)
            return await handler(request)

        app = build_app(self.replica.cp, self.replica.metrics)
        app.middlewares.append(record)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=self._tls).start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"


@pytest.fixture
async def two(pg_url: str, tmp_path: Path) -> AsyncIterator[tuple[Served, Served, Clock]]:
    clock = Clock(datetime.now(UTC).replace(microsecond=0))  # TLS checks the real time
    a = Replica(pg_url, tmp_path / "ca", clock, follow_changes=True)
    b = Replica(pg_url, tmp_path / "ca", clock, follow_changes=True)
    await a.register([registration("web-1"), registration("web-2", port=15002)])
    # B learns of them from the change feed (asked before it has, it waits for its feed's
    # next read: tests/pg/test_unknown_name_wait.py); these tests are about the agent's
    # failover, so they start once B holds them
    await until(lambda: {"web-1", "web-2"} <= b.cp.state.workloads.keys())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sa, sb = Served(a, tmp_path / "a", clock), Served(b, tmp_path / "b", clock)
    await sa.start()
    await sb.start()
    try:
        yield sa, sb, clock
    finally:
        await sa.stop()
        await sb.stop()
        a.close()
        b.close()


async def test_an_outage_moves_the_agent_on_and_a_refusal_does_not(
    two: tuple[Served, Served, Clock],
) -> None:
    a, b, clock = two
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    dead = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    agent = Agent(
        url=[dead, a.url, b.url],
        workload="web-1",
        source=SimEvidenceSource(PLATFORM, MEASUREMENT),
        sink=RecordingSink(),
        ssl_context=client_ssl_context(a.replica.cp.ca.bundle_pem),
        clock=clock,
        timeout_s=5.0,
        sleep=sleep,
        rand=lambda: 0.5,
    )
    async with aiohttp.ClientSession() as session:
        first = await agent.attest_once(session)  # the dead one first, then A
        assert a.paths == ["/v1/challenge", "/v1/attest"] and b.paths == []
        assert slept == [pytest.approx(0.15)]  # one jittered pause before the second replica
        await until(lambda: b.replica.cp.status_of("web-1") is Status.ATTESTED)  # fan-out
        await a.stop()  # replica A goes away: the renewal goes to B
        renewed = await agent.attest_once(session)
        assert b.paths == ["/v1/challenge", "/v1/renew"]
        assert renewed.serial != first.serial
        assert a.replica.cp.state.get("web-1").certificates  # A still holds the record
        # a refusal is the same at every replica: raised at once, nobody else asked
        assert b.replica.cp.quarantine("web-1", Trigger.OPERATOR, "compromised")
        await b.replica.cp.flushed()
        tried = len(slept)
        with pytest.raises(AgentError) as refused:
            await agent.attest_once(session)
        assert refused.value.status == 403
        assert len(slept) == tried  # no failover
        assert b.paths[-2:] == ["/v1/challenge", "/v1/renew"]


async def test_a_name_with_several_addresses_is_tried_address_by_address(
    two: tuple[Served, Served, Clock],
) -> None:
    _, b, clock = two
    asked: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.3", "127.0.0.1"]  # nothing listens on the first

    agent = Agent(
        url=f"https://localhost:{b.port}",
        workload="web-2",
        source=SimEvidenceSource(PLATFORM, MEASUREMENT),
        sink=RecordingSink(),
        ssl_context=client_ssl_context(b.replica.cp.ca.bundle_pem),
        clock=clock,
        timeout_s=5.0,
        resolve=resolve,
        sleep=lambda s: asyncio.sleep(0),
    )
    async with aiohttp.ClientSession() as session:
        cert = await agent.attest_once(session)  # TLS verified "localhost" at 127.0.0.1
    assert asked == ["localhost"]
    assert b.replica.cp.state.get("web-2").certificates[-1].serial == cert.serial
    assert b.paths == ["/v1/challenge", "/v1/attest"]
