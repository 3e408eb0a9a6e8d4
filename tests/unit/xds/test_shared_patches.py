"""Shared resources stay shared through patches, and a rebuilt node's stream goes first.

The callers of one service hold one EDS mapping (interned by content), so a change of that
service's endpoints is merged and versioned once for all of them; a patch that changes nothing
(equal bytes) leaves the snapshot as it is. With a loop, the streams of nodes rebuilt by a
change (a quarantined workload's own) are woken before the first wave is patched.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.unit.xds.meshfixture import NOW, TRUST
from tests.unit.xds.test_incremental import _serving_mesh
from xds import pb
from xds.build import build_snapshots
from xds.cache import SnapshotCache
from xds.publisher import XdsPublisher
from xds.resources import TypeUrl
from xds.server import DeltaDiscoveryResponse, _numbered_response
from xds.state import Trigger, quarantine


def _published() -> tuple[SnapshotCache, XdsPublisher, list[Callable[[], None]]]:
    cache = SnapshotCache()
    soon: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, soon=soon.append, chunk=4)
    pub.publish(_serving_mesh(), [], TRUST)
    for i in range(19):
        assert cache.get(f"n{i}") is not None
    return cache, pub, soon


def _eds(cache: SnapshotCache, node: str) -> object:
    snap = cache.get(node)
    assert snap is not None
    return snap.get(TypeUrl.ENDPOINT)


def test_callers_of_one_service_share_their_endpoints_before_and_after_a_patch() -> None:
    cache, pub, soon = _published()
    web_callers = [f"n{i}" for i in range(3, 13)]
    before = _eds(cache, web_callers[0])
    assert all(_eds(cache, n) is before for n in web_callers)  # one mapping, interned
    q, _ = quarantine(_serving_mesh(), "n0", Trigger.OPERATOR, "x", NOW)
    pub.publish(q, [], TRUST, changed={"n0"})
    while soon:
        soon.pop(0)()
    after = _eds(cache, web_callers[0])
    assert after is not before
    assert all(_eds(cache, n) is after for n in web_callers)  # patched once, shared
    expected = build_snapshots(q, [], TRUST)
    for node, snap in expected.items():
        got = cache.get(node)
        assert got is not None
        for t in TypeUrl:
            assert dict(got.get(t)) == dict(snap.get(t)), (node, t)
            assert got.version(t) == snap.version(t), (node, t)


def test_a_patch_with_equal_bytes_changes_nothing() -> None:
    cache, _, _ = _published()
    snap = cache.get("n3")
    assert snap is not None
    eds = snap.get(TypeUrl.ENDPOINT)
    copies = {name: bytes(bytearray(packed)) for name, packed in eds.items()}
    assert all(copies[n] is not eds[n] for n in eds)
    assert snap.patched({TypeUrl.ENDPOINT: copies}) is snap
    assert snap.patched({TypeUrl.ENDPOINT: {"no-such-name": b"x"}}) is snap


def test_the_rebuilt_nodes_stream_is_woken_before_the_first_wave_is_patched() -> None:
    cache, pub, soon = _published()
    with cache.watch("n0") as own, cache.watch("n3") as caller:
        own.changed.clear()
        caller.changed.clear()
        q, _ = quarantine(_serving_mesh(), "n0", Trigger.OPERATOR, "x", NOW)
        pub.publish(q, [], TRUST, changed={"n0"})
        assert own.changed.is_set()  # rebuilt and woken now
        assert not caller.changed.is_set() and pub.wake_order == []
        assert len(soon) == 1  # the first wave, on the next turn
        # read before its turn: brought up to date first
        expected = build_snapshots(q, [], TRUST)
        assert dict(_eds(cache, "n4")) == dict(expected["n4"].get(TypeUrl.ENDPOINT))  # type: ignore[call-overload]
        soon.pop(0)()
        assert caller.changed.is_set()
        assert {f"n{i}" for i in range(3, 13)} <= {*pub.wake_order, "n4"}


def test_delta_responses_framed_once_parse_as_encoded_per_stream() -> None:
    cache, _, _ = _published()
    snap = cache.get("n3")
    assert snap is not None
    changed = [(n, "v1", b) for n, b in snap.get(TypeUrl.ENDPOINT).items()]
    for version in ("", "abc", "v" * 200):
        _, got, nonce = _numbered_response(0, version, TypeUrl.ENDPOINT, changed, ["gone"])
        want = pb.encode_delta_discovery_response(
            version, TypeUrl.ENDPOINT, nonce, changed, ["gone"]
        )
        assert DeltaDiscoveryResponse.parse(got) == DeltaDiscoveryResponse.parse(want)


def test_the_memos_stay_bounded_by_entries_and_bytes() -> None:
    from xds import build

    big = b"c" * (1 << 20)  # a trust secret with a long CRL
    snap = build.Snapshot.of({TypeUrl.SECRET: {"mesh-trust": big + b"0"}})
    for i in range(1, 40):  # every CRL change makes another
        snap = snap.patched({TypeUrl.SECRET: {"mesh-trust": big + str(i).encode()}})
        assert build._memo_bytes <= build._MEMO_BYTES
        assert len(build._interned) <= build._MEMO_ENTRIES
        assert len(build._patches) <= build._MEMO_ENTRIES
    assert snap.get(TypeUrl.SECRET)["mesh-trust"] == big + b"39"
    for i in range(2 * build._MEMO_ENTRIES):
        build.Snapshot.of({TypeUrl.ENDPOINT: {f"out|s{i}": b"x"}})
        assert len(build._interned) <= build._MEMO_ENTRIES
