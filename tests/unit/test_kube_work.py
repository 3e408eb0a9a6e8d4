"""xds.kube.work.ActionQueue: one worker performs the items in order; a failed item is logged,
counted as done and makes the next re-apply come soon; the re-apply is submitted only while
this replica leads."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from xds.kube.client import KubeError
from xds.kube.work import ActionQueue, Work, WorkKind


async def test_items_run_in_order_and_a_failure_neither_stops_the_worker_nor_goes_unnoticed() -> (
    None
):
    done: list[str] = []

    async def perform(work: Work) -> None:
        await asyncio.sleep(0.001 if work.workload == "shop/a" else 0)  # order, not timing
        if work.workload == "shop/b":
            raise KubeError("forbidden", "rbac (test)", 403)
        done.append(work.workload)

    queue = ActionQueue(perform, is_leader=lambda: True, resync=timedelta(minutes=5))
    worker = asyncio.create_task(queue.worker())
    try:
        for name in ("shop/a", "shop/b", "shop/c"):
            queue.submit(Work(WorkKind.RELEASE, name))
        await asyncio.wait_for(queue.join(), 5)
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    assert done == ["shop/a", "shop/c"]
    assert [w.workload for w in queue.completed] == ["shop/a", "shop/b", "shop/c"]
    assert queue.retrying  # the failed one is repaired by the next re-apply, soon


async def resync_for(seconds: float, leader: bool) -> list[Work]:
    """Run a worker and the resync loop of a queue whose retry flag is set (an item failed)."""
    performed: list[Work] = []

    async def perform(work: Work) -> None:
        performed.append(work)

    queue = ActionQueue(perform, is_leader=lambda: leader, resync=timedelta(minutes=5))
    queue.retry()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(queue.worker()), asyncio.create_task(queue.resync_loop(stop))]
    try:
        await asyncio.sleep(seconds)
        stop.set()
        await asyncio.wait_for(tasks[1], 1)  # a stop ends the loop at once
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    return performed


async def test_after_a_failure_the_reapply_comes_after_a_second_not_the_resync_period() -> None:
    assert [w.kind for w in await resync_for(1.5, leader=True)] == [WorkKind.REAPPLY]
    assert await resync_for(0.5, leader=True) == []  # not before the backoff


async def test_a_follower_never_reapplies() -> None:
    assert await resync_for(1.5, leader=False) == []
