"""ADS, state-of-the-world and incremental (delta): snapshots from the cache to each Envoy's
stream.

The protocol logic lives in :class:`AdsSession` (SotW) and :class:`DeltaSession` (delta); both
take requests in and give encoded responses out, with no I/O, so they are tested with plain
values. :class:`AdsServer` holds what both RPCs are served from (one cache, one ``authorize``
callback, the metrics) and is the grpclib service (the fallback transport); the control plane
serves it through :mod:`xds.adsconn`, a lean HTTP/2 transport of our own (:mod:`xds.h2conn`),
which only moves bytes between the connection, a session and the cache's watch.

Rules, each learnt from a real Envoy (see ENVOY-NOTES):

- LDS/CDS are wildcards; EDS/RDS/SDS are answered for the subscribed names, and again whenever the
  subscribed set changes (Envoy subscribes SDS names incrementally, before any response).
- A request is a NACK only when it carries an error *and* its version differs from the version
  sent under its nonce (Envoy may repeat a stale error_detail on a later ACK).
- After every CDS response the next EDS request is answered even if it looks like an ACK: Envoy
  re-requests EDS with the old nonce when CDS changed an EDS cluster, and a silent server leaves
  that cluster warming until ``initial_fetch_timeout``.
- Several pending types go out in ADS order (SDS, CDS, EDS, LDS, RDS).

Delta (``DeltaAggregatedResources``), per stream and type:

- Subscriptions: ``*`` (or, for CDS/LDS, an empty first request) is the wildcard; other names
  are explicit. A name subscribed again is answered again whatever the server believes the
  client holds (the protocol says the client may have forgotten it). Unsubscribing needs no
  answer. A new wildcard is answered even when empty (Envoy waits for it to initialise).
- An updated EDS cluster warms only on an EDS response, and Envoy 1.40 on delta does not ask
  for it again (the name stays subscribed; a silent server leaves the cluster warming and the
  CDS ACK held for ``initial_fetch_timeout``): after a CDS response the EDS resources of the
  clusters it updated are sent unasked, also when (on a new stream) the CDS answer went out
  before the EDS request stating the version the client holds.
- The server keeps, per name, the version it last gave the client (``initial_resource_versions``
  on a new stream) and sends only resources whose version differs, plus ``removed_resources``
  for names the client holds that no longer exist (and for subscribed names that do not exist).
  Versions are content hashes of the packed bytes (:class:`ResourceVersions`), so they survive
  a control-plane restart.
- A change costs, per stream and type, one comparison of the snapshot's per-type version (or
  mapping identity); only when that differs are the resources compared, one memoized version
  lookup each. Streams hold references to the shared bytes, never copies. Nonces come from
  one increasing count for the process (unique on each stream), so the streams sent the same
  change are sent the very same response bytes, nonce and all (:func:`_numbered_response`).
  Streams at the same point (the same explicit names, holding the versions of the same shared
  per-type mapping, nothing rejected) share the diff to a new mapping too: it is made once
  and kept on the point (:class:`_Point`), so the other callers of a changed service cost a
  lookup each. A NACK or a subscription change takes a stream off its point until its next
  diff; names owed are part of the key.
- A NACK (``error_detail`` set) is counted and logged. The client kept what it had, so the
  server's record of it is rolled back to before that response; the rejected versions are not
  offered again (no resend loop): a resource goes out again once it changes (or is asked for).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import grpclib.const
import grpclib.server
from grpclib.exceptions import GRPCError, StreamTerminatedError
from mypy_extensions import mypyc_attr
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb, sync_status
from xds.build import (
    Packer,
    ResourceVersions,
    Snapshot,
    TrustMaterial,
    build_snapshot,
    content_version,
    resource_version,
)
from xds.cache import SnapshotCache
from xds.resources import ADS_ORDER, ADS_SERVICE, WILDCARD_TYPES, TypeUrl
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    record_attestation,
    register,
)

with warnings.catch_warnings():
    # generated code uses a pydantic 2.12-deprecated validator form; harmless, noisy
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
        DiscoveryRequest,
        DiscoveryResponse,
    )

log = logging.getLogger(__name__)

_NONCES_KEPT = 8
_TYPE_URLS: dict[str, TypeUrl] = {t.value: t for t in TypeUrl}
_NOTHING: Mapping[str, bytes] = MappingProxyType({})


class XdsMetrics(Protocol):
    """What xDS streams count (the composition root's metrics provide it; ``type_short`` is
    ``TypeUrl.short``, a bounded label)."""

    def xds_nack(self, type_short: str) -> None: ...

    def xds_acked(self, type_short: str, seconds: float) -> None:
        """A response was ACKed ``seconds`` after it was sent."""

    def xds_stream(self, delta: int) -> None:
        """A stream opened (+1) or closed (-1)."""


class _Uncounted:
    def xds_nack(self, type_short: str) -> None:
        pass

    def xds_acked(self, type_short: str, seconds: float) -> None:
        pass

    def xds_stream(self, delta: int) -> None:
        pass


UNCOUNTED: XdsMetrics = _Uncounted()


@dataclass(slots=True)
class _Sent:
    version: str
    at: float
    acked: bool = False
    nacked: bool = False  # for xds.sync_status


@dataclass(slots=True)
class _TypeState:
    subscribed: bool = False
    names: frozenset[str] = frozenset()
    sent_version: str | None = None
    sent_names: frozenset[str] | None = None
    sent: dict[str, _Sent] = field(default_factory=dict)
    force: bool = False
    eds_after_cds: bool = False


class AdsSession:
    """The protocol state of one ADS stream. Feed it requests, ask it for responses."""

    def __init__(self, node: str, metrics: XdsMetrics, clock: Callable[[], float]) -> None:
        self.node = node
        self._metrics = metrics
        self._clock = clock
        self._types = {t: _TypeState() for t in TypeUrl}
        self._nonce = 0
        self.nacks: list[tuple[TypeUrl, str]] = []  # (type, Envoy's message), newest last

    def on_request(self, req: DiscoveryRequest) -> bool:
        """Take in a request; False when it cannot make anything due (an ACK or NACK of the
        names already subscribed): the stream need not look for responses."""
        try:
            type_url = TypeUrl(req.type_url)
        except ValueError:
            log.warning("node %s requested unsupported type %r", self.node, req.type_url)
            return False
        st = self._types[type_url]
        before = (st.subscribed, st.names)
        st.subscribed = True
        if type_url not in WILDCARD_TYPES:
            st.names = frozenset(req.resource_names)
        if not req.response_nonce:
            st.force = True  # initial request on this stream: always answered
        else:
            sent = st.sent.get(req.response_nonce)
            if sent is not None:
                self._classify(type_url, req, sent)
        if st.eds_after_cds:
            st.eds_after_cds = False
            st.force = True
        return st.force or before != (st.subscribed, st.names)

    def _classify(self, type_url: TypeUrl, req: DiscoveryRequest, sent: _Sent) -> None:
        if req.error_detail is not None and req.version_info != sent.version:
            message = req.error_detail.message
            sent.nacked = True
            self._metrics.xds_nack(type_url.short)
            self.nacks.append((type_url, message))
            del self.nacks[:-16]
            log.warning(
                "node %s rejected %s %s: %s", self.node, type_url.short, sent.version, message
            )
        elif not sent.acked:
            sent.acked = True
            self._metrics.xds_acked(type_url.short, max(0.0, self._clock() - sent.at))

    def responses(self, snapshot: Snapshot) -> Iterator[bytes]:
        """Encoded DiscoveryResponses now due, in ADS order (a generator: state advances as each
        one is taken, so a send that fails leaves the rest pending)."""
        for type_url in ADS_ORDER:
            st = self._types[type_url]
            if not st.subscribed:
                continue
            available = snapshot.get(type_url)
            if type_url in WILDCARD_TYPES:
                chosen = dict(available)
                version = snapshot.version(type_url)
            else:
                chosen = {n: available[n] for n in sorted(st.names) if n in available}
                version = content_version(chosen)
            names = frozenset(chosen) if type_url in WILDCARD_TYPES else st.names
            if not st.force and version == st.sent_version and names == st.sent_names:
                continue
            self._nonce += 1
            nonce = str(self._nonce)
            st.force = False
            st.sent_version, st.sent_names = version, names
            st.sent[nonce] = _Sent(version, self._clock())
            if len(st.sent) > _NONCES_KEPT:
                del st.sent[next(iter(st.sent))]
            if type_url is TypeUrl.CLUSTER:
                self._types[TypeUrl.ENDPOINT].eds_after_cds = True
            yield pb.encode_discovery_response(version, type_url, nonce, chosen.values())


VersionOf = Callable[[bytes], str]
"""The version of one packed resource (a content hash, stable across processes)."""


@dataclass(slots=True)
class _DeltaSent:
    at: float
    # what the response did, to undo on a NACK: (name, version before, version after; None =
    # not held)
    changes: tuple[tuple[str, str | None, str | None], ...] = ()


_NO_SENT: dict[str, _DeltaSent] = {}
"""What ``sent`` is while nothing awaits an ACK (shared, never written: a dict of its own is
made for the first response; ~80 bytes per stream and type)."""

_NO_HAVE: dict[str, str] = {}
"""What ``have`` starts as (shared, read-only like a point's dict: ``_have_of`` copies it before
a write; ~64 bytes per stream and type)."""

_NO_NAMES: frozenset[str] = frozenset()
"""What ``names`` and ``due`` start as (shared; a set of their own once something is added: an
empty set is ~200 bytes, per stream and type)."""


@dataclass(slots=True)
class _DeltaType:
    wildcard: bool = False
    names: AbstractSet[str] = _NO_NAMES  # explicit subscriptions
    # name -> version last given to the client (or reported by it on a new stream); while
    # ``shared``, the dict of ``point`` (``_Point.have``), read-only: see _have_of
    have: dict[str, str] = field(default_factory=lambda: _NO_HAVE)
    shared: bool = True  # (the shared empty dict, until something is held)
    due: AbstractSet[str] = _NO_NAMES  # answer about these whatever their version
    rejected: dict[str, str] | None = None  # name -> version the client NACKed
    answer: bool = False  # answer the next diff even if it is empty (a new wildcard)
    seen: Mapping[str, bytes] | None = None  # the snapshot mapping last diffed, and its version
    seen_version: str = ""
    sent: dict[str, _DeltaSent] = field(default_factory=lambda: _NO_SENT)
    # set only while ``have`` is exactly what ``point`` says (see _Point); None: unknown
    point: _Point | None = None


def _names_of(st: _DeltaType) -> set[str]:
    names = st.names
    if type(names) is not set:
        names = st.names = set(names)
    return names


def _have_of(st: _DeltaType) -> dict[str, str]:
    """``st.have``, to be written: a copy of its own first if it is a point's."""
    have = st.have
    if st.shared:
        have = st.have = dict(have)
        st.shared = False
    return have


def _due_of(st: _DeltaType) -> set[str]:
    due = st.due
    if type(due) is not set:
        due = st.due = set(due)
    return due


@mypyc_attr(native_class=False)  # (make native, xds.native: a weak reference's target)
class _Point:
    """Where explicitly subscribed streams stand for one type: subscribed to ``names``, holding
    the version of each of those names in ``mapping`` (the snapshot's shared per-type mapping
    they were last answered from), nothing rejected. Streams at the same point given the same
    new mapping are sent the same answer, so the diff is made once and kept in ``steps``
    (every caller of a service holds one EDS mapping and is moved to one new one: the 2nd to
    the 5,000th stream cost a lookup, not a diff). Interned in :data:`_points` while a stream
    stands on it."""

    __slots__ = ("__weakref__", "have", "key", "mapping", "names", "steps", "type_url", "versions")

    def __init__(
        self,
        key: tuple[object, ...],
        type_url: TypeUrl,
        mapping: Mapping[str, bytes],
        names: frozenset[str],
        versions: VersionOf,
    ) -> None:
        self.key = key
        self.type_url = type_url
        self.mapping = mapping  # held: the ids in the keys stay this mapping's
        self.names = names
        self.versions = versions
        # (id(new mapping), due names or None, answer) -> the answer from here to there
        self.steps: dict[tuple[object, ...], _Step] = {}
        # name -> version for the names here: the ``have`` of every stream standing here (the
        # first stream's own dict, then shared read-only; None until a stream gets here)
        self.have: dict[str, str] | None = None


class _Step:
    """One diff made from a point: what it sends and what it changes (shared read-only by the
    streams that take it), and the point it leads to."""

    __slots__ = ("after", "changed", "changes", "mapping", "names", "numbered", "removed")

    def __init__(
        self,
        mapping: Mapping[str, bytes],
        names: frozenset[str],
        changed: list[tuple[str, str, bytes]],
        removed: list[str],
        changes: tuple[tuple[str, str | None, str | None], ...],
        after: _Point,
        numbered: _Numbered | None,
    ) -> None:
        self.mapping = mapping  # held: the id in the step's key stays this mapping's
        self.names = names
        self.changed = changed
        self.removed = removed
        self.changes = changes  # (name, version before, after), as _DeltaSent keeps them
        self.after: weakref.ref[_Point] = weakref.ref(after)  # not a chain of every change
        self.numbered = numbered  # the pre-framed body (None: framed per stream, or nothing)


_STEPS_KEPT = 4  # steps memoised per point (cleared when full: a few changes in flight)
_points: weakref.WeakValueDictionary[tuple[object, ...], _Point] = weakref.WeakValueDictionary()
"""The points streams stand on, by (type, id(mapping), names, id(versions)); an entry lives
while a stream holds its point (the streams' own references bound it)."""
diffs = 0
"""Diffs made (tests and benchmarks read it: a memoised step makes none)."""


def _point(
    type_url: TypeUrl, mapping: Mapping[str, bytes], names: frozenset[str], versions: VersionOf
) -> _Point:
    key = (type_url, id(mapping), names, id(versions))
    point = _points.get(key)
    if point is None or point.mapping is not mapping or point.versions is not versions:
        point = _points[key] = _Point(key, type_url, mapping, names, versions)
    return point


class DeltaSession:
    """The protocol state of one incremental (delta) ADS stream."""

    def __init__(
        self,
        node: str,
        metrics: XdsMetrics,
        clock: Callable[[], float],
        versions: VersionOf,
    ) -> None:
        self.node = node
        self._metrics = metrics
        self._clock = clock
        self._versions = versions
        self._types: dict[TypeUrl, _DeltaType] = {}  # (answered in ADS_ORDER)
        # clusters CDS updated before EDS was subscribed on this stream (a reconnect: the EDS
        # request, carrying versions the client holds, may come after the CDS answer)
        self._clusters_before_eds: set[str] | None = None
        self._nonce = 0  # the number of the last nonce given (from _nonces: they increase)
        self.nacks: list[tuple[TypeUrl, str]] = []  # (type, Envoy's message), newest last

    def on_request(self, req: DeltaDiscoveryRequest) -> bool:
        """Take in a request; False when it cannot make anything due (an ACK or NACK that
        changes no subscription): the stream need not look for responses."""
        type_url = _TYPE_URLS.get(req.type_url)
        if type_url is None:
            log.warning("node %s requested unsupported type %r", self.node, req.type_url)
            return False
        st = self._types.get(type_url)
        if req.response_nonce and st is not None:
            sent = st.sent.pop(req.response_nonce, None)  # answered once: then forgotten
            if sent is not None:
                if not st.sent:
                    st.sent = _NO_SENT  # an emptied dict keeps its table (~120 bytes more)
                self._classify(type_url, st, req, sent)
        subscribe, unsubscribe = req.resource_names_subscribe, req.resource_names_unsubscribe
        # an ACK or NACK on a known type with no subscription change: nothing becomes due (a
        # NACK's versions are rolled back and not offered again)
        answer = st is None or not req.response_nonce or bool(subscribe or unsubscribe)
        if st is None:
            st = self._types[type_url] = _DeltaType()
            # the legacy wildcard: a first request naming nothing (Envoy's CDS and LDS)
            if not subscribe and not unsubscribe and type_url in WILDCARD_TYPES:
                st.wildcard = st.answer = True
            initial = req.initial_resource_versions
            for name in subscribe:
                if name == "*":
                    st.wildcard = st.answer = True
                    continue
                _names_of(st).add(name)
                if name not in initial:
                    _due_of(st).add(name)  # a name the client holds no version of: answer it
            names = st.names
            if initial:
                st.have = {
                    name: version
                    for name, version in initial.items()
                    if version and (st.wildcard or name in names)
                }
                st.shared = False
            if type_url is TypeUrl.ENDPOINT and self._clusters_before_eds:
                due = self._clusters_before_eds & (st.have.keys() | names)
                if due:
                    _due_of(st).update(due)
                self._clusters_before_eds = None
            subscribe = []
        elif subscribe or unsubscribe:
            st.point = None  # what the client holds or is owed changes
        for name in subscribe:
            if name == "*":
                st.wildcard = st.answer = True
            else:
                _names_of(st).add(name)
                _due_of(st).add(name)  # subscribed (again): the client must get it, or its absence
        for name in unsubscribe:
            if name == "*":
                st.wildcard = False
                st.have = {n: v for n, v in st.have.items() if n in st.names}
                st.shared = False
                continue
            if name in st.names:
                _names_of(st).discard(name)
            if name in st.due:
                _due_of(st).discard(name)
            if st.rejected:
                st.rejected.pop(name, None)
            if st.wildcard:
                _due_of(st).add(name)  # still in the wildcard or not: the client must be told
            else:
                _have_of(st).pop(name, None)
        return answer

    def _classify(
        self, type_url: TypeUrl, st: _DeltaType, req: DeltaDiscoveryRequest, sent: _DeltaSent
    ) -> None:
        if req.error_detail is not None:
            # The client kept what it had: undo what this response changed (unless a later
            # response changed it again), and do not offer the rejected versions again.
            st.point = None
            have = _have_of(st)
            for name, before, after in sent.changes:
                if have.get(name) != after:
                    continue
                if before is None:
                    have.pop(name, None)
                else:
                    have[name] = before
                if after is not None:
                    if st.rejected is None:
                        st.rejected = {}
                    st.rejected[name] = after
            message = req.error_detail.message
            self._metrics.xds_nack(type_url.short)
            self.nacks.append((type_url, message))
            del self.nacks[:-16]
            log.warning(
                "node %s rejected delta %s (nonce %s): %s",
                self.node,
                type_url.short,
                req.response_nonce,
                message,
            )
        else:
            self._metrics.xds_acked(type_url.short, max(0.0, self._clock() - sent.at))

    def _diff(
        self, st: _DeltaType, available: Mapping[str, bytes]
    ) -> tuple[list[tuple[str, str, bytes]], list[str]]:
        version_of = self._versions
        have, due, rejected = st.have, st.due, st.rejected
        changed: list[tuple[str, str, bytes]] = []
        removed: list[str] = []
        if st.wildcard:
            for name, packed in available.items():
                version = version_of(packed)
                if name in due or (
                    have.get(name) != version and (not rejected or rejected.get(name) != version)
                ):
                    changed.append((name, version, packed))
            removed = [n for n in have if n not in available]
            removed.extend(n for n in due if n not in available and n not in have)
        else:
            for name in st.names:
                found = available.get(name)
                if found is None:
                    if name in have or name in due:
                        removed.append(name)
                    continue
                version = version_of(found)
                if name in due or (
                    have.get(name) != version and (not rejected or rejected.get(name) != version)
                ):
                    changed.append((name, version, found))
        return changed, removed

    def _eds_after_cds(self, clusters: list[tuple[str, str, bytes]]) -> None:
        # An updated EDS cluster warms only on an EDS response; with delta, Envoy does not ask
        # again (the name is already subscribed): answer it unasked, right after the CDS one.
        # (The cluster's EDS name is its own name: build sets no eds service_name.)
        eds = self._types.get(TypeUrl.ENDPOINT)
        if eds is None:
            if self._clusters_before_eds is None:
                self._clusters_before_eds = set()
            self._clusters_before_eds.update(name for name, _, _ in clusters)
            return
        for name, _, _ in clusters:
            if name in eds.names or (eds.wildcard and name in eds.have):
                _due_of(eds).add(name)

    def responses(self, snapshot: Snapshot) -> Iterator[bytes]:
        """Encoded DeltaDiscoveryResponses now due, in ADS order (a generator, as in
        :meth:`AdsSession.responses`)."""
        global diffs
        resources, versions, types = snapshot.resources, snapshot.versions, self._types
        for type_url in ADS_ORDER:
            st = types.get(type_url)
            if st is None:
                continue
            available = resources.get(type_url, _NOTHING)
            due, answer = st.due, st.answer
            if available is st.seen and not due and not answer:
                continue  # the common case: a type this change did not touch
            version = versions.get(type_url, "")
            if not due and not answer and version and version == st.seen_version:
                continue
            have = st.have
            point = st.point
            step: _Step | None = None
            key: tuple[object, ...] = ()
            if point is not None:
                # a stream where others stood: the diff from there to ``available`` may be made
                key = (id(available), frozenset(due) if due else None, answer)
                step = point.steps.get(key)
                if step is not None and step.mapping is not available:
                    step = None
            if step is not None:
                changed, removed, changes = step.changed, step.removed, step.changes
                after = step.after()
                if after is None:
                    after = _point(type_url, available, step.names, self._versions)
                    step.after = weakref.ref(after)
                held = after.have
                if held is None:
                    have = _have_of(st)
                    for name, _, given in changes:
                        if given is None:
                            have.pop(name, None)
                        else:
                            have[name] = given
                    after.have = have  # the streams that get here next share it
                else:
                    st.have = held  # what applying ``changes`` would make of ours
                st.shared = True
                numbered = step.numbered
            else:
                diffs += 1
                changed, removed = self._diff(st, available)
                listed: list[tuple[str, str | None, str | None]]
                listed = [(n, have.get(n), v) for n, v, _ in changed]
                if removed:
                    listed.extend((n, have.get(n), None) for n in removed)
                changes = tuple(listed)
                if st.shared and (changed or removed):
                    have = _have_of(st)
                for name, given, _ in changed:
                    have[name] = given
                for name in removed:
                    have.pop(name, None)
                rejected = st.rejected
                if rejected:
                    for name, _, _ in changes:
                        rejected.pop(name, None)
                numbered = None
                if 0 < len(changed) + len(removed) <= _FRAMED_RESOURCES:
                    numbered = _entry(type_url, changed, removed)
                after = None
                if not st.wildcard and not rejected:
                    # ``have`` now holds, for each subscribed name, its version in ``available``
                    names = point.names if point is not None else frozenset(st.names)
                    after = _point(type_url, available, names, self._versions)
                    st.names = after.names  # shared while unchanged (_names_of copies it)
                    # ``have`` is what the point says: the point's dict, shared while unchanged
                    if after.have is None:
                        after.have = have
                    else:
                        st.have = after.have
                    st.shared = True
                    if point is not None:
                        steps = point.steps
                        if len(steps) >= _STEPS_KEPT:
                            steps.clear()
                        steps[key] = _Step(
                            available, names, changed, removed, changes, after, numbered
                        )
            st.point = after
            st.seen, st.seen_version = available, version
            if due:
                st.due = _NO_NAMES
            st.answer = False
            if not changed and not removed and not answer:
                continue
            if type_url is TypeUrl.CLUSTER and changed:
                self._eds_after_cds(changed)
            if (
                numbered is not None
                and numbered.number > self._nonce
                and numbered.version == version
            ):
                # the response framed for the streams sent this change before (the usual case)
                number, message, nonce = numbered.number, numbered.message, numbered.nonce
            else:
                number, message, nonce = _numbered_response(
                    self._nonce, version, type_url, changed, removed, numbered
                )
            self._nonce = number
            sent = st.sent
            if sent is _NO_SENT:
                sent = st.sent = {}
            sent[nonce] = _DeltaSent(self._clock(), changes)
            if len(sent) > _NONCES_KEPT:
                del sent[next(iter(sent))]
            yield message


_FRAMED_MAX = 512  # distinct pre-framed delta bodies kept (cleared when full)
_FRAMED_RESOURCES = 16  # responses with more resources are framed per stream (a first answer)


class _Numbered:
    """One pre-framed delta body and the last whole response made of it: its nonce (a number
    from :data:`_nonces`) and ``system_version_info`` around the body."""

    __slots__ = ("body", "message", "nonce", "number", "version")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.number = 0
        self.version = ""
        self.nonce = ""
        self.message = b""


_nonces = itertools.count(1)
"""The delta streams' nonces: one increasing count for the process, so a stream's nonces
increase (each is unique on its stream) and streams sent the same change can be sent the
very same response, nonce included."""
_numbered: dict[tuple[object, ...], _Numbered] = {}


def _text_field(number: int, text: str) -> bytes:
    """A length-delimited string field (number < 16)."""
    data = text.encode()
    n = len(data)
    if n < 0x80:  # a nonce, a version: one byte of length
        return bytes((number << 3 | 2, n)) + data
    size = bytearray()
    while n >= 0x80:
        size.append(n & 0x7F | 0x80)
        n >>= 7
    size.append(n)
    return bytes((number << 3 | 2,)) + bytes(size) + data


def _entry(
    type_url: TypeUrl, changed: list[tuple[str, str, bytes]], removed: list[str]
) -> _Numbered:
    """The pre-framed body (resources, type, removals) of a delta response, framed once for
    every stream that is sent the same change (a push after a change: the same resources,
    the same versions, the same removals); the per-stream fields (``system_version_info``,
    ``nonce``) go around it (protobuf fields may come in any order)."""
    # the packed bytes themselves (shared by the snapshots; bytes cache their hash): correct
    # whatever ``versions`` says, and a hit compares by identity first
    key = (type_url, tuple(changed), tuple(removed))
    entry = _numbered.get(key)
    if entry is None:
        if len(_numbered) >= _FRAMED_MAX:
            _numbered.clear()
        body = pb.encode_delta_discovery_response("", type_url, "", changed, removed)
        entry = _numbered[key] = _Numbered(body)
    return entry


def _numbered_response(
    after: int,
    version: str,
    type_url: TypeUrl,
    changed: list[tuple[str, str, bytes]],
    removed: list[str],
    entry: _Numbered | None = None,
) -> tuple[int, bytes, str]:
    """(nonce number, the encoded DeltaDiscoveryResponse, its nonce) for a stream whose last
    nonce was number ``after``: the nonce is above it (unique on the stream), and every
    stream sent the same change with the same ``system_version_info`` while that nonce is
    above its own last one is given the very same bytes (one response framed per change,
    not per stream; a stream that already holds a later nonce gets a fresh one, and later
    streams share that)."""
    if len(changed) + len(removed) > _FRAMED_RESOURCES:
        number = next(_nonces)
        nonce = str(number)
        message = pb.encode_delta_discovery_response(version, type_url, nonce, changed, removed)
        return number, message, nonce
    if entry is None:
        entry = _entry(type_url, changed, removed)
    if entry.number > after and entry.version == version:
        return entry.number, entry.message, entry.nonce
    number = entry.number = next(_nonces)
    nonce = entry.nonce = str(number)
    entry.version = version
    head = _text_field(1, version) if version else b""
    entry.message = head + entry.body + _text_field(5, nonce)
    return number, entry.message, nonce


class AdsServer:
    """grpclib service: envoy.service.discovery.v3.AggregatedDiscoveryService, both RPCs
    (``StreamAggregatedResources``, state-of-the-world; ``DeltaAggregatedResources``,
    incremental) from one cache, authorized by one ``authorize`` callback."""

    def __init__(
        self,
        cache: SnapshotCache,
        metrics: XdsMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        authorize: Authorize | None = None,
        versions: VersionOf | None = None,
    ) -> None:
        self._cache = cache
        self._metrics = UNCOUNTED if metrics is None else metrics
        self._clock = clock
        self._authorize = authorize
        self.versions: VersionOf = versions or resource_version

    @property
    def cache(self) -> SnapshotCache:
        return self._cache

    @property
    def metrics(self) -> XdsMetrics:
        return self._metrics

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def authorize(self) -> Authorize | None:
        return self._authorize

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            f"/{ADS_SERVICE}/StreamAggregatedResources": grpclib.const.Handler(
                self.stream_aggregated_resources,
                grpclib.const.Cardinality.STREAM_STREAM,
                DiscoveryRequest,
                pb.Encoded,
            ),
            f"/{ADS_SERVICE}/DeltaAggregatedResources": grpclib.const.Handler(
                self.delta_aggregated_resources,
                grpclib.const.Cardinality.STREAM_STREAM,
                DeltaDiscoveryRequest,
                pb.Encoded,
            ),
        }

    def _node_key(self, stream: grpclib.server.Stream[Any, Any]) -> Callable[[_Request], str]:
        """The node a stream serves: the first request's node id, which the client's
        certificate must name when an ``authorize`` callback is set."""
        authorize = self._authorize
        if authorize is None:
            return _node_id
        peer = peer_identity(stream.peer.cert())

        def node_key(first: _Request) -> str:
            node = _node_id(first)
            if not authorize(node, peer):
                # The connection's certificate decides every stream on it: close it soon after
                # the refusal, so a client that has a fresh certificate meanwhile (Envoy's SDS
                # does not drain connections) reconnects with it instead of retrying on this one.
                _close_soon(stream)
                raise GRPCError(
                    grpclib.const.Status.PERMISSION_DENIED,
                    f"the client certificate does not identify node {node!r}",
                )
            return node

        return node_key

    def _still_allowed(self, stream: grpclib.server.Stream[Any, Any]) -> StillAllowed | None:
        """Re-checked whenever the stream's configuration changes: a certificate revoked since
        the stream opened (its workload quarantined) ends the stream."""
        if self._authorize is None:
            return None
        return still_allowed_for(self._authorize, peer_identity(stream.peer.cert()))

    async def stream_aggregated_resources(
        self, stream: grpclib.server.Stream[DiscoveryRequest, pb.Encoded]
    ) -> None:
        await serve_sotw_stream(
            stream,
            self._cache,
            self._metrics,
            self._clock,
            self._node_key(stream),
            self._still_allowed(stream),
        )

    async def delta_aggregated_resources(
        self, stream: grpclib.server.Stream[DeltaDiscoveryRequest, pb.Encoded]
    ) -> None:
        await serve_delta_stream(
            stream,
            self._cache,
            self._metrics,
            self._clock,
            self._node_key(stream),
            self.versions,
            self._still_allowed(stream),
        )


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """What the verified client certificate of a stream says: its URI SANs and serial."""

    uris: tuple[str, ...]
    serial: int | None


Authorize = Callable[[str, PeerIdentity], bool]
"""May the client with this certificate fetch node ``node``'s config?"""
StillAllowed = Callable[[str], bool]
"""May this stream's client still fetch node ``node``'s config?"""

_Request = DiscoveryRequest | DeltaDiscoveryRequest
_Req = TypeVar("_Req", DiscoveryRequest, DeltaDiscoveryRequest)


def still_allowed_for(authorize: Authorize | None, peer: PeerIdentity) -> StillAllowed | None:
    """The re-check of a stream whose client presented ``peer`` (None: nothing to check)."""
    if authorize is None:
        return None
    return lambda node: authorize(node, peer)


def peer_uri_sans(cert: Mapping[str, Any] | None) -> tuple[str, ...]:
    """URI SANs of a peer certificate as ``ssl.SSLSocket.getpeercert()`` reports them."""
    if not cert:
        return ()
    return tuple(v for k, v in cert.get("subjectAltName", ()) if k == "URI")


REFUSED_CONNECTION_CLOSE_S = 0.2


def _close_soon(stream: grpclib.server.Stream[Any, Any]) -> None:
    transport = getattr(stream.peer, "_transport", None)  # grpclib 0.4.9 Peer
    close = getattr(transport, "close", None)
    if callable(close):
        asyncio.get_running_loop().call_later(REFUSED_CONNECTION_CLOSE_S, close)


def peer_identity(cert: Mapping[str, Any] | None) -> PeerIdentity:
    """``ssl.SSLSocket.getpeercert()`` -> the URI SANs and serial number of the certificate."""
    serial_hex = (cert or {}).get("serialNumber")
    try:
        serial = int(serial_hex, 16) if isinstance(serial_hex, str) else None
    except ValueError:
        serial = None
    return PeerIdentity(peer_uri_sans(cert), serial)


def _node_id(first: _Request) -> str:
    node = first.node.id if first.node is not None else ""
    if not node:
        raise GRPCError(grpclib.const.Status.INVALID_ARGUMENT, "node.id is required")
    return str(node)


_ReqIn = TypeVar("_ReqIn", contravariant=True)


class _Session(Protocol[_ReqIn]):
    def on_request(self, req: _ReqIn, /) -> bool: ...

    def responses(self, snapshot: Snapshot, /) -> Iterator[bytes]: ...


async def serve_sotw_stream(
    stream: grpclib.server.Stream[DiscoveryRequest, pb.Encoded],
    cache: SnapshotCache,
    metrics: XdsMetrics,
    clock: Callable[[], float],
    node_key: Callable[[DiscoveryRequest], str],
    still_allowed: StillAllowed | None = None,
) -> None:
    """Serve one state-of-the-world stream from ``cache[node_key(first request)]`` until the
    client closes it (or ``still_allowed`` says no). Requests are read concurrently; the
    cache's watch wakes the sender."""
    first = await stream.recv_message()
    if first is None:
        return
    node = node_key(first)
    session = AdsSession(node, metrics, clock)
    await _serve(stream, cache, metrics, node, session, first, still_allowed)


async def serve_delta_stream(
    stream: grpclib.server.Stream[DeltaDiscoveryRequest, pb.Encoded],
    cache: SnapshotCache,
    metrics: XdsMetrics,
    clock: Callable[[], float],
    node_key: Callable[[DeltaDiscoveryRequest], str],
    versions: VersionOf,
    still_allowed: StillAllowed | None = None,
) -> None:
    """Serve one incremental (delta) stream from ``cache[node_key(first request)]`` until the
    client closes it (or ``still_allowed`` says no)."""
    first = await stream.recv_message()
    if first is None:
        return
    node = node_key(first)
    session = DeltaSession(node, metrics, clock, versions)
    await _serve(stream, cache, metrics, node, session, first, still_allowed)


async def _serve(
    stream: grpclib.server.Stream[_Req, pb.Encoded],
    cache: SnapshotCache,
    metrics: XdsMetrics,
    node: str,
    session: _Session[_Req],
    first: _Req,
    still_allowed: StillAllowed | None = None,
) -> None:
    session.on_request(first)
    closed = False
    revoked = False
    metrics.xds_stream(+1)
    sync_status.opened(cache, node, session)
    try:
        with cache.watch(node) as watch:

            async def read() -> None:
                nonlocal closed
                try:
                    async for req in stream:
                        # an ACK wakes nothing: only a request that can make a response due
                        if session.on_request(req):
                            watch.changed.set()
                except StreamTerminatedError:
                    pass  # the peer reset the stream: nothing more to send
                closed = True
                watch.changed.set()

            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(read())
                while True:
                    await watch.changed.wait()
                    watch.changed.clear()
                    if closed:
                        break
                    if still_allowed is not None and not still_allowed(node):
                        revoked = True
                        reader.cancel()
                        await _send_final(stream, session, cache.get(node))
                        break
                    snapshot = cache.get(node)
                    if snapshot is None:
                        continue
                    for message in session.responses(snapshot):
                        await stream.send_message(pb.Encoded(message))
    finally:
        metrics.xds_stream(-1)
        sync_status.closed(cache, node, session)
    if revoked:
        _close_soon(stream)
        raise GRPCError(
            grpclib.const.Status.PERMISSION_DENIED,
            f"the client certificate no longer identifies node {node!r}",
        )


async def _send_final(
    stream: grpclib.server.Stream[Any, Any], session: _Session[Any], snapshot: Snapshot | None
) -> None:
    """The node's configuration as it is now, once, before its revoked stream ends (see
    ``xds.adsconn``'s ``_send_final``): best effort, bounded by a second."""
    if snapshot is None:
        return
    with contextlib.suppress(Exception):
        async with asyncio.timeout(1.0):
            for message in session.responses(snapshot):
                await stream.send_message(pb.Encoded(message))


def _warm_snapshot() -> Snapshot:
    now = datetime(2025, 1, 1, tzinfo=UTC)
    reg = Registration("warm", "warm", "warm", "warm", Endpoint("127.0.0.1", 1), 2, {"warm": 3})
    state, _ = register(MeshState("warm.invalid"), reg, now)
    state, _ = record_attestation(
        state, "warm", AttestationRecord("sim", {}, "p", "0", now), IssuedCert(1, now), now, now
    )
    return build_snapshot(state, "warm", [], TrustMaterial(b"x", b"y"), packer=Packer())


def warm() -> None:
    """Build every resource kind and round-trip the discovery messages once, so the first
    real stream does not pay for pydantic's lazy schemas (~0.6 s cold)."""
    snapshot = _warm_snapshot()
    for type_url in TypeUrl:
        encoded = pb.encode_discovery_response("v", type_url, "1", snapshot.get(type_url).values())
        DiscoveryResponse.parse(encoded)
        delta = pb.encode_delta_discovery_response(
            "v", type_url, "1", [(n, "v", r) for n, r in snapshot.get(type_url).items()], ["x"]
        )
        DeltaDiscoveryResponse.parse(delta)
    pb.warm(
        [
            lambda: DiscoveryRequest(version_info="v", type_url=TypeUrl.CLUSTER),
            lambda: DeltaDiscoveryRequest(
                type_url=TypeUrl.CLUSTER,
                resource_names_subscribe=["a"],
                initial_resource_versions={"a": "v"},
                response_nonce="1",
            ),
        ]
    )


class Closable(Protocol):
    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


async def start_ads(
    cache: SnapshotCache,
    host: str,
    port: int,
    metrics: XdsMetrics | None = None,
    transport: str = "lean",
) -> tuple[Closable, AdsServer]:
    """Cache betterproto2 validators (xds.pb), warm the message classes, then listen on plain
    TCP: ``transport`` "lean" (:mod:`xds.adsconn`, what the control plane serves) or "grpclib"
    (the fallback). The caller closes the server (``server.close(); await
    server.wait_closed()``)."""
    pb.install_validator_cache()
    warm()
    ads = AdsServer(cache, metrics)
    if transport == "grpclib":
        server = grpclib.server.Server([ads])
        await server.start(host, port)
        return server, ads
    if transport != "lean":
        raise ValueError(f"unknown ADS transport {transport!r}")
    from xds.adsconn import LeanAds  # it imports this module

    lean = LeanAds(ads)
    await lean.start(host, port)
    return lean, ads


__all__ = [
    "UNCOUNTED",
    "AdsServer",
    "AdsSession",
    "Authorize",
    "DeltaSession",
    "PeerIdentity",
    "ResourceVersions",
    "StillAllowed",
    "VersionOf",
    "XdsMetrics",
    "peer_identity",
    "peer_uri_sans",
    "serve_delta_stream",
    "serve_sotw_stream",
    "start_ads",
    "warm",
]
