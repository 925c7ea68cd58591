"""The broker's status document (what ``draftfeed status`` prints), built from its records."""

from __future__ import annotations

from typing import Any

from draftfeed.broker.records import RankRecord, ServiceRecord, WorkerRecord

THROUGHPUT_WINDOW_S = 10.0  # requests per second are counted over this many seconds


def status_document(
    broker: dict[str, Any],
    now: float,
    services: dict[str, ServiceRecord],
    ranks: dict[bytes, RankRecord],
) -> dict[str, Any]:
    """``broker``: the broker's own fields (name, instance, uptime_s, draining, liveness_s, counters)."""
    return {
        **broker,
        "services": {
            name: {
                "task": service.info.task if service.info else None,
                "target": service.info.model_dump() if service.info else None,
                "queued": len(service.queue),
                "requests_per_s": round(len(service.completions) / THROUGHPUT_WINDOW_S, 3),
                "workers": [_worker(w, now) for w in service.workers.values()],
            }
            for name, service in sorted(services.items())
        },
        "ranks": [_rank(r, services[r.hello.service], now) for r in ranks.values()],
    }


def _rank(rank: RankRecord, service: ServiceRecord, now: float) -> dict[str, Any]:
    hello = rank.hello
    return {
        "rank": hello.rank,
        "service": hello.service,
        "host": hello.host,
        "pid": hello.pid,
        "window": hello.window,
        "queued": service.queue.count(rank.peer) + len(rank.parked),
        "outstanding": rank.outstanding,
        "parked": len(rank.parked),
        "peak_outstanding": rank.peak_outstanding,
        "submitted": rank.submitted,
        "completed": rank.completed,
        "last_heartbeat_s": round(now - rank.last_seen, 3),
    }


def _worker(w: WorkerRecord, now: float) -> dict[str, Any]:
    state = "draining" if w.draining else ("busy" if w.in_flight else "idle")
    return {
        "worker": w.name,
        "host": w.registration.host,
        "pid": w.registration.pid,
        "engine": w.registration.engine,
        "state": state,
        "capacity": w.registration.capacity,
        "tensor_parallel": w.registration.tensor_parallel,
        "devices": w.registration.devices,
        "in_flight": len(w.in_flight),
        "served": w.served,
        "batches": w.batches,
        "failed": w.failed,
        "handed_back": w.handed_back,
        "rank_links": w.rank_links,
        "mappings": w.mappings_held,
        "last_heartbeat_s": round(now - w.last_seen, 3),
        "pairs": [pair.model_dump(mode="json") for pair in w.pairs],
    }
