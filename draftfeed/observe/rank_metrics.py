"""A rank's metrics: how long its training loop waited for supervision, what it received, what it asked again."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

# From a batch already there (prefetch doing its job) to a worker that is far behind.
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The connection's counters of requests asked for again or dropped answers, by what happened (ConnectionStats fields).
RETRIES = {
    "lost_over_pair": "an answer lost with its pair group or nixl pair, asked for again",
    "busy_retries": "a request sent again after the broker said its service was busy",
    "resyncs": "a full resend after the broker had forgotten the rank",
    "lost_resent": "a request the broker no longer held (or never had) while the rank waited for it, sent again",
}


class RankMetrics:
    """Its own registry, so that several remote targets in one process never share counters."""

    def __init__(
        self, rank: str, service: str, outstanding: Callable[[], float], stats: Callable[[], Any], oldest: Callable[[], float] = lambda: 0.0
    ) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"rank": rank, "service": service}
        names = list(self._labels)
        self._wait = Histogram(
            "draftfeed_rank_wait_seconds",
            "seconds the training loop waited for each batch's supervision",
            names,
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self._batches = Counter("draftfeed_rank_batches_received", "batches of supervision received", names, registry=self.registry)
        self._bytes = Counter("draftfeed_rank_supervision_bytes", "supervision bytes received", names, registry=self.registry)
        self._skipped = Counter(
            "draftfeed_rank_nonfinite_skipped", "batches iterate() left out: their supervision held NaN or Inf", names, registry=self.registry
        )
        self._store = Counter(
            "draftfeed_rank_store_batches",
            "batches through the supervision store, by source (store: read from it; workers: computed)",
            [*names, "source"],
            registry=self.registry,
        )
        gauge = Gauge("draftfeed_rank_requests_outstanding", "requests sent and not yet answered", names, registry=self.registry)
        gauge.labels(**self._labels).set_function(outstanding)
        gauge = Gauge("draftfeed_rank_oldest_request_seconds", "seconds the oldest unanswered request has waited", names, registry=self.registry)
        gauge.labels(**self._labels).set_function(oldest)
        self.registry.register(_Retries(self._labels, stats))

    def waited(self, seconds: float) -> None:
        self._wait.labels(**self._labels).observe(seconds)

    def skipped_nonfinite(self) -> None:
        self._skipped.labels(**self._labels).inc()

    def from_store(self, hit: bool) -> None:
        """One batch of a rank with a store: read from it (hit) or computed by the workers (and recorded)."""
        self._store.labels(**self._labels, source="store" if hit else "workers").inc()

    def received(self, nbytes: int) -> None:
        self._batches.labels(**self._labels).inc()
        self._bytes.labels(**self._labels).inc(nbytes)


class _Retries(Collector):
    def __init__(self, labels: dict[str, str], stats: Callable[[], Any]) -> None:
        self._labels, self._stats = labels, stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats()
        family = CounterMetricFamily("draftfeed_rank_retries", "requests asked for again, by why", labels=[*self._labels, "why"])
        for why in RETRIES:
            family.add_metric([*self._labels.values(), why], getattr(stats, why))
        yield family
