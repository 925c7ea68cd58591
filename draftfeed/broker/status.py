"""The broker's status document (what ``draftfeed status`` prints), built from its records when asked, never per
message or per tick.

Two forms. ``status_document``: the whole document, every worker with its pairs and every rank, for the metrics
endpoint in the broker's own process. ``status_page``: what one ``status`` query gets over the wire, which must fit
one reply (``MAX_HEADER_BYTES``) however large the cluster: the broker's totals and each service's summary always,
then the workers from ``workers_from`` and the ranks from ``ranks_from``, as many as fit ``PAGE_BYTES``; its
``page`` says where the next page of each starts (None: nothing more). A client asks page after page
(observe/status_client.py). A worker whose pairs alone would not fit shows the first ones and how many it left out.
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
    """One page of the document for ``query``: totals and services, then as many workers and ranks as fit."""
    ordered = sorted(services.items())
    document: dict[str, Any] = {**broker, "services": {name: {**_service(s), "workers": []} for name, s in ordered}, "ranks": []}
    workers_total = sum(len(s.workers) for _name, s in ordered)
    page: dict[str, Any] = {"workers_from": query.workers_from, "workers_next": None, "ranks_from": query.ranks_from, "ranks_next": None}
    page.update(workers_total=workers_total, ranks_total=len(ranks), summary=query.summary)
    document["page"] = page
    if query.summary:
        return document
    budget = PAGE_BYTES
    index = 0
    for name, service in ordered:
        for worker in service.workers.values():
            if index >= query.workers_from:
                if budget <= 0:
                    page["workers_next"] = index
                    break
                entry = _worker(worker, now, pairs=query.pairs, budget=budget)
                budget -= _size(entry)
                document["services"][name]["workers"].append(entry)
            index += 1
        if page["workers_next"] is not None:
            break
    if page["workers_next"] is not None:
        page["ranks_next"] = query.ranks_from if query.ranks_from < len(ranks) else None
        return document
    for index, rank in enumerate(ranks.values()):
        if index < query.ranks_from:
            continue
        if budget <= 0:
            page["ranks_next"] = index
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
