"""How bench_scale reads a caller Envoy's refusal from its requests (benchmarks.scale_envoy)."""

from __future__ import annotations

from benchmarks.scale_envoy import Prober, Sample


def prober(*answers: tuple[float, bool], rotation: int = 1) -> Prober:
    p = Prober("w0", 1, "hello from w1", 0.005, rotation)
    for t, ok in answers:
        p.samples.append(Sample(t, t + 0.5, ok, 200 if ok else 503, "x"))
    return p


def test_refusal_is_the_first_answer_of_the_final_run_of_refusals() -> None:
    p = prober((0, True), (1, True), (2, False), (3, False))
    assert p.refused_at(since=0.0) == 2.5
    assert p.last_answered_before(2.5) == 1
    assert p.flaps(since=0.0) == 0


def test_a_success_after_a_refusal_discards_it_and_is_counted() -> None:
    p = prober((0, True), (1, False), (2, True), (3, False), (4, False))
    assert p.refused_at(since=0.0) == 3.5
    assert p.last_answered_before(3.5) == 2
    assert p.flaps(since=0.0) == 1


def test_still_answered_means_not_refused() -> None:
    p = prober((0, True), (1, False), (2, True))
    assert p.refused_at(since=0.0) is None
    assert not prober().last_ok() and prober((0, True)).last_ok()


def test_samples_before_since_do_not_count() -> None:
    p = prober((0, False), (1, True), (2, False))
    assert p.refused_at(since=2.0) == 2.5
    assert p.flaps(since=2.0) == 0 and p.flaps(since=0.0) == 1


def test_with_other_members_refusal_needs_a_whole_rotation_without_the_victim() -> None:
    """The victim answers one request in ``rotation`` while it is a member: it is out only
    once ``rotation`` answers in a row were not its own."""
    ok, other = True, False
    p = prober((0, ok), (1, other), (2, other), (3, other), (4, ok), (5, other), (6, other),
               rotation=4)  # fmt: skip
    assert p.refused_at(since=0.0) is None and p.last_ok()
    p.samples.append(Sample(7, 7.5, False, 503, "x"))
    assert p.refused_at(since=0.0) is None  # 3 in a row: could still be its turn next
    assert p.last_ok()
    p.samples.append(Sample(8, 8.5, False, 503, "x"))
    assert p.refused_at(since=0.0) == 8.5 and not p.last_ok()
    assert p.last_answered_before(8.5) == 4
    assert p.flaps(since=0.0) == 0  # answers in turn before the refusal are no flaps
    p.samples.append(Sample(9, 9.5, True, 200, "hello from w1"))
    assert p.flaps(since=0.0) == 1


def test_the_victims_own_refusal_is_not_the_callers_routing_away() -> None:
    """403 is the victim's Envoy refusing (its RBAC): a refusal, but the caller's Envoy still
    sends to it; routed away only once ``rotation`` answers in a row came from elsewhere."""
    p = prober((0, True), (1, False), rotation=2)
    p.samples.append(Sample(2, 2.5, False, 403, "RBAC: access denied"))
    p.samples.append(Sample(3, 3.5, False, 503, "x"))
    assert p.refused_at(since=0.0) == 2.5  # 403 and 503 in a row: refused
    assert p.routed_away_at(since=0.0) is None  # the 403 came through the victim
    p.samples.append(Sample(4, 4.5, False, 503, "x"))
    assert p.routed_away_at(since=0.0) == 4.5
