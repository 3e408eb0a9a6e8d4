"""The database goes away under the replicas: a PostgreSQL restart under attestation load (the
replicas stop deciding, recover once it is back and catch up; nothing acknowledged is lost), and
a replica cut off from PostgreSQL (a proxy that stops forwarding: the connection stays open, the
database goes silent) that stops issuing within 5 s and says so on /readyz."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from attestmesh.serve import build_ops_app
from certs.errors import AttestmeshError
from tests.pg.replicas import Replica
from tests.pg_harness import PgCluster
from tests.polling import until
from tests.unit.fixtures_core import NOW, Clock, registration

eventually = partial(until, within=20, every=0.02)

pytestmark = pytest.mark.integration

STOPS_ISSUING_WITHIN_S = 5.0


async def test_a_postgresql_restart_under_load_loses_nothing_acknowledged(
    pg: PgCluster, pg_url: str, tmp_path: Path
) -> None:
    clock = Clock(NOW)
    names = [f"web-{i}" for i in range(8)]
    a = Replica(pg_url, tmp_path / "ca-a", clock, replicate=True)
    b = Replica(pg_url, tmp_path / "ca-b", clock, replicate=True)
    try:
        await a.register([registration(n, port=15001 + i) for i, n in enumerate(names)])
        acked: list[tuple[str, int]] = []
        refused: list[str] = []
        stop = asyncio.Event()

        async def load(name: str) -> None:
            while not stop.is_set():
                try:
                    acked.append((name, (await a.attest(name)).serial))
                except AttestmeshError as exc:
                    refused.append(exc.reason)
                    await asyncio.sleep(0.05)
                    await a.cp.recover_store()  # what the control plane's ticker does

        workers = [asyncio.create_task(load(n)) for n in names]
        await eventually(lambda: len(acked) >= 40)
        await asyncio.to_thread(pg.restart)  # fast shutdown: every connection is dropped
        before = len(acked)
        await eventually(lambda: len(acked) >= before + 40, within=60)  # recovered
        stop.set()
        await asyncio.gather(*workers)
        assert refused, "the restart went unnoticed"
        assert set(refused) <= {"store_unavailable", "store_commit_failed", "store_unreachable"}
        assert a.cp.healthy
        # everything acknowledged is durable, and the other replica has it too
        check = Replica(pg_url, tmp_path / "ca-c", clock)
        try:
            stored = check.cp.state
            live = {(n, c.serial) for n, w in stored.workloads.items() for c in w.certificates}
            revoked = {(r.workload, r.serial) for r in stored.revocations}
            assert [s for s in acked if s not in live | revoked] == []

            def b_has_all() -> bool:
                mine = b.cp.state
                have = {(n, c.serial) for n, w in mine.workloads.items() for c in w.certificates}
                have |= {(r.workload, r.serial) for r in mine.revocations}
                return all(s in have for s in acked)

            await eventually(b_has_all)
        finally:
            check.close()
    finally:
        a.close()
        b.close()


class SilentProxy:
    """TCP proxy to PostgreSQL on its own thread and loop; ``silence()`` stops forwarding
    while every connection stays open (a partition, not a refusal)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SilentProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._open.set()
        self._stopped = asyncio.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: set[asyncio.Task[None]] = set()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stopped.wait()
        for w in self._writers:
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.append(writer)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._writers.append(uw)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    await self._open.wait()  # silenced: hold it
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, uw), pipe(ur, writer))

    def silence(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def resume(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        self.resume()
        self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(10)


async def test_a_replica_cut_off_from_postgresql_stops_issuing_and_is_not_ready(
    pg: PgCluster, pg_url: str, tmp_path: Path
) -> None:
    proxy = SilentProxy(pg.port).start()
    cut_url = pg_url.replace(f":{pg.port}/", f":{proxy.port}/")
    clock = Clock(datetime.now(UTC))
    a = Replica(cut_url, tmp_path / "ca", clock, replicate=True)
    client = TestClient(TestServer(build_ops_app(a.cp, a.metrics, "token")))
    await client.start_server()
    try:
        await a.register([registration("web-1")])
        await a.attest("web-1")
        assert (await client.get("/readyz")).status == 200
        proxy.silence()
        cut_at = time.monotonic()
        await eventually(lambda: not a.cp.ready, within=STOPS_ISSUING_WITHIN_S + 5)
        took = time.monotonic() - cut_at
        assert took <= STOPS_ISSUING_WITHIN_S, took
        ready = await client.get("/readyz")
        assert ready.status == 503
        assert (await ready.json())["status"] == "store_unreachable"
        with pytest.raises(AttestmeshError) as refused:  # fails closed, answers at once
            await asyncio.wait_for(a.attest("web-1"), 2)
        assert refused.value.reason == "store_unavailable"
        proxy.resume()  # back: it serves again
        await eventually(lambda: a.cp.ready, within=20)
        assert (await client.get("/readyz")).status == 200
        await asyncio.wait_for(a.attest("web-1"), 10)
    finally:
        await client.close()
        proxy.close()
        await asyncio.to_thread(a.close)
