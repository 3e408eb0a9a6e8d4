"""DeltaSession memoises the diff per point (xds.server._Point): streams subscribed to the same
names, holding the versions of the same shared mapping, given the same new mapping, are
answered from one diff, with the very same bytes. A stream that NACKed, changed its
subscriptions, is owed names, or holds something else is diffed for itself; the memo stays
bounded; and whatever the history, every stream is sent what a diff of its own would send."""

from __future__ import annotations

import gc
import warnings

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic.warnings import PydanticDeprecatedSince212

from xds import pb, server
from xds.build import Snapshot
from xds.resources import TypeUrl
from xds.server import UNCOUNTED, DeltaSession, ResourceVersions

with warnings.catch_warnings():
    warnings.simplefilter("ignore", PydanticDeprecatedSince212)
    from envoy_data_plane.envoy.service.discovery.v3 import (
        DeltaDiscoveryRequest,
        DeltaDiscoveryResponse,
    )
    from envoy_data_plane.google.rpc import Status

EDS, CDS = TypeUrl.ENDPOINT, TypeUrl.CLUSTER


def _res(tag: str, type_url: TypeUrl = EDS) -> bytes:
    return pb.pack_bytes(b"\x0a\x01" + tag.encode(), type_url)


def _eds(names: dict[str, str]) -> Snapshot:
    return Snapshot.of({EDS: {n: _res(t) for n, t in names.items()}})


def _session(versions: ResourceVersions, names: list[str], i: int = 0) -> DeltaSession:
    s = DeltaSession(f"n{i}", UNCOUNTED, lambda: 0.0, versions)
    s.on_request(DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=names))
    return s


def _ack(s: DeltaSession, message: bytes, error: bool = False) -> None:
    r = DeltaDiscoveryResponse.parse(message)
    req = DeltaDiscoveryRequest(type_url=r.type_url, response_nonce=r.nonce)
    if error:
        req.error_detail = Status(code=3, message="bad")
    s.on_request(req)


def _what(message: bytes) -> tuple[str, list[tuple[str, str, bytes]], list[str]]:
    r = DeltaDiscoveryResponse.parse(message)
    return (
        r.type_url,
        sorted((x.name, x.version, x.resource.value if x.resource else b"") for x in r.resources),
        sorted(r.removed_resources),
    )


def _settle(sessions: list[DeltaSession], snap: Snapshot) -> None:
    for s in sessions:
        for m in list(s.responses(snap)):
            _ack(s, m)


def test_streams_at_the_same_point_share_one_diff_and_the_same_bytes() -> None:
    versions = ResourceVersions()
    sessions = [_session(versions, ["a", "b"], i) for i in range(50)]
    _settle(sessions, _eds({"a": "1", "b": "1"}))
    after = _eds({"a": "2", "b": "1"})
    before = server.diffs
    sent = [list(s.responses(after)) for s in sessions]
    assert server.diffs - before == 1  # the first stream diffs; 49 take its step
    assert all(len(m) == 1 and m[0] is sent[0][0] for m in sent)
    assert _what(sent[0][0])[1] == [("a", versions(after.get(EDS)["a"]), _res("2")[-3:])]
    for s, m in zip(sessions, sent, strict=True):
        assert s._types[EDS].have == {n: versions(r) for n, r in after.get(EDS).items()}
        _ack(s, m[0])
    # the next change: the streams stand on one point again (the step led them there)
    later = _eds({"a": "2", "b": "3"})
    before = server.diffs
    assert len({next(iter(s.responses(later))) for s in sessions}) == 1
    assert server.diffs - before == 1


def test_a_stream_that_nacked_is_diffed_for_itself() -> None:
    versions = ResourceVersions()
    sessions = [_session(versions, ["a"], i) for i in range(3)]
    _settle(sessions, _eds({"a": "1"}))
    two = _eds({"a": "2"})
    out = [next(iter(s.responses(two))) for s in sessions]
    _ack(sessions[0], out[0], error=True)  # rolled back to version 1, 2 rejected
    _ack(sessions[1], out[1])
    _ack(sessions[2], out[2])
    assert sessions[0]._types[EDS].point is None
    # back to the first mapping: the others are sent "a" at 1; the NACKer still holds 1
    one = _eds({"a": "1"})
    before = server.diffs
    assert list(sessions[0].responses(one)) == []
    assert server.diffs - before == 1
    others = [list(s.responses(one)) for s in sessions[1:]]
    assert server.diffs - before == 2  # one diff for the two others
    assert others[0] == others[1] and len(others[0]) == 1
    assert [n for n, _, _ in _what(others[0][0])[1]] == ["a"]


def test_new_subscriptions_and_other_versions_are_not_answered_from_the_memo() -> None:
    versions = ResourceVersions()
    first = _eds({"a": "1", "b": "1"})
    plain = [_session(versions, ["a"], i) for i in range(2)]
    more = _session(versions, ["a"], 2)
    behind = _session(versions, ["a"], 3)
    _settle([*plain, more, behind], first)
    more.on_request(
        DeltaDiscoveryRequest(type_url=EDS, response_nonce="", resource_names_subscribe=["b"])
    )
    _settle([behind], _eds({"a": "0", "b": "1"}))  # holds another version of "a"
    second = _eds({"a": "2", "b": "1"})
    a2 = [("a", versions(second.get(EDS)["a"]), _res("2")[-3:])]
    b1 = [("b", versions(second.get(EDS)["b"]), _res("1")[-3:])]
    shared = [_what(m) for m in plain[0].responses(second)]
    assert shared == [(EDS, a2, [])]
    assert [_what(m) for m in more.responses(second)] == [(EDS, sorted(a2 + b1), [])]
    assert [_what(m) for m in behind.responses(second)] == [(EDS, a2, [])]
    assert [_what(m) for m in plain[1].responses(second)] == shared
    # a name the client must be told about again (re-subscribed): answered though unchanged
    plain[0].on_request(DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=["a"]))
    assert [_what(m) for m in plain[0].responses(second)] == [(EDS, a2, [])]
    assert list(plain[1].responses(second)) == []


def test_owed_names_are_part_of_the_memo_key() -> None:
    # after a CDS response the updated clusters' EDS is owed, unchanged or not: a stream owed
    # nothing at the same point, given the same EDS mapping, is sent only what changed
    versions = ResourceVersions()
    eds1 = {"c": _res("1"), "d": _res("1")}
    eds2 = {"c": _res("1"), "d": _res("2")}
    c1, c2 = {"c": _res("1", CDS)}, {"c": _res("2", CDS)}
    sessions = []
    for i in range(4):
        s = DeltaSession(f"n{i}", UNCOUNTED, lambda: 0.0, versions)
        s.on_request(DeltaDiscoveryRequest(type_url=CDS))
        s.on_request(DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=["c", "d"]))
        sessions.append(s)
    _settle(sessions, Snapshot.of({CDS: c1, EDS: eds1}))
    cluster_changed = Snapshot.of({CDS: c2, EDS: eds2})
    same_clusters = Snapshot.of({CDS: c1, EDS: eds2})
    assert cluster_changed.get(EDS) is same_clusters.get(EDS)  # one shared EDS mapping
    owed = [[_what(m) for m in s.responses(cluster_changed)] for s in sessions[:2]]
    assert owed[0] == owed[1]
    assert [t for t, _, _ in owed[0]] == [CDS, EDS]
    assert [n for n, _, _ in owed[0][1][1]] == ["c", "d"]  # c owed, though unchanged
    for s in sessions[2:]:
        quiet = [_what(m) for m in s.responses(same_clusters)]
        assert [t for t, _, _ in quiet] == [EDS]
        assert [n for n, _, _ in quiet[0][1]] == ["d"]


def test_the_memo_is_bounded() -> None:
    versions = ResourceVersions()
    sessions = [_session(versions, ["a"], i) for i in range(2)]
    _settle(sessions, _eds({"a": "0"}))
    point = sessions[0]._types[EDS].point
    assert point is not None and point is sessions[1]._types[EDS].point
    # a stream left behind while its point is offered many mappings: steps stay few
    for k in range(1, 40):
        list(sessions[1].responses(_eds({"a": str(k)})))
        sessions[1]._types[EDS].point = point  # offered again from the same point
        sessions[1]._types[EDS].have = dict(sessions[0]._types[EDS].have)
    assert len(point.steps) <= server._STEPS_KEPT
    # points live while a stream stands on one
    for k in range(40, 60):
        _settle(sessions, _eds({"a": str(k)}))
    del point, sessions
    gc.collect()
    assert not [p for p in server._points.values() if p.versions is versions]


# ---------------------------------------------------------------------------------------------
# whatever the history, the memo sends what a diff of each stream's own would


_MAPPINGS = [
    _eds({"a": "1", "b": "1"}),
    _eds({"a": "2", "b": "1"}),
    _eds({"a": "2"}),
    _eds({"a": "1", "b": "2", "c": "1"}),
    _eds({}),
]
_ops = st.one_of(
    st.tuples(st.just("snap"), st.integers(0, len(_MAPPINGS) - 1), st.lists(st.booleans(), min_size=4, max_size=4)),
    st.tuples(st.just("sub"), st.integers(0, 3), st.lists(st.sampled_from("abc"), max_size=2)),
    st.tuples(st.just("unsub"), st.integers(0, 3), st.lists(st.sampled_from("abc"), max_size=2)),
)  # fmt: skip


def _play(ops: list[tuple[object, ...]], memo: bool) -> list[object]:
    versions = ResourceVersions()
    sessions = [_session(versions, ["a", "b"] if i < 3 else ["a"], i) for i in range(4)]
    snap = _MAPPINGS[0]
    seen: list[object] = []
    for op in ops:
        if op[0] == "snap":
            assert isinstance(op[1], int) and isinstance(op[2], list)
            snap, nacks = _MAPPINGS[op[1]], op[2]
        elif op[0] in ("sub", "unsub"):
            assert isinstance(op[1], int) and isinstance(op[2], list)
            names = list(op[2])
            if op[0] == "sub":
                req = DeltaDiscoveryRequest(type_url=EDS, resource_names_subscribe=names)
            else:
                req = DeltaDiscoveryRequest(type_url=EDS, resource_names_unsubscribe=names)
            sessions[op[1]].on_request(req)
            nacks = [False] * 4
        for s, nack in zip(sessions, nacks, strict=True):
            if not memo:
                s._types[EDS].point = None
            for m in list(s.responses(snap)):
                seen.append(_what(m))
                _ack(s, m, error=nack)
            seen.append(dict(s._types[EDS].have))
    return seen


@settings(max_examples=150, deadline=None)
@given(st.lists(_ops, max_size=25))
def test_memoised_answers_equal_each_streams_own_diff(ops: list[tuple[object, ...]]) -> None:
    assert _play(ops, memo=True) == _play(ops, memo=False)


def test_the_shared_empty_held_versions_are_never_written() -> None:
    """A new type's held versions start as one shared empty dict (``_NO_HAVE``, ~64 bytes
    per stream and type saved): every write goes to a copy of the stream's own."""
    versions = ResourceVersions()
    wild = DeltaSession("w", UNCOUNTED, lambda: 0.0, versions)
    wild.on_request(DeltaDiscoveryRequest(type_url=CDS))  # the legacy wildcard
    named = _session(versions, ["a", "b"], 1)
    cds = {CDS: {"c": _res("c", CDS)}}
    snap = Snapshot.of({**cds, EDS: {"a": _res("1"), "b": _res("1")}})
    for s in (wild, named):
        for m in list(s.responses(snap)):
            _ack(s, m, error=s is named)  # the named stream NACKs: its versions roll back
    assert server._NO_HAVE == {}
    assert wild._types[CDS].have == {"c": versions(_res("c", CDS))}
    assert named._types[EDS].have == {}
    for m in list(named.responses(_eds({"a": "2"}))):
        _ack(named, m)
    named.on_request(DeltaDiscoveryRequest(type_url=EDS, resource_names_unsubscribe=["b"]))
    assert server._NO_HAVE == {}
    assert DeltaSession("x", UNCOUNTED, lambda: 0.0, versions)._types == {}
    fresh = _session(versions, ["a"], 2)
    assert fresh._types[EDS].have == {} and fresh._types[EDS].have is server._NO_HAVE
