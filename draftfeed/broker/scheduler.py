"""Which worker gets a service's next request, and the dispatch that hands it over.

Policy: requests leave a service's queue round-robin across ranks (fair_queue.py); each goes to the worker
with the most free credits, ties to the one that waited longest since its last request, skipping workers
the request already failed on and those whose target version it does not take (versions.py). A request no free
worker takes waits at the front of its rank's queue for another worker. Nothing is dispatched while the broker drains. The vocab mapping a request
names goes to the worker before the request, if the worker does not hold it.

Cost: the service keeps its free workers best first (free_workers.py), so a dispatch costs O(log W) whatever the
number of workers and ranks, and a call with no free worker or nothing queued O(1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from draftfeed.broker.mappings import MappingTable
from draftfeed.broker.records import Outgoing, Pending, ServiceRecord, WorkerRecord
from draftfeed.broker.versions import fits, newest_version
from draftfeed.schemas.messages import dispatch_header, dispatch_rank_fields
from draftfeed.schemas.protocol import SIGNATURE

log = logging.getLogger("draftfeed.broker")


class Scheduler:
    def __init__(self, mappings: MappingTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.mappings = mappings
        self.clock = clock
        self.draining = False
        self._next_ticket = 0

    @property
    def dispatched(self) -> int:
        """Dispatches so far (each ticket is one)."""
        return self._next_ticket

    def dispatch(self, service: ServiceRecord) -> list[Outgoing]:
        """Hand out as much of the service's queue as its workers' free credits take."""
        if self.draining or not service.queue:
            return []
        out: list[Outgoing] = []
        waiting: list[Pending] = []
        queue, free = service.queue, service.free
        newest: int | None = None  # the service's newest version, found once a call if a request asks for the latest
        while queue and len(free):
            pending = queue.pop()  # the next rank's oldest request, round-robin across ranks
            if pending.rank.gone:
                continue
            wanted = pending.request.target_version
            if wanted is None:
                worker = free.pick(pending.excluded)
            else:
                if newest is None and wanted.policy == "latest":
                    newest = newest_version(service)
                worker = free.pick(pending.excluded, lambda w, wanted=wanted, newest=newest: fits(wanted, w.target_version, newest or 0))
            if worker is None:
                waiting.append(pending)  # every free worker has failed on this one, or serves another version: wait
                continue
            self._assign(worker, pending, out)
            service.in_flight += 1
            service.credits_changed(worker)
        if waiting:
            queue.push_front(waiting)
        return out

    def _assign(self, worker: WorkerRecord, pending: Pending, out: list[Outgoing]) -> None:
        """Give ``pending`` to ``worker``: what to send (its mapping if the worker lacks it, then the dispatch) goes to ``out``."""
        if pending.mapping is not None:
            out.extend(self.mappings.send_before(worker, pending))
        pending.ticket = self._next_ticket
        pending.worker = worker.peer
        pending.placed_at = self.clock()
        self._next_ticket += 1
        worker.in_flight[pending.ticket] = pending
        worker.last_assigned = pending.ticket
        rank = pending.rank
        if rank.peer not in worker.ranks_served:
            worker.ranks_served.add(rank.peer)
            rank.workers_served.add(worker.peer)
        if rank.dispatch_fields is None:
            rank.dispatch_fields = dispatch_rank_fields(rank.hello, rank.key)
        if pending.request_json is None:
            pending.request_json = pending.request.model_dump_json().encode()
        header = dispatch_header(pending.ticket, rank.dispatch_fields, pending.request_json)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "broker: request %d of rank %s to worker %s (ticket %d)", pending.request.request_id, rank.hello.rank, worker.name, pending.ticket
            )
        out.append(Outgoing("backend", worker.peer, [SIGNATURE, header, *pending.frames]))
