"""The incremental publisher equals a full rebuild, for random sequences of changes.

Each step changes the mesh (register, re-register with other services/ports, attest with other
measurements, renew, quarantine, release, readiness, unregister, mesh policy or trust change),
is published with the names it changed (or with none, so the publisher compares), and then every
node's snapshot the cache serves (watched nodes rebuilt eagerly, the others on demand) must equal
what ``build_snapshots`` makes from the same state from scratch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.xds.meshfixture import NOW, TD, TRUST
from xds.build import TrustMaterial, build_snapshots
from xds.cache import SnapshotCache
from xds.meshpolicy import ClaimsCondition, HttpMatch, MeshPolicy, Rule, Source
from xds.publisher import XdsPublisher
from xds.resources import TypeUrl
from xds.state import (
    AttestationRecord,
    Endpoint,
    IssuedCert,
    MeshState,
    Registration,
    Trigger,
    quarantine,
    record_attestation,
    register,
    release,
    unregister,
)

NAMES = [f"w{i}" for i in range(6)]
SERVICES = ["a", "b", "c"]
ACCOUNTS = ["sa1", "sa2", "sa3"]
NAMESPACES = ["default", "other"]


def _policy(
    dest_ns: str, dest_sa: str, src_ns: str, src_sa: str, claims: bool, to: bool
) -> MeshPolicy:
    rule = Rule(
        (Source(namespace=src_ns, service_account=src_sa),),
        ClaimsCondition(measurements=(("m", frozenset({"aa"})),)) if claims else None,
        (HttpMatch(paths=("/x",)),) if to else (),
    )
    return MeshPolicy(f"p-{dest_sa}-{src_sa}", dest_ns, dest_sa, (rule,))


policies_st = st.lists(
    st.builds(
        _policy,
        st.sampled_from(NAMESPACES),
        st.sampled_from(ACCOUNTS),
        st.sampled_from(NAMESPACES),
        st.sampled_from(ACCOUNTS),
        st.booleans(),
        st.booleans(),
    ),
    max_size=4,
)

registration_st = st.builds(
    lambda name, ns, sa, svc, port, outs, ready: Registration(
        name,
        ns,
        sa,
        svc,
        Endpoint("127.0.0.1", port),
        8080,
        {s: 20000 + i for i, s in enumerate(outs)},
        ready=ready,
    ),
    st.sampled_from(NAMES),
    st.sampled_from(NAMESPACES),
    st.sampled_from(ACCOUNTS),
    st.sampled_from(SERVICES),
    st.integers(15000, 15003),
    st.lists(st.sampled_from([*SERVICES, "a.other", "b.default"]), unique=True, max_size=3),
    st.booleans(),
)

step_st = st.one_of(
    st.tuples(st.just("register"), registration_st),
    st.tuples(st.just("attest"), st.sampled_from(NAMES), st.sampled_from(["aa", "bb"])),
    st.tuples(st.just("renew"), st.sampled_from(NAMES)),
    st.tuples(st.just("quarantine"), st.sampled_from(NAMES)),
    st.tuples(st.just("release"), st.sampled_from(NAMES)),
    st.tuples(st.just("unregister"), st.sampled_from(NAMES)),
    st.tuples(st.just("policies"), policies_st),
    st.tuples(st.just("trust"), st.binary(min_size=1, max_size=4)),
)


def apply(state: MeshState, step: tuple, serial: int) -> tuple[MeshState, set[str]]:  # type: ignore[type-arg]
    kind = step[0]
    if kind == "register":
        new, _ = register(state, step[1], NOW)
        return new, {step[1].name}
    name = step[1] if isinstance(step[1], str) else ""
    if name not in state.workloads:
        return state, set()
    if kind in ("attest", "renew"):
        w = state.workloads[name]
        m = (
            step[2]
            if kind == "attest"
            else (w.attestation.measurements.get("m", "aa") if w.attestation else "aa")
        )
        try:
            new, _ = record_attestation(
                state, name, AttestationRecord("sim", {"m": m}, "p", str(serial), NOW),
                IssuedCert(serial, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
            )  # fmt: skip
        except Exception:
            return state, set()
        return new, {name}
    if kind == "quarantine":
        new, _ = quarantine(state, name, Trigger.OPERATOR, "x", NOW)
        return new, {name}
    if kind == "release":
        new, _ = release(state, name, NOW)
        return new, {name}
    new, _ = unregister(state, name, NOW)
    return new, {name}


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(step_st, min_size=1, max_size=25),
    watched=st.sets(st.sampled_from(NAMES)),
    tell=st.lists(st.booleans(), min_size=25, max_size=25),
    deferred=st.booleans(),
)
def test_incremental_equals_full_rebuild(
    steps: list[tuple],  # type: ignore[type-arg]
    watched: set[str],
    tell: list[bool],
    deferred: bool,
) -> None:
    """(With ``deferred``, the CRL fan-out to nodes that do not need it at once is queued and
    run before comparing, as the event loop runs it a moment later.)"""
    cache = SnapshotCache()
    later: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, defer=later.append if deferred else None)
    state = MeshState(TD)
    policies: list[MeshPolicy] = []
    trust = TRUST
    pub.publish(state, policies, trust)
    contexts = [cache.watch(n) for n in sorted(watched)]
    for c in contexts:
        c.__enter__()
    try:
        for i, step in enumerate(steps):
            changed: set[str] = set()
            if step[0] == "policies":
                policies = list(step[1])
            elif step[0] == "trust":
                trust = replace(TRUST, crl_pem=step[1])
            else:
                state, changed = apply(state, step, 100 + i)
            pub.publish(state, policies, trust, changed if tell[i] else None)
            while later:
                later.pop()()
            full = build_snapshots(state, policies, trust)
            for node, expected in full.items():
                got = cache.get(node)
                assert got is not None, node
                for t in TypeUrl:
                    assert dict(got.get(t)) == dict(expected.get(t)), (node, t.short, i)
                    assert got.version(t) == expected.version(t)
            assert cache.nodes() <= set(state.workloads)
    finally:
        for c in contexts:
            c.__exit__(None, None, None)


def test_a_quarantine_rebuilds_only_the_callers_of_its_service() -> None:
    cache = SnapshotCache()
    pub = XdsPublisher(cache)
    state = MeshState(TD)
    for i in range(40):
        svc = "web" if i < 2 else f"s{i}"
        outbound = {"web": 20000} if i % 2 == 0 and i >= 2 else {}
        reg = Registration(
            f"n{i}", "default", f"sa{i}", svc, Endpoint("127.0.0.1", 15000 + i), 8080, outbound
        )
        state, _ = register(state, reg, NOW)
        state, _ = record_attestation(
            state, reg.name, AttestationRecord("sim", {}, "p", "0", NOW),
            IssuedCert(i, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
        )  # fmt: skip
    pub.publish(state, [], TRUST)
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    pub.publish(q, [], TRUST, changed={"n0"})
    # nothing held yet: a node without a stream costs nothing until it is asked for
    assert (pub.rebuilt_nodes, pub.patched_nodes) == (1, 0)
    for i in range(40):
        assert cache.get(f"n{i}") is not None
    q2, _ = quarantine(q, "n1", Trigger.OPERATOR, "x", NOW)
    pub.publish(q2, [], TRUST, changed={"n1"})
    callers = {f"n{i}" for i in range(2, 40, 2)}
    # n1 itself is rebuilt; the callers of its service get the new cluster/endpoints patched in
    assert (pub.rebuilt_nodes, pub.patched_nodes) == (1, len(callers))
    held = len(cache.nodes())  # n1 (rebuilt, no stream) is built again when asked for
    assert held == 39
    t2 = TrustMaterial(TRUST.bundle_pem, b"crl2")
    pub.publish(q2, [], t2, changed=())
    # the CRL reaches everyone: the trust layer's new secret, every held node woken for it
    assert (pub.rebuilt_nodes, pub.patched_nodes, pub.woken_nodes) == (0, 0, held)


def test_a_crl_change_reaches_at_once_only_the_nodes_that_admit_the_changed_identity() -> None:
    cache = SnapshotCache()
    later: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, defer=later.append)
    state = MeshState(TD)
    for i in range(6):
        reg = Registration(f"n{i}", "default", f"sa{i}", f"s{i}", Endpoint("127.0.0.1", 15000 + i),
                           8080)  # fmt: skip
        state, _ = register(state, reg, NOW)
        state, _ = record_attestation(
            state, reg.name, AttestationRecord("sim", {}, "p", "0", NOW),
            IssuedCert(i, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
        )  # fmt: skip
    # n1's rules admit sa0: n1 could accept n0's revoked certificate
    admits = MeshPolicy("p", "default", "sa1",
                        (Rule((Source(namespace="default", service_account="sa0"),)),))  # fmt: skip
    pub.publish(state, [admits], TRUST)
    held = {f"n{i}": cache.get(f"n{i}") for i in range(6)}
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    crl = TrustMaterial(TRUST.bundle_pem, b"crl-with-n0")
    old_secret = held["n1"].get(TypeUrl.SECRET)  # type: ignore[union-attr]
    pub.publish(q, [admits], crl, changed={"n0"})
    assert cache.get("n1").get(TypeUrl.SECRET) != old_secret  # type: ignore[union-attr]
    # woken at once: only n1. The others deny sa0 anyway: their streams are woken by the
    # coalesced fan-out (their snapshots read the trust layer: whatever makes them push
    # before it sends the new CRL too)
    assert pub.wake_order == ["n1"]
    for other in ("n2", "n3", "n4", "n5"):
        assert cache.get(other) is held[other]
    assert len(later) == 1
    q2, _ = quarantine(q, "n2", Trigger.OPERATOR, "x", NOW)
    pub.publish(q2, [admits], TrustMaterial(TRUST.bundle_pem, b"crl-2"), changed={"n2"})
    assert len(later) == 1  # coalesced: one fan-out for both
    later.pop()()
    # n0 and n2 were rebuilt (with the current secret, when next asked for); the four others'
    # streams are woken for crl-2 now, n1's for the second time
    assert pub.fanned_out == 4
    for i in range(1, 6):
        snap = cache.get(f"n{i}")
        assert snap is not None and dict(snap.get(TypeUrl.SECRET)) == dict(
            build_snapshots(q2, [admits], TrustMaterial(TRUST.bundle_pem, b"crl-2"))[f"n{i}"].get(
                TypeUrl.SECRET
            )
        )


@settings(max_examples=120, deadline=None)
@given(
    steps=st.lists(step_st, min_size=1, max_size=20),
    watched=st.sets(st.sampled_from(NAMES)),
    tell=st.lists(st.booleans(), min_size=20, max_size=20),
    turns=st.lists(st.integers(0, 3), min_size=20, max_size=20),
    chunk=st.integers(1, 3),
)
def test_chunked_fanout_equals_full_rebuild_whenever_it_is_read(
    steps: list[tuple],  # type: ignore[type-arg]
    watched: set[str],
    tell: list[bool],
    turns: list[int],
    chunk: int,
) -> None:
    """Held snapshots patched ``chunk`` at a time, the rest on later turns of the loop (run
    here ``turns[i]`` at a time between publishes, so publishes overtake queued chunks): a
    node read at any moment is what a full rebuild makes of the state last published, and
    once every turn ran, the queue is empty and every held snapshot is too. (The CRL reaches
    nodes that do not need it at once only with the deferred fan-out.)"""
    cache = SnapshotCache()
    soon: list[Callable[[], None]] = []
    later: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, defer=later.append, soon=soon.append, chunk=chunk)
    state = MeshState(TD)
    policies: list[MeshPolicy] = []
    trust = TRUST
    pub.publish(state, policies, trust)
    contexts = [cache.watch(n) for n in sorted(watched)]
    for c in contexts:
        c.__enter__()

    def check(nodes: set[str]) -> None:
        full = build_snapshots(state, policies, trust)
        for node in nodes:
            got, expected = cache.get(node), full[node]
            assert got is not None, node
            for t in TypeUrl:
                if t is TypeUrl.SECRET and later:
                    continue  # the CRL fan-out waits for ``defer`` by design
                assert dict(got.get(t)) == dict(expected.get(t)), (node, t.short)

    try:
        for i, step in enumerate(steps):
            changed: set[str] = set()
            if step[0] == "policies":
                policies = list(step[1])
            elif step[0] == "trust":
                trust = replace(TRUST, crl_pem=step[1])
            else:
                state, changed = apply(state, step, 100 + i)
            pub.publish(state, policies, trust, changed if tell[i] else None)
            if i % 3 == 0:
                while later:
                    later.pop()()
            for _ in range(turns[i]):
                if soon:
                    soon.pop(0)()
            assert len(soon) <= 1  # one chain of chunks, however many publishes queued
            if i % 2:  # read some nodes mid-way (each is brought up to date first)
                check(set(sorted(state.workloads)[::2]))
        while later or soon:
            (later or soon).pop(0)()
        assert not pub._first and not pub._rest
        check(set(cache.nodes()))  # what the pump patched (the queue is empty: no settling)
        check(set(state.workloads))
    finally:
        for c in contexts:
            c.__exit__(None, None, None)


def _serving_mesh() -> MeshState:
    """web (n0, n1) and api (n2) served; n3..n12 call web, n13..n18 call api."""
    state = MeshState(TD)
    for i in range(19):
        svc = "web" if i < 2 else ("api" if i == 2 else f"s{i}")
        out = {"web": 20000} if 3 <= i < 13 else ({"api": 20001} if i >= 13 else {})
        reg = Registration(
            f"n{i}", "default", f"sa{i}", svc, Endpoint("127.0.0.1", 15000 + i), 8080, out
        )
        state, _ = register(state, reg, NOW)
        if i != 2:
            state, _ = record_attestation(
                state, reg.name, AttestationRecord("sim", {}, "p", "0", NOW),
                IssuedCert(i, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
            )  # fmt: skip
    return state


def test_what_takes_something_back_is_woken_first_and_the_rest_in_chunks() -> None:
    """One publish quarantines n0 (an endpoint leaves web: its callers first, all at once) and
    attests n2 (api gains one: its callers after, 4 per turn of the loop)."""
    cache = SnapshotCache()
    soon: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, soon=soon.append, chunk=4)
    state = _serving_mesh()
    pub.publish(state, [], TRUST)
    for i in range(19):
        assert cache.get(f"n{i}") is not None
    web_callers = {f"n{i}" for i in range(3, 13)}
    api_callers = {f"n{i}" for i in range(13, 19)}
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    q, _ = record_attestation(
        q, "n2", AttestationRecord("sim", {}, "p", "0", NOW),
        IssuedCert(99, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
    )  # fmt: skip
    pub.publish(q, [], TRUST, changed={"n0", "n2"})
    assert set(pub.wake_order[: len(web_callers)]) == web_callers
    assert len(pub.wake_order) == len(web_callers) + 4  # and the first chunk of the rest
    assert set(pub.wake_order[len(web_callers) :]) <= api_callers
    assert len(soon) == 1  # the next chunk waits for the loop's next turn
    # a node asked for before its turn is brought up to date first
    late = next(n for n in sorted(api_callers) if n not in pub.wake_order)
    expected = build_snapshots(q, [], TRUST)
    assert dict(cache.get(late).get(TypeUrl.ENDPOINT)) == dict(  # type: ignore[union-attr]
        expected[late].get(TypeUrl.ENDPOINT)
    )
    while soon:
        soon.pop(0)()
    assert pub.wake_order[len(web_callers) + 4] == late  # settled when it was read
    order = [n for n in pub.wake_order if n != late]
    assert set(order[: len(web_callers)]) == web_callers  # every web caller before api's
    assert set(order[len(web_callers) :]) == api_callers - {late}
    assert pub.patched_nodes == len(web_callers) + len(api_callers)
    for node, snap in expected.items():
        got = cache.get(node)
        assert got is not None and dict(got.get(TypeUrl.ENDPOINT)) == dict(
            snap.get(TypeUrl.ENDPOINT)
        )


def _secret(cache: SnapshotCache, node: str) -> dict[str, bytes]:
    snap = cache.get(node)
    assert snap is not None
    return dict(snap.get(TypeUrl.SECRET))


def _deferring_mesh() -> tuple[SnapshotCache, XdsPublisher, list[Callable[[], None]], MeshState]:
    """``_serving_mesh`` published, every node held, the CRL fan-out deferred into the list."""
    cache = SnapshotCache()
    later: list[Callable[[], None]] = []
    pub = XdsPublisher(cache, defer=later.append)
    state = _serving_mesh()
    pub.publish(state, [], TRUST)
    for n in state.workloads:
        assert cache.get(n) is not None
    return cache, pub, later, state


def _expected_secret(
    state: MeshState, policies: list[MeshPolicy], trust: TrustMaterial, node: str
) -> dict[str, bytes]:
    return dict(build_snapshots(state, policies, trust)[node].get(TypeUrl.SECRET))


def test_a_quarantine_revokes_at_once_at_the_callers_that_accept_its_certificate() -> None:
    """The callers of web accept any web member's certificate as a server (an address taken
    over by the quarantined n0 would be accepted with it): they take the new CRL with the
    endpoint change, not with the fan-out. Nodes that never accept n0 wait for it."""
    cache, pub, later, state = _deferring_mesh()
    q, _ = quarantine(state, "n0", Trigger.OPERATOR, "x", NOW)
    crl = TrustMaterial(TRUST.bundle_pem, b"crl-with-n0")
    pub.publish(q, [], crl, changed={"n0"})
    web_callers = {f"n{i}" for i in range(3, 13)}
    others = {f"n{i}" for i in range(13, 19)}
    # woken at once: the callers (their endpoints changed too); the others wait for the
    # fan-out. Every snapshot reads the trust layer: what any node sends is the new CRL
    assert web_callers <= set(pub.wake_order) and not others & set(pub.wake_order)
    for i in range(3, 19):
        assert _secret(cache, f"n{i}") == _expected_secret(q, [], crl, f"n{i}")
    assert len(later) == 1
    later.pop()()
    assert others <= set(pub.wake_order) and pub.fanned_out == len(q.workloads) - 1


def test_a_patch_for_any_reason_brings_the_current_crl() -> None:
    """A node's rules or clusters may start to admit an identity whose certificate the
    pending CRL revokes: whatever else a node is woken for, the current CRL comes along (it
    reads the trust layer), though the fan-out that wakes everyone for it has not run."""
    cache, pub, later, state = _deferring_mesh()
    crl = TrustMaterial(TRUST.bundle_pem, b"crl-2")
    pub.publish(state, [], crl, changed=())  # a renewal's superseded certificate, say
    assert "n13" not in pub.wake_order and len(later) == 1
    # api's member attests: its callers n13..n18 take its endpoint and the CRL with it
    state, _ = record_attestation(
        state, "n2", AttestationRecord("sim", {}, "p", "0", NOW),
        IssuedCert(2, NOW + timedelta(hours=1)), NOW + timedelta(hours=1), NOW,
    )  # fmt: skip
    pub.publish(state, [], crl, changed={"n2"})
    for i in range(13, 19):
        assert f"n{i}" in pub.wake_order
        assert _secret(cache, f"n{i}") == _expected_secret(state, [], crl, f"n{i}")
    # a policy now admits sa0 at n4 (whose held CRL is still the old one): with the routes
    admits = MeshPolicy(
        "p", "default", "sa4", (Rule((Source(namespace="default", service_account="sa0"),)),)
    )
    crl3 = TrustMaterial(TRUST.bundle_pem, b"crl-3")
    pub.publish(state, [], crl3, changed=())
    pub.publish(state, [admits], crl3, changed=())
    snap, expected = cache.get("n4"), build_snapshots(state, [admits], crl3)["n4"]
    assert snap is not None
    for t in (TypeUrl.ROUTE, TypeUrl.SECRET):
        assert dict(snap.get(t)) == dict(expected.get(t)), t.short


def test_a_new_trust_bundle_is_never_deferred() -> None:
    """A CA rotation's bundle must be everywhere before certificates of the new CA are
    presented: it reaches every held node at once, the fan-out's delay notwithstanding."""
    cache, pub, later, state = _deferring_mesh()
    rotated = TrustMaterial(TRUST.bundle_pem + b"\n(new root)", TRUST.crl_pem)
    pub.publish(state, [], rotated, changed=())
    assert later == []
    for n in state.workloads:
        assert _secret(cache, n) == _expected_secret(state, [], rotated, n)
