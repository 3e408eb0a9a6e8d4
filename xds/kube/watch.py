"""list + watch, resumed from the last resourceVersion, relisted on 410 Gone.

Watchers list, then watch from the list's resourceVersion with bookmarks; a broken watch (the
API server restarted, the connection dropped) resumes from the last resourceVersion, a 410 Gone
relists; failures back off exponentially (jittered). A resource the server does not serve
(``WatchSpec.optional``) yields an empty snapshot and no watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from xds.kube.client import KubeClient, KubeError, Sleep, translate
from xds.kube.metrics import KubeMetrics

log = logging.getLogger(__name__)


class _Gone(Exception):
    pass


@dataclass(slots=True)
class WatchSpec:
    """What a Watcher lists and watches, and whom it tells."""

    resource: str
    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    on_snapshot: Callable[[list[dict[str, Any]]], Awaitable[None]]
    on_event: Callable[[str, dict[str, Any]], Awaitable[None]]
    # A server that does not serve the resource (404 on the list) yields an empty snapshot and
    # no watch, instead of retrying forever (discovery.k8s.io/v1 EndpointSlices, Kubernetes
    # 1.21: an older server lists none, so every pod counts as ready).
    optional: bool = False


class Watcher:
    """list + watch with resourceVersion; relist on 410 Gone; exponential backoff on errors."""

    def __init__(
        self,
        kube: KubeClient,
        spec: WatchSpec,
        *,
        metrics: KubeMetrics | None = None,
        watch_timeout: int = 300,
        backoff: tuple[float, float] = (0.2, 30.0),
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.kube, self.spec, self.metrics = kube, spec, metrics
        self.watch_timeout, self.backoff, self.sleep = watch_timeout, backoff, sleep
        self.rng = rng or random.Random()  # jitter only
        self._watch: Any = None
        self.synced = asyncio.Event()
        self.resource_version: str | None = None
        self.lists = 0

    def _restart(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.watch_restarts.labels(resource=self.spec.resource, reason=reason).inc()

    async def run(self) -> None:
        delay = self.backoff[0]
        try:
            while True:
                try:
                    try:
                        listed = await self.kube.call(self.spec.list_fn, *self.spec.args)
                    except KubeError as exc:
                        if exc.status != 404 or not self.spec.optional:
                            raise
                        self._restart("not_served")
                        log.warning(
                            "%s: not served by this API server; none watched", self.spec.resource
                        )
                        await self.spec.on_snapshot([])
                        self.synced.set()
                        return
                    self.lists += 1
                    self.resource_version = str(listed["metadata"]["resourceVersion"])
                    await self.spec.on_snapshot(list(listed.get("items") or []))
                    self.synced.set()
                    delay = self.backoff[0]
                    while True:
                        # A broken stream (the API server restarted, the connection dropped)
                        # resumes from the last resourceVersion after a backoff: no relist
                        # unless the server answers 410 Gone (history compacted since).
                        try:
                            if await self._stream():
                                delay = self.backoff[0]
                            else:  # ended with nothing delivered: never spin
                                await self.sleep(self.backoff[0])
                        except KubeError as exc:
                            self._restart("error")
                            log.warning(
                                "watch %s: %s; resuming from %s in %.1fs",
                                self.spec.resource, exc, self.resource_version, delay,
                            )  # fmt: skip
                            await self.sleep(delay * (0.5 + self.rng.random()))
                            delay = min(delay * 2, self.backoff[1])
                except _Gone:
                    self._restart("gone")
                except KubeError as exc:
                    self._restart("error")
                    log.warning("watch %s: %s; retrying in %.1fs", self.spec.resource, exc, delay)
                    await self.sleep(delay * (0.5 + self.rng.random()))
                    delay = min(delay * 2, self.backoff[1])
        finally:
            self.stop_stream()

    def stop_stream(self) -> None:
        w = self._watch
        if w is not None:
            w.stop()

    async def _stream(self) -> bool:
        """One watch request from ``resource_version``; True if it delivered anything."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        self._watch = w
        rv = self.resource_version

        def pump() -> None:
            def put(item: tuple[str, Any]) -> None:
                with contextlib.suppress(RuntimeError):  # the loop may be closed already
                    loop.call_soon_threadsafe(queue.put_nowait, item)

            try:
                for ev in w.stream(
                    self.spec.list_fn,
                    *self.spec.args,
                    resource_version=rv,
                    timeout_seconds=self.watch_timeout,
                    allow_watch_bookmarks=True,
                    _request_timeout=(self.kube.request_timeout, self.watch_timeout + 30),
                ):
                    put(("event", ev))
            except ApiException as exc:
                put(("error", exc))
            except Exception as exc:  # socket shut down by stop(), or a broken stream
                put(("error", exc))
            finally:
                put(("end", None))

        # A daemon thread, never awaited: a blocking read cannot be interrupted, and awaiting it
        # (or the default executor, at loop shutdown) would wait for the watch timeout.
        threading.Thread(target=pump, name=f"watch-{self.spec.resource}", daemon=True).start()
        delivered = False
        try:
            while True:
                kind, item = await queue.get()
                if kind == "end":
                    return delivered
                if kind == "error":
                    if getattr(item, "status", None) == 410:
                        raise _Gone()
                    if w._stop:
                        return delivered
                    if hasattr(item, "status"):
                        raise translate(item)
                    raise KubeError("watch_broken", str(item))
                etype, obj = item.get("type"), item.get("raw_object") or {}
                new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                if etype == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise KubeError("watch_error", str(obj.get("message")), int(obj.get("code", 0)))
                if new_rv:
                    self.resource_version = str(new_rv)
                delivered = True
                if etype in ("ADDED", "MODIFIED", "DELETED"):
                    await self.spec.on_event(etype, obj)
        finally:
            w.stop()
            self._watch = None


__all__ = ["WatchSpec", "Watcher"]
