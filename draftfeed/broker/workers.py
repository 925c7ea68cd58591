"""Worker registration and expiry: the workers the broker knows, the ones it forgot and why, and who pays for a death.

A worker is known from its registration until it says goodbye, registers again (it lost sight of the broker),
or falls silent for the liveness period. Of a worker that died, only the request its last heartbeat said was in
its engine is charged with the death (it may be a poison batch); the ones waiting in its queue are not. A worker
forgotten as dead that registers again was frozen, not dead: its death charges nothing. What a worker's going
means for the requests it held is the handlers' (state.py); this module holds the records only.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable

from draftfeed.broker.deaths import DeathJudge
from draftfeed.broker.forgotten import ForgottenPeers
from draftfeed.broker.records import Outgoing, Pending, ServiceRecord, WorkerRecord, silent_peers, to_worker
from draftfeed.schemas.messages import ErrorReply, ModelInfoReply, Register

log = logging.getLogger("draftfeed.broker")


def model_info_reply(service: ServiceRecord, request_id: int) -> ModelInfoReply:
    """What the service's workers serve: its target, their names, supervision forms and limits."""
    assert service.info is not None
    workers = sorted(service.workers.values(), key=lambda w: w.name)
    registrations = [w.registration for w in workers]
    return ModelInfoReply(
        request_id=request_id,
        info=service.info,
        workers=[r.worker for r in registrations],
        target_versions=[w.target_version for w in workers],
        supervision=sorted({r.supervision for r in registrations}),
        logit_transform=registrations[0].logit_transform if registrations else None,
        max_positions=service.max_positions,
    )


class WorkerBook:
    def __init__(self, broker: str, instance: str, clock: Callable[[], float], deaths: DeathJudge) -> None:
        self.broker = broker
        self.instance = instance
        self.clock = clock
        self.deaths = deaths
        self.records: OrderedDict[bytes, WorkerRecord] = OrderedDict()  # least recently heard first
        self._order = itertools.count()  # registrations, in order (the scheduler's last tie-break)
        self.forgotten = ForgottenPeers()
        # Requests charged with a worker's death, by worker: a worker that comes back was frozen, not dead.
        self._death_charges: dict[bytes, list[Pending]] = {}

    def known(self, peer: bytes) -> tuple[WorkerRecord | None, list[Outgoing]]:
        """The worker's record (it was heard now), or None and the error that tells it to register again."""
        worker = self.records.get(peer)
        if worker is not None:
            worker.last_seen = self.clock()
            self.records.move_to_end(peer)
            return worker, []
        why = self.forgotten.why(peer)
        if why is not None:
            message = f"broker {self.broker} (instance {self.instance}) forgot this worker: {why}; register again"
            return None, [to_worker(peer, ErrorReply(message=message, code="forgotten"))]
        message = "this broker does not know this worker (it restarted, or the worker was silent too long): register again"
        return None, [to_worker(peer, ErrorReply(message=message, code="unknown_peer"))]

    def add(self, peer: bytes, register: Register, key: str | None) -> WorkerRecord:
        """Record an admitted registration (the caller adds it to its service's workers)."""
        worker = WorkerRecord(
            peer, register, self.clock(), key=key, order=next(self._order), target_version=register.target_version, checkpoint=register.checkpoint
        )
        self.records[peer] = worker
        if self.forgotten.take(peer) is not None:
            self._uncharge_deaths(peer, register.service)
        log.info(
            "broker: worker %s (host %s, pid %d, engine %s, capacity %d) registered for service %r",
            register.worker,
            register.host,
            register.pid,
            register.engine,
            register.capacity,
            register.service,
        )
        return worker

    def remove(self, peer: bytes, why: str, *, died: bool) -> tuple[WorkerRecord, list[tuple[Pending, str]]] | None:
        """Forget a worker (remembering why; the caller takes it out of its service): its record and the requests it
        held, each with why it goes back to the queue (``worker_gone``, ``died_in_engine``: charged with the death,
        ``worker_registered_again``), or None if it was not known."""
        worker = self.records.pop(peer, None)
        if worker is None:
            return None
        log.info(
            "broker: forgot worker %s of service %r: %s; %d requests it held go back to the queue",
            worker.name,
            worker.registration.service,
            why,
            len(worker.in_flight),
        )
        self.forgotten.remember(peer, why)
        pendings = list(worker.in_flight.values())
        worker.in_flight.clear()
        computing = [p for p in pendings if died and p.ticket == worker.in_engine]
        for pending in computing:
            pending.charge(peer, f"worker {worker.name} died with it in its engine ({why})", death=True)
            self._death_charges.setdefault(peer, []).append(pending)
        if died and not pendings:  # one holding requests, none said to be in its engine, may have died starting one
            self.deaths.churn(worker.registration.service, f"worker {worker.name} died holding no request")
        self._death_charges = {w: live for w, ps in self._death_charges.items() if (live := [p for p in ps if not p.finished])}
        left = "worker_gone" if died or why == "it said goodbye" else "worker_registered_again"
        return worker, [(p, "died_in_engine" if p in computing else left) for p in pendings]

    def _uncharge_deaths(self, peer: bytes, service: str) -> None:
        """A worker forgotten as dead registers again: it was frozen, not dead, and its death charges nothing."""
        self.deaths.churn(service, "a worker taken for dead registered again")
        for pending in self._death_charges.pop(peer, []):
            if not pending.finished:
                pending.uncharge(peer)

    def silent(self, now: float, liveness_s: float) -> list[bytes]:
        """The workers not heard for longer than the liveness period."""
        return silent_peers(self.records, now, liveness_s)

    @property
    def in_flight(self) -> int:
        return sum(len(w.in_flight) for w in self.records.values())
