"""Where a rank's requests are, for the rank that asks (``where``): the broker's answer to "is my request lost?".

A rank asks about each request whose answer has shown no sign of progress for a liveness period. Each is, as the
broker sees it: queued for its service, parked beyond the rank's window, at a named worker (waiting in its queue, or
computing: the worker's last word said so), done (it left the broker's care: which worker reported it and how, and
when; its answer should have reached the rank by then), or unknown (this broker never had it, or forgot it). The
rank sends a done or unknown request again: so a request the rank holds is never unknown to the broker for longer
than about a liveness period, whatever lost it. Pure: O(the requests asked about).
"""

from __future__ import annotations

from collections.abc import Mapping

from draftfeed.broker.records import RankRecord, ServiceRecord, WorkerRecord
from draftfeed.broker.versions import waiting_note
from draftfeed.schemas.messages import Place, Whereabouts


def locate(
    rank: RankRecord, request_ids: list[int], workers: Mapping[bytes, WorkerRecord], now: float, service: ServiceRecord | None = None
) -> Whereabouts:
    """``service``: the rank's, for why a queued request waits (a target version no live worker serves)."""
    return Whereabouts(places=[_place(rank, request_id, workers, now, service) for request_id in request_ids])


def _place(rank: RankRecord, request_id: int, workers: Mapping[bytes, WorkerRecord], now: float, service: ServiceRecord | None) -> Place:
    pending = rank.requests.get(request_id)
    if pending is None:
        finished = rank.finished.get(request_id)
        if finished is None:
            return Place(request_id=request_id, place="unknown")
        age = max(0.0, now - finished.at)
        return Place(request_id=request_id, place="done", age_s=age, worker=finished.worker, outcome=finished.outcome)
    age = max(0.0, now - pending.placed_at)
    if pending.worker is not None:
        worker = workers.get(pending.worker)
        name = worker.name if worker is not None else pending.worker.decode(errors="replace")
        computing = worker is not None and worker.in_engine == pending.ticket
        return Place(request_id=request_id, place="computing" if computing else "at_worker", age_s=age, worker=name)
    note = waiting_note(pending.request.target_version, service) if service is not None and not pending.parked else None
    return Place(request_id=request_id, place="parked" if pending.parked else "queued", age_s=age, note=note)
