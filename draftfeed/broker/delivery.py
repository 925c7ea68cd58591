"""Dispatch: a request's life at the broker, from its arrival until a worker reports it done.

A request a rank sends within its credit window is queued under the rank's service and handed out by the
scheduler (scheduler.py). One sent beyond the window (rightly: the rank counts a request done when its result
arrives, the broker when the worker's ``done`` does) is parked until that rank's next ``done``; one beyond twice
the window is answered busy (admission.py). A request a worker hands back, or one held by a worker that is gone,
goes back to the front of its rank's queue, its ticket void so that a late ``done`` of the earlier attempt matches
nothing, unless it has failed on ``--max-attempts`` workers: then its rank is told it failed. A request holds its
vocab mapping from arrival to completion (mappings.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from draftfeed.broker.deaths import DeathJudge
from draftfeed.broker.mappings import MappingTable
from draftfeed.broker.records import Finished, Outgoing, Pending, RankRecord, ServiceRecord, WorkerRecord, to_rank
from draftfeed.broker.scheduler import Scheduler
from draftfeed.broker.settings import BrokerSettings
from draftfeed.schemas.messages import TASKS, Done, ErrorReply, Submit

log = logging.getLogger("draftfeed.broker")


class Delivery:
    def __init__(
        self,
        settings: BrokerSettings,
        mappings: MappingTable,
        scheduler: Scheduler,
        counters: dict[str, int],
        clock: Callable[[], float],
        deaths: DeathJudge,
    ) -> None:
        self.settings = settings
        self.deaths = deaths
        self.mappings = mappings
        self.scheduler = scheduler
        self.counters = counters  # the broker's: requeued, requests_failed, mappings_resent
        self.clock = clock
        # Why requests went back to the queue: worker_gone (its worker died or left while it waited there: no fault
        # of its own), died_in_engine (its worker died computing it: charged), retry (the engine could not run it:
        # charged), draining, missing_mapping, worker_registered_again.
        self.requeues: Counter[str] = Counter()

    def accept(self, rank: RankRecord, submit: Submit, frames: list[Any], header_json: bytes | None, service: ServiceRecord) -> list[Outgoing]:
        """Take on an admitted request: queue it, or park it while its rank's credit window is full."""
        at_window = rank.outstanding >= rank.hello.window
        now = self.clock()
        pending = Pending(rank, submit, frames, now, placed_at=now, request_json=header_json)
        self.mappings.hold(pending)
        rank.requests[submit.request_id] = pending
        rank.submitted += 1
        if at_window:
            # The rank counts a request done when its result arrives, the broker when the worker's done
            # does: a rank may rightly send its next request in between. Park it until that done.
            pending.parked = True
            rank.parked.append(pending)
            return []
        if log.isEnabledFor(logging.DEBUG):
            log.debug("broker: request %d of rank %s queued for service %r", submit.request_id, rank.hello.rank, service.name)
        return self._enqueue(pending, service)

    def _enqueue(self, pending: Pending, service: ServiceRecord) -> list[Outgoing]:
        rank = pending.rank
        rank.peak_outstanding = max(rank.peak_outstanding, rank.outstanding)
        pending.parked, pending.placed_at = False, self.clock()
        service.queue.append(pending)
        return self.scheduler.dispatch(service)

    def hand_back(self, worker: WorkerRecord, pending: Pending, done: Done, service: ServiceRecord) -> list[Outgoing]:
        """The worker gives the request back uncomputed (``done.hands_back``): it goes back to the queue."""
        worker.handed_back += 1
        if done.outcome == "retry":  # the engine could not run it here: it counts against the request
            pending.charge(worker.peer, f"worker {worker.name}: {done.message}")
        if done.outcome == "stalled":  # its rank stopped taking the answer: sent again, once
            if pending.stalled:
                why = f"{pending.describe()}: its answer stalled twice on the way to the rank (last: worker {worker.name}: {done.message})"
                return self._fail(pending, why, service) + self.scheduler.dispatch(service)
            pending.stalled = True
        return self.requeue([(pending, done.outcome)], service)

    def missing_mapping(self, worker: WorkerRecord, pending: Pending, digest: str, service: ServiceRecord) -> list[Outgoing]:
        """The worker lacks a mapping the broker believed it held: forget that belief and send the request again,
        the mapping first. A second time from the same worker counts as a failure of it (it cannot keep one)."""
        self.mappings.worker_lacks(worker, digest)
        worker.handed_back += 1
        self.counters["mappings_resent"] += 1
        log.info(
            "broker: worker %s lacks vocab mapping %s; it gets the mapping again before request %d", worker.name, digest, pending.request.request_id
        )
        if worker.peer in pending.mapping_refused_by:
            pending.charge(worker.peer, f"worker {worker.name} lacked vocab mapping {digest} twice")
        pending.mapping_refused_by.add(worker.peer)
        return self.requeue([(pending, "missing_mapping")], service)

    def finished(self, worker: WorkerRecord, pending: Pending, done: Done, service: ServiceRecord) -> list[Outgoing]:
        """The worker is done with the request and its rank has the answer (or a failure, or nothing: undelivered)."""
        if done.outcome == "served":
            if pending.deaths:
                self.deaths.churn(service.name, f"{pending.describe()}, charged with a worker's death, was served by worker {worker.name}")
            worker.served += 1
            if pending.request.kind in TASKS:
                worker.batches += 1
            service.completions.append(self.clock())
        elif done.outcome == "failed":
            worker.failed += 1
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free, and this runs once per request
            waited_ms = 1000 * (self.clock() - pending.enqueued_at)
            log.debug("broker: %s %s by worker %s, %.1f ms after it arrived", pending.describe(), done.outcome, worker.name, waited_ms)
        return self.complete(pending, service, worker.name, done.outcome)

    def complete(self, pending: Pending, service: ServiceRecord, worker: str | None, outcome: str) -> list[Outgoing]:
        """The request leaves the broker's care (``worker`` said how it went: ``outcome``; None: the broker failed it),
        remembered a while for a rank that asks where it is; its rank's next parked request, if any, takes its place in
        the queue."""
        rank = pending.rank
        if rank.requests.pop(pending.request.request_id, None) is None:
            return []
        rank.remember_finished(pending.request.request_id, Finished(worker, outcome, self.clock()))
        out = self.mappings.release(pending)
        rank.completed += 1
        if rank.parked and not rank.gone:
            out.extend(self._enqueue(rank.parked.popleft(), service))
        return out

    def requeue(self, requeued: list[tuple[Pending, str]], service: ServiceRecord) -> list[Outgoing]:
        """Put requests back at the front of their queue, in their order; fail those out of attempts. Each comes with
        why it goes back (counted in ``requeues``)."""
        out: list[Outgoing] = []
        back: list[Pending] = []
        now = self.clock()
        for pending, cause in sorted(requeued, key=lambda item: item[0].enqueued_at):
            pending.ticket, pending.worker, pending.placed_at = -1, None, now
            if pending.rank.gone:
                continue  # its rank was forgotten; if it came back, it sent the request again under a new record
            if pending.own_failures(self.deaths.churning(service.name)) >= self.settings.max_attempts:
                tries = "; ".join(what for _worker, what in pending.attempts)
                message = (
                    f"{pending.describe()} failed on {pending.failures} workers of service {service.name!r} "
                    f"(--max-attempts {self.settings.max_attempts}): {tries}"
                )
                if pending.deaths:
                    message += (
                        f"; its workers' deaths count as its own: within --churn-window {self.settings.churn_window_s:g} no "
                        "worker of the service died holding nothing, came back, or served a batch that had been in a dying engine"
                    )
                out.extend(self._fail(pending, message, service))
                continue
            self.counters["requeued"] += 1
            self.requeues[cause] += 1
            back.append(pending)
        service.queue.push_front(back)
        return out + self.scheduler.dispatch(service)

    def _fail(self, pending: Pending, message: str, service: ServiceRecord) -> list[Outgoing]:
        """The request will not be tried again: its rank is told why, and it leaves the broker's care."""
        self.counters["requests_failed"] += 1
        log.warning("broker: %s", message)
        out = [to_rank(pending.rank.peer, ErrorReply(request_id=pending.request.request_id, message=message, code="failed"))]
        return out + self.complete(pending, service, None, "failed")
