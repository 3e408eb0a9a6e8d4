"""The incremental publisher: persisted mesh state -> the snapshots of the nodes it changes.

A change names the workloads it touched. For each, :func:`xds.index.affected_by` says what
depends on the difference (its own configuration; the shared cluster and endpoints of the service
it serves; the authorization of destinations whose rules name its identity); the indexes turn
that into the set of nodes to rebuild (the callers of those services, the holders of those
destination identities); the shared resources are rebuilt once, and each affected node's
snapshot is reassembled from them. Nodes without a stream are only marked stale (built on
demand). A renewal changes nothing snapshots are built from and rebuilds nothing.

Trust material (bundle + CRL) and mesh policies are shared by every node: a change of either
touches every node, but the secret or route tables are still built once.
"""

from __future__ import annotations

import logging
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
from xds.resources import INBOUND_ROUTE, MESH_TRUST, TypeUrl, outbound_name
from xds.state import Event, MeshState, ServiceKey, Status, resolve_service

log = logging.getLogger(__name__)


class XdsPublisher:
    """Announces persisted state as per-node xDS snapshots, rebuilding only what changed."""

    def __init__(
        self,
        cache: SnapshotCache,
        settings: BuildSettings | None = None,
        defer: Callable[[Callable[[], None]], object] | None = None,
    ) -> None:
        """``defer(fn)`` runs ``fn`` a little later (e.g. ``loop.call_later``): the fan-out of
        CRL changes to nodes that do not need them at once is coalesced through it. None:
        every change reaches every node at once."""
        self._cache = cache
        self._defer = defer
        self._fanout_pending = False
        self.fanned_out = 0
        self._settings = settings or BuildSettings()
        self._packer = Packer()
        self._state: MeshState | None = None
        self._shared: SharedResources | None = None
        self._by_source: dict[Identity, frozenset[Identity]] = {}
        self.rebuilt_nodes = 0  # nodes rebuilt by the last publish (benchmarks, tests)
        self.patched_nodes = 0  # held snapshots patched with new shared resources
        cache.set_source(self._build)

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
            for principal in affected.principals:
                destinations |= self._by_source.get(principal, frozenset())
        self._state = state
        policies_changed = tuple(mesh_policies) != shared.mesh_policies
        if policies_changed:
            shared.set_mesh_policies(mesh_policies)
            self._by_source = destinations_by_source(mesh_policies, state.trust_domain)
        trust_changed = trust != shared.trust
        if trust_changed:
            shared.set_trust(trust)
        shared.invalidate_services(services)
        shared.invalidate_routes(destinations)
        for name in gone:
            self._cache.clear_snapshot(name)
        # Nodes whose own configuration changed are rebuilt; the others that depend on what
        # changed get the new shared resources patched into the snapshot they hold.
        self._cache.invalidate(nodes)
        # A new CRL goes at once to the nodes whose rules admit an identity that just changed
        # (they could accept its revoked certificate); every other node denies it by RBAC
        # anyway and gets the CRL with the next coalesced fan-out (``defer``).
        everyone = trust_changed and self._defer is None
        if everyone or policies_changed:
            patch_nodes: Iterable[str] = [n for n in self._cache.held() if n not in nodes]
        else:
            patch_nodes = (index.callers_of(services) | index.holders_of(destinations)) - nodes
        urgent = index.holders_of(destinations) if trust_changed else set()
        self.rebuilt_nodes = len(nodes)
        self.patched_nodes = 0
        secret = shared.trust_secret() if trust_changed else None
        all_routes = policies_changed
        if trust_changed and not everyone:
            self._schedule_trust_fanout()

        def patch(node: str, snapshot: Snapshot) -> Snapshot:
            w = index.get(node)
            if w is None:
                return snapshot
            reg = w.registration
            attested = w.status is Status.ATTESTED
            changes: dict[TypeUrl, dict[str, bytes]] = {}
            for spelled in reg.outbound:
                key = resolve_service(reg.namespace, spelled)
                if key not in services:
                    continue
                name = outbound_name(spelled)
                cluster = shared.outbound_cluster(key, spelled)
                changes.setdefault(TypeUrl.CLUSTER, {})[name] = cluster
                if attested:
                    eds = shared.endpoints(key, spelled)
                    changes.setdefault(TypeUrl.ENDPOINT, {})[name] = eds
            if attested:
                principal = principal_of(reg)
                if all_routes or principal in destinations:
                    changes[TypeUrl.ROUTE] = {INBOUND_ROUTE: shared.inbound_routes(principal)}
            if secret is not None and (everyone or node in urgent):
                changes[TypeUrl.SECRET] = {MESH_TRUST: secret}
            new = snapshot.patched(changes) if changes else snapshot
            self.patched_nodes += new is not snapshot
            return new

        self._cache.update(patch_nodes, patch)

    def _schedule_trust_fanout(self) -> None:
        if self._defer is not None and not self._fanout_pending:
            self._fanout_pending = True
            self._defer(self.flush_trust)

    def flush_trust(self) -> None:
        """Patch the current trust secret into every held snapshot (the coalesced fan-out of
        CRL changes: many revocations in a burst cost every stream one push)."""
        self._fanout_pending = False
        shared = self._shared
        if shared is None:
            return
        secret = shared.trust_secret()
        changes = {TypeUrl.SECRET: {MESH_TRUST: secret}}
        self.fanned_out = 0

        def patch(node: str, snapshot: Snapshot) -> Snapshot:
            new = snapshot.patched(changes)
            self.fanned_out += new is not snapshot
            return new

        self._cache.update(list(self._cache.held()), patch)

    def _reset(
        self, state: MeshState, mesh_policies: Sequence[MeshPolicy], trust: TrustMaterial
    ) -> None:
        self._shared = SharedResources(
            MeshIndex.of(state), mesh_policies, trust, self._settings, self._packer
        )
        self._by_source = destinations_by_source(mesh_policies, state.trust_domain)
        self._state = state
        self.rebuilt_nodes = len(state.workloads)
        for node in self._cache.nodes() - set(state.workloads):
            self._cache.clear_snapshot(node)
        self._cache.invalidate_all()

    def on_events(self, state: MeshState, events: Sequence[Event]) -> None:
        for e in events:
            log.info("event %s %s %s", e.kind, e.workload, e.reason)


__all__ = ["XdsPublisher"]
