"""The incremental publisher: persisted mesh state -> the snapshots of the nodes it changes.

A change names the workloads it touched. For each, :func:`xds.index.affected_by` says what
depends on the difference (its own configuration; the shared cluster and endpoints of the service
it serves; the authorization of destinations whose rules name its identity); the indexes turn
that into the set of nodes to rebuild (the callers of those services, the holders of those
destination identities); the shared resources are rebuilt once, and each affected node's
snapshot is reassembled from them. Nodes without a stream are only marked stale (built on
demand). A renewal changes nothing snapshots are built from and rebuilds nothing.

Endpoints and the trust secret are read through layers (:class:`xds.build.Layer`): a caller's
snapshot holds its group's endpoints layer (every caller of the same services from the same
namespace) and the one trust layer, not their mappings. A service's new endpoints are its
callers' groups' new layer mappings, made once; a new CRL, the trust layer's. The nodes they
concern are then only woken (their streams read the layers when they push); only what is a
node's own is patched into its snapshot: the outbound clusters of a service whose pinned
identities changed, the inbound routes of a destination whose authorization changed. So a
quarantine costs each caller a wake and a push, not a patched snapshot.

Trust material (bundle + CRL) and mesh policies are shared by every node: a change of either
touches every node, but the secret or route tables are still built once.

Who hears first follows what changed, not the size of the mesh. The nodes whose configuration
takes something back (a workload's own configuration; the callers of a service an endpoint or
identity left; the destinations whose rules admitted an identity that changed, with the new
CRL; everyone, for a mesh policy change) form the first wave; changes that only grant (a new
endpoint, a newly admitted caller) and the coalesced CRL fan-out follow. The first wave's held
snapshots are patched and their streams woken at once (interleaving them with the ACKs of the
earlier ones would about double the time to the last of them), right after the streams of
the nodes rebuilt (a quarantined workload's own, refused at once, on the turn before); the
rest ``CHUNK`` nodes at a time, each chunk on the next turn of the event loop (``soon``), so
between chunks the loop serves ACKs, /healthz and the API. A node asked for before its turn
is brought up to date first (the cache's ``settle``): nobody reads a snapshot older than the
state last published.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from xds.build import (
    BuildSettings,
    Packer,
    SharedResources,
    Snapshot,
    TrustMaterial,
    build_node_snapshot,
)
from xds.cache import SnapshotCache
from xds.index import Identity, MeshIndex, affected_by, changed_names, principal_of
from xds.meshpolicy import MeshPolicy, destinations_by_source
from xds.resources import INBOUND_ROUTE, TypeUrl, outbound_name
from xds.state import Event, EventKind, MeshState, Registration, ServiceKey, Status, resolve_service

log = logging.getLogger(__name__)

CHUNK = 64
"""Held snapshots patched (and their streams woken) per turn of the event loop: at ~0.2 ms of
sending per woken stream, about 13 ms before the loop serves other I/O again."""

Soon = Callable[[Callable[[], None]], object]
_NO_SERVICES: frozenset[ServiceKey] = frozenset()
_NO_CHANGES: dict[TypeUrl, dict[str, bytes]] = {}  # never written to


class _Refresh:
    """What a held snapshot still has to take from the shared resources (read when it is
    patched, so a refresh queued by an older publish brings the newest value): the outbound
    clusters of ``services``, the inbound routes if ``routes``; nothing (``_WAKE``):
    only its streams woken, for a layer it reads. Never changed once made: one is shared by
    every node queued with the same needs. A node whose rules or clusters change may start
    to accept an identity, and must not do so with a CRL older than the state it was patched
    to: the trust secret is a layer every snapshot reads, never older than the last
    published (it costs nothing to send when it is the one the node holds)."""

    __slots__ = ("routes", "services")

    def __init__(self, services: frozenset[ServiceKey], routes: bool) -> None:
        self.services = services
        self.routes = routes

    def merged(self, other: _Refresh) -> _Refresh:
        """What both need (``self`` if it covers ``other``)."""
        if (not other.services or other.services <= self.services) and (
            self.routes or not other.routes
        ):
            return self
        return _Refresh(self.services | other.services, self.routes or other.routes)


_WAKE = _Refresh(_NO_SERVICES, False)


def _running_loop_soon() -> Soon | None:
    """The running event loop's ``call_soon`` (None: no loop runs, patch everything now)."""
    try:
        return asyncio.get_running_loop().call_soon
    except RuntimeError:
        return None


class XdsPublisher:
    """Announces persisted state as per-node xDS snapshots, rebuilding only what changed."""

    def __init__(
        self,
        cache: SnapshotCache,
        settings: BuildSettings | None = None,
        defer: Callable[[Callable[[], None]], object] | None = None,
        soon: Soon | None = None,
        chunk: int = CHUNK,
    ) -> None:
        """``defer(fn)`` runs ``fn`` a little later (e.g. ``loop.call_later``): the fan-out of
        CRL changes to nodes that do not need them at once is coalesced through it. None:
        every change reaches every node at once. ``soon(fn)`` runs ``fn`` on the next turn of
        the event loop (default: the running loop's ``call_soon``; none running: at once):
        held snapshots after the first ``chunk`` are patched through it."""
        self._cache = cache
        self._defer = defer
        self._soon = soon
        self._chunk = max(1, chunk)
        self._fanout_pending = False
        self.fanned_out = 0
        # held snapshots still to patch, in the order their streams are woken (first wave,
        # then the rest); dicts keep insertion order and drop a node in O(1)
        self._first: dict[str, _Refresh] = {}
        self._rest: dict[str, _Refresh] = {}
        # their order (a dict's first key is O(holes) to find after many pops: a deque)
        self._first_order: deque[str] = deque()
        self._rest_order: deque[str] = deque()
        self._scheduled: object | None = None  # the token of the next chunk's callback
        self._settings = settings or BuildSettings()
        self._packer = Packer()
        self._state: MeshState | None = None
        self._shared: SharedResources | None = None
        self._by_source: dict[Identity, frozenset[Identity]] = {}
        self.rebuilt_nodes = 0  # nodes rebuilt by the last publish (benchmarks, tests)
        self.patched_nodes = 0  # held snapshots patched with new shared resources
        self.woken_nodes = 0  # held nodes woken for what they read changed (patched or not)
        self.wake_order: list[str] = []  # nodes woken (patched or not), in order (tests)
        cache.set_source(self._build)
        cache.set_settle(self._settle)

    @property
    def index(self) -> MeshIndex | None:
        return None if self._shared is None else self._shared.index

    def _build(self, node: str) -> Snapshot | None:
        shared = self._shared
        if shared is None or shared.index.get(node) is None:
            return None
        return build_node_snapshot(shared, node)

    def publish(
        self,
        state: MeshState,
        mesh_policies: Sequence[MeshPolicy],
        trust: TrustMaterial,
        changed: Iterable[str] | None = None,
    ) -> None:
        """Announce ``state``. ``changed`` names the workloads that differ from the state last
        published (None: find out by comparing records, which costs a pass over the mesh)."""
        shared = self._shared
        previous = self._state
        if shared is None or previous is None or previous.trust_domain != state.trust_domain:
            self._reset(state, mesh_policies, trust)
            return
        names = (
            changed_names(previous.workloads, state.workloads) if changed is None else set(changed)
        )
        index = shared.index
        nodes: set[str] = set()
        gone: set[str] = set()
        services: set[ServiceKey] = set()
        destinations: set[Identity] = set()
        urgent_services: set[ServiceKey] = set()
        urgent_destinations: set[Identity] = set()
        for name in names:
            new = state.workloads.get(name)
            old = index.put(name, new)
            if old is None and new is None:
                continue
            affected = affected_by(old, new, state.trust_domain)
            if new is None:
                gone.add(name)
            elif affected.own:
                nodes.add(name)
            services |= affected.services
            found: set[Identity] = set()
            for principal in affected.principals:
                found |= self._by_source.get(principal, frozenset())
            destinations |= found
            if affected.withdraws:
                urgent_services |= affected.services
                urgent_destinations |= found
        self._state = state
        policies_changed = tuple(mesh_policies) != shared.mesh_policies
        if policies_changed:
            shared.set_mesh_policies(mesh_policies)
            self._by_source = destinations_by_source(mesh_policies, state.trust_domain)
        trust_changed = trust != shared.trust
        # a new bundle (a CA rotation) must be everywhere before certificates of the new CA
        # are presented: it is never deferred
        bundle_changed = trust_changed and trust.bundle_pem != shared.trust.bundle_pem
        if trust_changed:
            shared.set_trust(trust)  # (its layer: every snapshot reads the new secret now)
        built = {s: shared.clusters_of(s) for s in services}
        shared.invalidate_services(services)
        # the callers' endpoints, through their groups' layers (who hears of it first is the
        # order in which they are woken, below)
        shared.refresh_endpoint_layers(services)
        # the services whose outbound clusters changed (the identities they pin): patched
        # into every caller's snapshot; a change of endpoints alone only wakes the callers
        reclustered = frozenset(
            s
            for s, before in built.items()
            if any(shared.outbound_cluster(s, spelled) is not b for spelled, b in before.items())
        )
        shared.invalidate_routes(destinations)
        for name in gone:
            self._cache.clear_snapshot(name)
            self._drop(name)
        # Nodes whose own configuration changed are rebuilt (from the current state: nothing
        # queued for them is needed any more) and their streams woken first.
        for name in nodes:
            self._drop(name)
        self._cache.invalidate(nodes)
        self.rebuilt_nodes = len(nodes)
        self.patched_nodes = self.woken_nodes = 0
        self.wake_order = []
        # The others that depend on what changed are woken, with what is their own patched
        # into the snapshot they hold (clusters, routes; endpoints and the CRL they read
        # through layers, current whenever read). A new CRL goes at once to the nodes that
        # could accept a certificate it revokes: those whose rules admit an
        # identity that just changed, and the callers of a service an identity left (they
        # accept its members' certificates as servers). Every other node denies the identity
        # anyway; it sends the CRL with the next push it makes for any other reason (before
        # its rules or clusters could admit the identity), or when the coalesced fan-out
        # (``defer``) wakes it, which only keeps every node's CRL fresh.
        everyone = bundle_changed or (trust_changed and self._defer is None)
        holders = index.holders_of(destinations)
        first = index.holders_of(urgent_destinations)
        if trust_changed:
            first |= holders
        first |= index.callers_of(urgent_services)
        if everyone or policies_changed:
            # every held node; a policy change may take a permission back: all first
            first |= {n for n in self._cache.held() if n not in nodes}
            rest: set[str] = set()
        else:
            rest = index.callers_of(services - urgent_services) | holders
        first -= nodes
        rest -= nodes | first
        changed_services = reclustered
        # the refreshes queued, one per combination of needs (shared by the nodes queued)
        first_holder = _Refresh(changed_services, True)
        first_other = _Refresh(changed_services, policies_changed)
        quiet = not (self._first or self._rest)  # (the four sets are disjoint)
        self._queue_all(self._first, first & holders, first_holder, quiet)
        self._queue_all(self._first, first - holders, first_other, quiet)
        rest_other = _Refresh(changed_services, False)
        self._queue_all(self._rest, rest & holders, first_holder, quiet)
        self._queue_all(self._rest, rest - holders, rest_other, quiet)
        if trust_changed and not everyone:
            self._schedule_trust_fanout()
        soon = self._soon or _running_loop_soon()
        if soon is not None and self._first and any(self._cache.watching(n) for n in nodes):
            # the rebuilt nodes' streams were woken first (a quarantined workload's own stream
            # is refused with a configuration admitting nobody): let them send before the
            # first wave is patched, on the next turn
            self._later(soon)
        else:
            self._pump()

    def _queue_all(
        self, queue: dict[str, _Refresh], nodes: set[str], needs: _Refresh, quiet: bool
    ) -> None:
        """``_queue`` each of ``nodes``; in bulk, without a call per node, when none of them
        can be queued already (``quiet``: nothing was queued before this publish, which
        queues each node once)."""
        if not nodes:
            return
        if not quiet:
            for node in nodes:
                self._queue(queue, node, needs)
            return
        nodes = self._cache.held_among(nodes)
        queue.update(dict.fromkeys(nodes, needs))
        (self._first_order if queue is self._first else self._rest_order).extend(nodes)

    def _queue(
        self,
        queue: dict[str, _Refresh],
        node: str,
        needs: _Refresh,
    ) -> None:
        """Queue ``node``'s held snapshot for a patch (nothing held: it is built from the
        current state when asked for). A node already queued keeps its place (in the first
        wave if it is in either)."""
        if not self._cache.has(node):
            return
        refresh = self._first.get(node)
        if refresh is None:
            refresh = self._rest.get(node)
            if refresh is not None and queue is self._first:
                del self._rest[node]
                self._first[node] = refresh
                self._first_order.append(node)
        if refresh is None:
            queue[node] = needs
            (self._first_order if queue is self._first else self._rest_order).append(node)
        else:
            where = self._first if node in self._first else self._rest
            where[node] = refresh.merged(needs)

    def _drop(self, node: str) -> None:
        self._first.pop(node, None)
        self._rest.pop(node, None)

    def _take(self, limit: int) -> dict[str, _Refresh]:
        out: dict[str, _Refresh] = {}
        for queue, order in ((self._first, self._first_order), (self._rest, self._rest_order)):
            while queue and len(out) < limit:
                node = order.popleft()  # names dropped or settled since are skipped
                refresh = queue.pop(node, None)
                if refresh is not None:
                    out[node] = refresh
            if not queue:
                order.clear()
        return out

    def _pump(self) -> None:
        """Patch the whole first wave and the next ``chunk`` of the rest, and wake their
        streams; the next chunk on the next turn of the loop (no loop: all of them now)."""
        soon = self._soon or _running_loop_soon()
        if self._first:  # what takes something back: all of it at once
            batch, self._first = self._first, {}
            self._first_order.clear()
            self._patch(batch)
        while True:
            self._patch(self._take(self._chunk))
            if not (self._first or self._rest):
                return
            if soon is not None:
                break
        self._later(soon)

    def _later(self, soon: Soon) -> None:
        """Pump on the next turn of the loop (one chain of callbacks, however many asked)."""
        if self._scheduled is None:
            token = self._scheduled = object()
            soon(lambda: self._next_chunk(token))

    def _next_chunk(self, token: object) -> None:
        if token is self._scheduled:  # not a chain a reset (or a newer one) replaced
            self._scheduled = None
            self._pump()

    def _settle(self, node: str) -> None:
        """The cache is about to read ``node``: apply what is queued for it now."""
        refresh = self._first.pop(node, None) or self._rest.pop(node, None)
        if refresh is not None:  # (read now: its streams are woken only if it changed)
            self._patch({node: refresh}, wake_all=False)

    def _patch(self, batch: dict[str, _Refresh], wake_all: bool = True) -> None:
        """Patch what the nodes of ``batch`` still have to take into their held snapshots
        and wake their streams (with ``wake_all``, those whose snapshot did not change too: a
        layer they read did)."""
        shared = self._shared
        if shared is None or not batch:
            return
        workload = shared.index.workloads.get  # (MeshIndex.get, without the call per node)
        # the clusters a node takes: the same for every node calling the same services from
        # the same namespace (every caller of a service), looked up once
        per_services: dict[object, dict[TypeUrl, dict[str, bytes]]] = {}

        def services_part(
            reg: Registration, services: frozenset[ServiceKey], key: object
        ) -> dict[TypeUrl, dict[str, bytes]]:
            hit = per_services[key] = {}
            for spelled in reg.outbound:
                service = resolve_service(reg.namespace, spelled)
                if service in services:
                    hit.setdefault(TypeUrl.CLUSTER, {})[outbound_name(spelled)] = (
                        shared.outbound_cluster(service, spelled)
                    )
            return hit

        # what a node with clusters and routes to take gets: one dict per combination
        with_more: dict[tuple[int, bytes], dict[TypeUrl, dict[str, bytes]]] = {}
        wake = self.wake_order.append
        patched = woken = 0

        def patch(node: str, snapshot: Snapshot) -> Snapshot:
            """The node's clusters and routes patched (its endpoints and the trust secret are
            read through layers: nothing to patch, only to wake, as ``update`` does)."""
            nonlocal patched, woken
            woken += 1
            wake(node)
            refresh = batch[node]
            services = refresh.services
            if not services and not refresh.routes:
                return snapshot  # a layer it reads changed (the CRL fan-out, endpoints)
            w = workload(node)
            if w is None:
                return snapshot
            reg = w.registration
            changes: dict[TypeUrl, dict[str, bytes]] = _NO_CHANGES
            if services and reg.outbound:
                part = (reg.namespace, tuple(reg.outbound), services)
                hit = per_services.get(part)
                changes = services_part(reg, services, part) if hit is None else hit
            if refresh.routes and w.status is Status.ATTESTED:
                routes = shared.inbound_routes(principal_of(reg))
                key = (id(changes), routes)
                more = with_more.get(key)
                if more is None:
                    more = with_more[key] = {**changes, TypeUrl.ROUTE: {INBOUND_ROUTE: routes}}
                changes = more
            new = snapshot.patched(changes) if changes else snapshot
            patched += new is not snapshot
            return new

        try:
            self._cache.update(batch, patch, wake_all=wake_all)
        finally:
            self.patched_nodes += patched
            self.woken_nodes += woken

    def _schedule_trust_fanout(self) -> None:
        if self._defer is not None and not self._fanout_pending:
            self._fanout_pending = True
            self._defer(self.flush_trust)

    def flush_trust(self) -> None:
        """Wake every held node's streams for the current trust secret (the coalesced fan-out
        of CRL changes: many revocations in a burst cost every stream one push; the secret is
        the trust layer's, nothing to patch), after whatever is queued already, a chunk per
        turn of the loop."""
        self._fanout_pending = False
        if self._shared is None:
            return
        before = self.woken_nodes
        first, rest, order = self._first, self._rest, self._rest_order
        if not first and not rest:  # nothing queued (the usual case): in bulk
            held = list(self._cache.held())
            rest.update(dict.fromkeys(held, _WAKE))
            order.extend(held)
        else:
            for node in self._cache.held():  # held nodes only: no check per node
                refresh = first.get(node)
                if refresh is not None:
                    first[node] = refresh.merged(_WAKE)
                    continue
                refresh = rest.get(node)
                if refresh is None:
                    rest[node] = _WAKE
                    order.append(node)
                else:
                    rest[node] = refresh.merged(_WAKE)
        self._pump()
        self.fanned_out = self.woken_nodes - before  # woken so far (all of them: no loop)

    def _reset(
        self, state: MeshState, mesh_policies: Sequence[MeshPolicy], trust: TrustMaterial
    ) -> None:
        self._shared = SharedResources(
            MeshIndex.of(state), mesh_policies, trust, self._settings, self._packer
        )
        self._by_source = destinations_by_source(mesh_policies, state.trust_domain)
        self._state = state
        self._first.clear()
        self._rest.clear()
        self._first_order.clear()
        self._rest_order.clear()
        self._scheduled = None
        self.rebuilt_nodes = len(state.workloads)
        for node in self._cache.nodes() - set(state.workloads):
            self._cache.clear_snapshot(node)
        self._cache.invalidate_all()

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None:
        for e in events:
            # an attestation is routine (about 2 an hour per workload: at 10,000 workloads
            # several a second; every event is kept in the store and served by the ops API):
            # logged at DEBUG; every other transition at INFO
            level = logging.DEBUG if e.kind is EventKind.ATTESTED else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, "event %s %s %s", e.kind, e.workload, e.reason)


__all__ = ["XdsPublisher"]
