"""The metrics registry: one object, created in main() and passed down. Bounded labels only."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Series:
    __slots__ = ("counts", "created", "sum")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * buckets  # per bucket, not cumulative (the last: +Inf)
        self.sum = 0.0
        self.created = time.time()


class LabelledHistogram:
    """A histogram with one label, exported as ``prometheus_client.Histogram`` exports one
    (``_bucket`` cumulative with ``le``, ``_count``, ``_sum``, ``_created``), observed
    without locks: for an observation made on every xDS ACK (thousands per change), where
    ``Histogram.observe`` takes two locks and scans the buckets. Observed by one thread (the
    event loop's); a scrape reads plain integers."""

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self._bounds = [*buckets, float("inf")]
        self._le: list[str] = [floatToGoString(b) for b in self._bounds]  # type: ignore[no-untyped-call]
        self._series: dict[str, _Series] = {}
        registry.register(self)

    def observe(self, value: str, amount: float) -> None:
        """One observation of ``amount`` for label value ``value`` (a bounded set)."""
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = _Series(len(self._bounds))
        series.counts[bisect_left(self._bounds, amount)] += 1  # the first bound >= amount
        series.sum += amount

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=[self.label])

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        for value, series in list(self._series.items()):
            cumulative, total = [], 0
            for le, count in zip(self._le, series.counts, strict=True):
                total += count
                cumulative.append((le, total))
            family.add_metric([value], cumulative, sum_value=series.sum)
            family.samples.append(
                Sample(f"{self.name}_created", {self.label: value}, series.created)
            )
        yield family


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.attestations = Counter(
            "attestmesh_attestations_total",
            "Attestation attempts by TEE, result and reason",
            ["tee", "result", "reason"],
            registry=r,
        )
        self.api_rejections = Counter(
            "attestmesh_api_rejections_total",
            "Issuance API requests refused, by endpoint and reason",
            ["endpoint", "reason"],
            registry=r,
        )
        self.issuance_seconds = Histogram(
            "attestmesh_issuance_seconds",
            "Time from attest request to signed certificate",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.certificates_issued = Counter(
            "attestmesh_certificates_issued_total", "Leaf certificates issued", registry=r
        )
        self.listener_closed = Counter(
            "attestmesh_listener_closed_total",
            "Connections refused at accept (caps) or closed by a timeout, by listener and reason",
            ["listener", "reason"],
            registry=r,
        )
        self.certificates_withdrawn = Counter(
            "attestmesh_certificates_withdrawn_total",
            "Certificates revoked because the response carrying them never reached the agent",
            registry=r,
        )
        self.attest_crypto = Counter(
            "attestmesh_attest_crypto_total",
            "Attestations verified and signed, by where: a worker process, a thread of the "
            "control plane's (no worker process ready, or a key store only it can open), or "
            "lost (the worker holding it died or hung: answered 503, retried by the agent)",
            ["where"],
            registry=r,
        )
        self.attest_worker_processes = Gauge(
            "attestmesh_attest_worker_processes",
            "Attestation worker processes ready (0: verification and signing run on threads)",
            registry=r,
        )
        self.xds_streams = Gauge("attestmesh_xds_streams", "Connected xDS streams", registry=r)
        self.xds_push_ack_seconds = LabelledHistogram(
            "attestmesh_xds_push_ack_seconds",
            "Time from sending an xDS response to its ACK, by type",
            "type",
            _LATENCY_BUCKETS,
            r,
        )
        self.xds_nacks = Counter(
            "attestmesh_xds_nacks_total", "xDS responses rejected by Envoy", ["type"], registry=r
        )
        self.quarantined = Gauge(
            "attestmesh_quarantined_workloads", "Workloads currently quarantined", registry=r
        )
        self.quarantine_events = Counter(
            "attestmesh_quarantine_events_total",
            "Quarantine decisions by trigger",
            ["trigger"],
            registry=r,
        )
        self.unknown_names = Counter(
            "attestmesh_unknown_name_waits_total",
            "Agent requests naming a workload a replica did not hold, looked for again after "
            "its change feed read once more: found, still unknown (refused), or the feed did "
            "not read in time (refused)",
            ["result"],
            registry=r,
        )
        self.audit_findings = Counter(
            "attestmesh_audit_findings_total",
            "Rejections audit-mode policies recorded without acting, by reason",
            ["reason"],
            registry=r,
        )
        self.tcb_reappraisals = Counter(
            "attestmesh_tcb_reappraisals_total",
            "Claims on record re-appraised after a TCB change, by outcome "
            "(audit, quarantine, deferred, admitted)",
            ["outcome"],
            registry=r,
        )
        self.tcb_collateral_refreshes = Counter(
            "attestmesh_tcb_collateral_refreshes_total",
            "Collateral refreshes for re-appraisal by vendor and result "
            "(unchanged, changed, unavailable, invalid)",
            ["vendor", "result"],
            registry=r,
        )
        self.policy_reloads = Counter(
            "attestmesh_policy_reloads_total",
            "Policy reloads by result",
            ["result"],
            registry=r,
        )
        self.ca_intermediate_expiry = Gauge(
            "attestmesh_ca_intermediate_expiry_timestamp_seconds",
            "notAfter of the signing intermediate CA (Unix time); rotation keeps it months ahead",
            registry=r,
        )
        self.secret_requests = Counter(
            "attestmesh_secret_requests_total",
            "Secret requests by operation (read, wrap, unwrap), result (released, unchanged, "
            "refused, error) and reason",
            ["operation", "result", "reason"],
            registry=r,
        )
        self.crl_signed = Counter(
            "attestmesh_crl_signed_total",
            "CRL sets this replica signed, by who: local (the control plane's own: one replica, "
            "or no shared set yet) or leader (the one set of several replicas, stored for all)",
            ["by"],
            registry=r,
        )
        self.crl_followed = Counter(
            "attestmesh_crl_followed_total",
            "CRL sets another replica (the leader) signed and stored, read and served by this one",
            registry=r,
        )
        self.crl_refused = Counter(
            "attestmesh_crl_refused_total",
            "CRL sets this replica signed that the database refused (it no longer led)",
            registry=r,
        )
        self.serving_cert_renewals = Counter(
            "attestmesh_serving_cert_renewals_total",
            "Re-issues of a listener's serving certificate from the mesh CA by result (ok, failed)",
            ["listener", "result"],
            registry=r,
        )

    # The narrow protocols the adapters count through (attestmesh.controlplane.http.ApiMetrics,
    # xds.server.XdsMetrics): they name an event, not the metrics class.

    def api_rejected(self, endpoint: str, reason: str) -> None:
        self.api_rejections.labels(endpoint, reason).inc()

    def xds_nack(self, type_short: str) -> None:
        self.xds_nacks.labels(type_short).inc()

    def xds_acked(self, type_short: str, seconds: float) -> None:
        self.xds_push_ack_seconds.observe(type_short, seconds)

    def xds_stream(self, delta: int) -> None:
        self.xds_streams.inc(delta)
