"""How bench_scale reads a caller Envoy's refusal from its requests (benchmarks.scale_envoy)."""

from __future__ import annotations

from benchmarks.scale_envoy import Prober, Sample


def prober(*answers: tuple[float, bool]) -> Prober:
    p = Prober("w0", 1, "hello from w1", 0.005)
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
