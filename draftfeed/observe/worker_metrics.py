"""A worker's metrics: what it computed, how long its forwards took, and what it sent on which plane."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Forward times from a tiny target on a CPU to a long row of a large target on a GPU.
FORWARD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class WorkerMetrics:
    """Its own registry (so that several workers in one process never share counters)."""

    def __init__(self, worker: str, service: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"worker": worker, "service": service}
        names = list(labels)
        self._requests = Counter("draftfeed_worker_requests", "requests answered, by outcome", [*names, "outcome"], registry=self.registry)
        self._forward = Histogram(
            "draftfeed_worker_forward_seconds", "seconds each request spent computing", names, buckets=FORWARD_BUCKETS, registry=self.registry
        )
        self._bytes = Counter(
            "draftfeed_worker_supervision_bytes", "supervision bytes delivered to ranks, by data plane", [*names, "plane"], registry=self.registry
        )
        self._nonfinite = Counter(
            "draftfeed_worker_nonfinite", "batches whose supervision held NaN or Inf (not sent; the rank was told)", names, registry=self.registry
        )
        self._in_flight = Gauge("draftfeed_worker_in_flight", "requests queued at the worker or computing", names, registry=self.registry)
        self._registered = Gauge("draftfeed_worker_registered", "1 while registered with a broker", names, registry=self.registry)
        self._target_version = Gauge(
            "draftfeed_worker_target_version", "the version of the target's weights it serves (docs/versions.md)", names, registry=self.registry
        )
        self._labels = labels

    def spread_over(self, devices: list[str]) -> None:
        """The devices the worker's target runs on, one process each."""
        gauge = Gauge(
            "draftfeed_worker_tensor_parallel",
            "devices (one process each) the worker's target is spread over",
            [*self._labels, "devices"],
            registry=self.registry,
        )
        gauge.labels(**self._labels, devices=",".join(devices)).set(len(devices))

    def watch(self, in_flight: Callable[[], float], registered: Callable[[], float], target_version: Callable[[], float]) -> None:
        """Gauges read when scraped: the worker's queue, its registration and its target version."""
        self._in_flight.labels(**self._labels).set_function(in_flight)
        self._registered.labels(**self._labels).set_function(registered)
        self._target_version.labels(**self._labels).set_function(target_version)

    def computed(self, seconds: float) -> None:
        self._forward.labels(**self._labels).observe(seconds)

    def nonfinite(self) -> None:
        self._nonfinite.labels(**self._labels).inc()

    def answered(self, outcome: str) -> None:
        self._requests.labels(**self._labels, outcome=outcome).inc()

    def delivered(self, plane: str, nbytes: int) -> None:
        self._bytes.labels(**self._labels, plane=plane).inc(nbytes)
