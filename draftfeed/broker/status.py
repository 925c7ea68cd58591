"""The broker's status document (what ``draftfeed status`` prints), built from its records when asked, never per
message or per tick.

Two forms. ``status_document``: the whole document, every worker with its pairs and every rank, for the metrics
endpoint in the broker's own process. ``status_page``: what one ``status`` query gets over the wire, which must fit
one reply (``MAX_HEADER_BYTES``) however large the cluster: the broker's totals and each service's summary always,
then the workers from ``workers_from`` and the ranks from ``ranks_from`` (join numbers), as many as fit
``PAGE_BYTES``; its ``page`` says where the next page of each starts (None: nothing more). A client asks page after
page (observe/status_client.py). A worker whose pairs alone would not fit shows the first ones and how many it left out.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from draftfeed.broker.records import RankRecord, ServiceRecord, WorkerRecord
from draftfeed.schemas.messages import StatusQuery
from draftfeed.schemas.protocol import MAX_HEADER_BYTES

THROUGHPUT_WINDOW_S = 10.0  # requests per second are counted over this many seconds
PAGE_BYTES = MAX_HEADER_BYTES // 2  # what one page's workers and ranks may take, leaving room for the rest


def status_document(broker: dict[str, Any], now: float, services: dict[str, ServiceRecord], ranks: dict[bytes, RankRecord]) -> dict[str, Any]:
    """``broker``: the broker's own fields (name, instance, uptime_s, draining, liveness_s, counters)."""
    return {
        **broker,
        "services": {
            name: {**_service(service), "workers": [_worker(w, now, pairs=True) for w in service.workers.values()]}
            for name, service in sorted(services.items())
        },
        "ranks": [_rank(r, services[r.hello.service], now) for r in ranks.values()],
    }


def status_page(
    broker: dict[str, Any], now: float, services: dict[str, ServiceRecord], ranks: dict[bytes, RankRecord], query: StatusQuery
) -> dict[str, Any]:
    """One page of the document for ``query``: totals and services, then as many workers and ranks as fit.

    Workers and ranks are listed in the order they joined, and a page's cursors are join numbers, not positions:
    the broker reorders its records as peers are heard, and peers come and go between pages, yet a client paging
    through sees each peer present throughout once, never one twice."""
    ordered = sorted(services.items())
    document: dict[str, Any] = {**broker, "services": {name: {**_service(s), "workers": []} for name, s in ordered}, "ranks": []}
    workers_total = sum(len(s.workers) for _name, s in ordered)
    page: dict[str, Any] = {"workers_from": query.workers_from, "workers_next": None, "ranks_from": query.ranks_from, "ranks_next": None}
    page.update(workers_total=workers_total, ranks_total=len(ranks), summary=query.summary)
    document["page"] = page
    if query.summary:
        return document
    budget = PAGE_BYTES
    if query.workers_from is not None:
        joined = sorted((w.order, name, w) for name, s in ordered for w in s.workers.values() if w.order >= query.workers_from)
        for order, name, worker in joined:
            if budget <= 0:
                page["workers_next"] = order
                page["ranks_next"] = query.ranks_from  # this page has no room left for ranks
                return document
            entry = _worker(worker, now, pairs=query.pairs, budget=budget)
            budget -= _size(entry)
            document["services"][name]["workers"].append(entry)
    if query.ranks_from is not None:
        for rank in sorted((r for r in ranks.values() if r.order >= query.ranks_from), key=lambda r: r.order):
            if budget <= 0:
                page["ranks_next"] = rank.order
                break
            entry = _rank(rank, services[rank.hello.service], now)
            budget -= _size(entry)
            document["ranks"].append(entry)
    return document


def _size(entry: dict[str, Any]) -> int:
    return len(json.dumps(entry, separators=(",", ":"))) + 1


def _service(service: ServiceRecord) -> dict[str, Any]:
    return {
        "task": service.info.task if service.info else None,
        "target": service.info.model_dump() if service.info else None,
        "queued": len(service.queue),
        "requests_per_s": round(len(service.completions) / THROUGHPUT_WINDOW_S, 3),
        "worker_count": len(service.workers),
        "ready_workers": service.ready_workers,
        "rank_count": len(service.ranks),
        "in_flight": service.in_flight,
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
        # how long its oldest request has been with the broker (0: none): next to the liveness period, a stuck one shows
        "oldest_request_s": round(max((now - p.enqueued_at for p in rank.requests.values()), default=0.0), 3),
    }


def _worker(w: WorkerRecord, now: float, pairs: bool, budget: int | None = None) -> dict[str, Any]:
    state = "draining" if w.draining else ("busy" if w.in_flight else "idle")
    entry: dict[str, Any] = {
        "worker": w.name,
        "host": w.registration.host,
        "pid": w.registration.pid,
        "engine": w.registration.engine,
        "state": state,
        "capacity": w.registration.capacity,
        "tensor_parallel": w.registration.tensor_parallel,
        "devices": w.registration.devices,
        "target_version": w.target_version,
        "checkpoint": w.checkpoint,
        "in_flight": len(w.in_flight),
        "served": w.served,
        "batches": w.batches,
        "failed": w.failed,
        "handed_back": w.handed_back,
        "rank_links": w.rank_links,
        "mappings": w.mappings_held,
        "last_heartbeat_s": round(now - w.last_seen, 3),
        "pair_count": w.pair_count,
        "planes": dict(Counter(f"{pair.plane}/{pair.state}" for pair in w.pairs.values())),
    }
    if pairs:
        listed, left = [], budget if budget is not None else None
        for rank, pair in w.pairs.items():
            item = pair.as_json(rank)
            if left is not None:
                left -= _size(item)
                if left <= 0 and listed:
                    break
            listed.append(item)
        entry["pairs"] = listed
        entry["pairs_omitted"] = len(w.pairs) - len(listed)
    return entry
