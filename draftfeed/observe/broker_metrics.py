"""The broker's metrics, read from the status document its loop publishes once per heartbeat interval.

Built at scrape time on the HTTP thread from that document (the same one ``draftfeed status`` prints), so the
broker's loop does no metrics work per message and the scrape never touches its records. Values are as old as
the last heartbeat interval at most.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class BrokerCollector(Collector):
    """``status()``: the latest published status document, or None before the first."""

    def __init__(self, status: Callable[[], dict[str, Any] | None]) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        status = self._status()
        if status is None:
            return
        yield _gauge("draftfeed_broker_up", "1 while the broker routes (0 while it drains)", [((), 0 if status["draining"] else 1)])
        counters = status["counters"]
        yield _counter(
            "draftfeed_broker_requests_routed", "requests handed to workers (dispatches, a requeued request again)", [((), status["dispatched"])]
        )
        yield _counter(
            "draftfeed_broker_messages_rejected",
            "messages refused before their handler, by reason",
            [((reason,), n) for reason, n in sorted(status["rejections"].items())],
            ["reason"],
        )
        yield _counter(
            "draftfeed_broker_requests_refused",
            "submits refused, by error code",
            [((code,), n) for code, n in sorted(status["refusals"].items())],
            ["code"],
        )
        yield _counter(
            "draftfeed_broker_requests_requeued",
            "requests put back in their queue, by cause",
            [((c,), n) for c, n in sorted(status["requeues"].items())],
            ["cause"],
        )
        yield _counter("draftfeed_broker_requests_failed", "requests failed after --max-attempts workers", [((), counters["requests_failed"])])
        yield _counter("draftfeed_broker_workers_expired", "workers forgotten for silence", [((), counters["workers_expired"])])
        yield _counter("draftfeed_broker_ranks_expired", "ranks forgotten for silence", [((), counters["ranks_expired"])])
        services = status["services"]
        ranks = status["ranks"]
        yield _gauge(
            "draftfeed_broker_queue_depth", "requests queued per service", [((name,), s["queued"]) for name, s in services.items()], ["service"]
        )
        waiting = {name: sum(1 for r in ranks if r["service"] == name and r["queued"] > 0) for name in services}
        yield _gauge(
            "draftfeed_broker_waiting_ranks", "ranks with requests queued, per service", [((n,), w) for n, w in waiting.items()], ["service"]
        )
        ready = [((name,), sum(1 for w in s["workers"] if w["state"] != "draining")) for name, s in services.items()]
        yield _gauge("draftfeed_broker_ready_workers", "workers taking work, per service", ready, ["service"])
        workers = [(name, w) for name, s in services.items() for w in s["workers"]]
        labels = ["service", "worker"]
        yield _gauge("draftfeed_broker_worker_in_flight", "requests at each worker", [((n, w["worker"]), w["in_flight"]) for n, w in workers], labels)
        yield _counter("draftfeed_broker_worker_served", "requests each worker served", [((n, w["worker"]), w["served"]) for n, w in workers], labels)
        yield _counter("draftfeed_broker_worker_failed", "requests each worker failed", [((n, w["worker"]), w["failed"]) for n, w in workers], labels)
        yield _counter(
            "draftfeed_broker_worker_handed_back",
            "requests each worker handed back",
            [((n, w["worker"]), w["handed_back"]) for n, w in workers],
            labels,
        )
        yield _gauge(
            "draftfeed_broker_worker_heartbeat_age_seconds",
            "seconds since each worker was last heard",
            [((n, w["worker"]), w["last_heartbeat_s"]) for n, w in workers],
            labels,
        )
        rank_labels = ["service", "rank"]
        yield _gauge(
            "draftfeed_broker_rank_outstanding",
            "requests each rank has at the broker",
            [((r["service"], r["rank"]), r["outstanding"]) for r in ranks],
            rank_labels,
        )
        yield _gauge(
            "draftfeed_broker_rank_queued",
            "requests of each rank waiting for a worker",
            [((r["service"], r["rank"]), r["queued"]) for r in ranks],
            rank_labels,
        )
        yield _gauge(
            "draftfeed_broker_rank_oldest_request_seconds",
            "seconds the oldest request of each rank has been with the broker",
            [((r["service"], r["rank"]), r["oldest_request_s"]) for r in ranks],
            rank_labels,
        )


def _gauge(name: str, documentation: str, samples: list[tuple[tuple[str, ...], float]], labels: list[str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels or [])
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


def _counter(name: str, documentation: str, samples: list[tuple[tuple[str, ...], float]], labels: list[str] | None = None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=labels or [])  # exposed with _total
    for values, value in samples:
        family.add_metric(list(values), value)
    return family
