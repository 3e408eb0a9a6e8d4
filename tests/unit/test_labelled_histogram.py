"""LabelledHistogram (the xDS ACK latency, observed without locks) exports exactly what
prometheus_client's Histogram exports for the same observations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from attestmesh.metrics import _LATENCY_BUCKETS, LabelledHistogram, Metrics


def _text(registry: CollectorRegistry) -> list[str]:
    lines = generate_latest(registry).decode().splitlines()
    # _created is the time each series was first observed: the same kind of sample, not value
    return [line.rsplit(" ", 1)[0] if "_created" in line else line for line in lines]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["cds", "eds", "lds"]),
            st.one_of(
                st.sampled_from([0.0, *_LATENCY_BUCKETS, 3.0]),  # on the bounds too
                st.floats(min_value=0, max_value=10, allow_nan=False),
            ),
        ),
        max_size=40,
    )
)
def test_it_exports_what_prometheus_histogram_exports(obs: list[tuple[str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    mine = LabelledHistogram("x_seconds", "help", "type", _LATENCY_BUCKETS, ours)
    ref = Histogram("x_seconds", "help", ["type"], buckets=_LATENCY_BUCKETS, registry=theirs)
    for label, amount in obs:
        mine.observe(label, amount)
        ref.labels(label).observe(amount)
    assert _text(ours) == _text(theirs)


def test_the_ack_metric_reads_back_by_sample_value() -> None:
    m = Metrics()
    m.xds_acked("cds", 0.003)
    m.xds_acked("cds", 0.2)
    get = m.registry.get_sample_value
    assert get("attestmesh_xds_push_ack_seconds_count", {"type": "cds"}) == 2
    assert get("attestmesh_xds_push_ack_seconds_bucket", {"type": "cds", "le": "0.005"}) == 1
    assert get("attestmesh_xds_push_ack_seconds_bucket", {"type": "cds", "le": "+Inf"}) == 2
    assert get("attestmesh_xds_push_ack_seconds_sum", {"type": "cds"}) == 0.203
    assert get("attestmesh_xds_push_ack_seconds_count", {"type": "eds"}) is None
