"""The broker's policy, apart from its sockets: one handler per message, each returning what to send.

Every handler takes a parsed message and returns the messages to send (``Outgoing``); nothing here touches a
socket, so the policy is tested and read on its own. Tensor frames are carried as received and forwarded
untouched: the broker never reads payload bytes. Who does what: admission.py refuses, mappings.py keeps the
vocab mappings, scheduler.py picks workers and writes dispatches, status.py reports; this module ties them
to the life of ranks, workers and requests.

Delivery: a request stays with the broker from its arrival until a worker reports it done. A worker
found dead (silent for the liveness window), re-registering, or handing a request back has its
requests put back at the front of their rank's queue, under a new ticket, so a late ``done`` from an earlier
attempt matches nothing. Ranks resend what is outstanding after a broker restart; a request id the
broker already holds is ignored, so resends are idempotent.

Vocab mappings: every request names the mapping it is computed with (``Submit.mapping_digest``). The broker
takes a request only while it holds that mapping (else ``unknown_mapping``: the rank sends it, then the
request again), and a worker that turns out not to hold it hands the request back (``Done.missing_mapping``)
and is sent the mapping again; a request is never computed without its mapping (mappings.py).

A forgotten peer (silent too long, gone, unreachable) is remembered by name for a while, so that its next
message is answered ``forgotten`` with the reason; its old records are never used again (``RankRecord.gone``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from draftfeed.broker.admission import refuse_hello, refuse_registration, refuse_submit
from draftfeed.broker.forgotten import ForgottenPeers
from draftfeed.broker.mappings import MappingTable
from draftfeed.broker.records import Outgoing, Pending, RankRecord, ServiceRecord, WorkerRecord, to_rank, to_worker
from draftfeed.broker.scheduler import Scheduler
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.status import THROUGHPUT_WINDOW_S, status_document
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.messages import (
    Ack,
    Done,
    ErrorReply,
    ForgetRank,
    Goodbye,
    Heartbeat,
    Hello,
    ModelInfoQuery,
    ModelInfoReply,
    Register,
    Registered,
    ServiceWorkers,
    SetVocabMapping,
    StatusQuery,
    StatusReply,
    Submit,
    Welcome,
    WorkerGone,
    WorkerHeartbeat,
    WorkerKeys,
)
from draftfeed.schemas.tensor_specs import check_frames

log = logging.getLogger("draftfeed.broker")


class BrokerState:
    """Requests queue per service, taken round-robin across its ranks (fair_queue.py), and each goes to the
    worker with the most free credits (scheduler.py)."""

    def __init__(self, name: str, settings: BrokerSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.instance = uuid.uuid4().hex[:12]
        self.settings = settings or BrokerSettings()
        self.clock = clock
        self.started_at = clock()
        self.services: dict[str, ServiceRecord] = {}
        self.ranks: dict[bytes, RankRecord] = {}
        self.workers: dict[bytes, WorkerRecord] = {}
        self.mappings = MappingTable()
        self.scheduler = Scheduler(self.mappings)
        self.forgotten_ranks = ForgottenPeers()
        self.forgotten_workers = ForgottenPeers()
        self.counters = {
            "workers_expired": 0,
            "ranks_expired": 0,
            "requeued": 0,
            "workers_refused": 0,
            "mappings_resent": 0,
            "requests_failed": 0,
        }
        # Why requests went back to the queue: worker_gone (its worker died or left while it waited there: no fault
        # of its own), died_in_engine (its worker died computing it: charged), retry (the engine could not run it:
        # charged), draining, missing_mapping, worker_registered_again.
        self.requeues: Counter[str] = Counter()
        # Messages refused before any handler took them, by reason (malformed, wrong_port, protocol_version; their sum
        # is the status' rejected_messages), and submits refused by a handler, by the error code the rank was sent.
        self.rejections: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        # Requests charged with a worker's death, by worker: a worker that comes back was frozen, not dead.
        self._death_charges: dict[bytes, list[Pending]] = {}

    def service(self, name: str) -> ServiceRecord:
        record = self.services.get(name)
        if record is None:
            record = self.services[name] = ServiceRecord(name)
        return record

    # ------------------------------------------------------------ ranks
    def _known_rank(self, peer: bytes, request_id: int | None) -> tuple[RankRecord | None, list[Outgoing]]:
        rank = self.ranks.get(peer)
        if rank is not None:
            rank.last_seen = self.clock()
            return rank, []
        why = self.forgotten_ranks.why(peer)
        if why is not None:
            message = f"broker {self.name} (instance {self.instance}) forgot this rank: {why}; say hello again and resend"
            return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="forgotten"))]
        message = "this broker does not know this rank (it restarted, or the rank was silent too long): say hello again"
        return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="unknown_peer"))]

    def on_hello(self, peer: bytes, hello: Hello, key: str | None = None) -> list[Outgoing]:
        """``key``: the rank's authenticated public key when the broker is secure."""
        refusal = refuse_hello(peer, hello, self.settings, self.services.get(hello.service) or ServiceRecord(hello.service))
        if refusal is not None:
            code, message = refusal
            log.warning("broker: refused the hello of rank %s: %s", hello.rank, message)
            return [to_rank(peer, ErrorReply(message=message, code=code))]
        service = self.service(hello.service)
        if hello.expect is not None:
            service.info = hello.expect
        rank = self.ranks.get(peer)
        resumed = rank is not None
        if rank is None:
            self.ranks[peer] = rank = RankRecord(peer, hello, self.clock())
            why = self.forgotten_ranks.take(peer)
            again = f" again (it had been forgotten: {why})" if why else ""
            log.info("broker: rank %s (host %s, pid %d) connected%s for service %r", hello.rank, hello.host, hello.pid, again, hello.service)
        else:  # the same rank again (its link flickered): keep its requests, take its new settings
            rank.hello, rank.last_seen, rank.dispatch_fields = hello, self.clock(), None
        rank.key = key
        welcome = Welcome(
            broker=self.name,
            instance=self.instance,
            resumed=resumed,
            services={name: record.ready_workers for name, record in sorted(self.services.items()) if record.workers or name == hello.service},
            liveness=self.settings.liveness_message,
            worker_keys=self._worker_keys(service) if key is not None else [],
        )
        return [to_rank(peer, welcome)]

    def on_rank_heartbeat(self, peer: bytes) -> list[Outgoing]:
        return self._known_rank(peer, None)[1]

    def on_submit(self, peer: bytes, submit: Submit, frames: list[Any], header_json: bytes | None = None) -> list[Outgoing]:
        """``header_json``: the submit's header as received (validated as ``submit``), forwarded in its dispatches."""
        rank, out = self._known_rank(peer, submit.request_id)
        if rank is None:
            return out
        if submit.request_id in rank.requests:
            return []  # a resend of a request the broker already holds
        service = self.service(rank.hello.service)
        refusal = refuse_submit(self.name, rank, submit, frames, self.settings, service, self.mappings)
        if refusal is not None:
            code, message = refusal
            self.refusals[code] += 1
            return [to_rank(peer, ErrorReply(request_id=submit.request_id, message=message, code=code))]
        at_window = rank.outstanding >= rank.hello.window
        pending = Pending(rank, submit, frames, self.clock(), request_json=header_json)
        self.mappings.hold(pending)
        rank.requests[submit.request_id] = pending
        rank.submitted += 1
        if at_window:
            # The rank counts a request done when its result arrives, the broker when the worker's done
            # does: a rank may rightly send its next request in between. Park it until that done.
            rank.parked.append(pending)
            return []
        if log.isEnabledFor(logging.DEBUG):
            log.debug("broker: request %d of rank %s queued for service %r", submit.request_id, rank.hello.rank, service.name)
        return self._enqueue(pending, service)

    def _enqueue(self, pending: Pending, service: ServiceRecord) -> list[Outgoing]:
        rank = pending.rank
        rank.peak_outstanding = max(rank.peak_outstanding, rank.outstanding)
        service.queue.append(pending)
        return self.scheduler.dispatch(service)

    def on_set_vocab_mapping(self, peer: bytes, message: SetVocabMapping, frames: list[Any]) -> list[Outgoing]:
        rank, out = self._known_rank(peer, message.request_id)
        if rank is None:
            return out
        try:
            check_frames(message.tensors, frames)
        except MalformedMessage as exc:
            return [to_rank(peer, ErrorReply(request_id=message.request_id, message=str(exc)))]
        out = self.mappings.set_for(rank, message, frames, self.workers.values())
        out.append(to_rank(peer, Ack(request_id=message.request_id)))
        return out

    def on_model_info(self, peer: bytes, query: ModelInfoQuery) -> list[Outgoing]:
        rank, out = self._known_rank(peer, query.request_id)
        if rank is None:
            return out
        service = self.service(rank.hello.service)
        if service.info is None or not service.workers:
            service.info_waiters.append((peer, query.request_id))
            return []
        return [to_rank(peer, self._model_info_reply(service, query.request_id))]

    @staticmethod
    def _model_info_reply(service: ServiceRecord, request_id: int) -> ModelInfoReply:
        assert service.info is not None
        registrations = sorted((w.registration for w in service.workers.values()), key=lambda r: r.worker)
        return ModelInfoReply(
            request_id=request_id,
            info=service.info,
            workers=[r.worker for r in registrations],
            supervision=sorted({r.supervision for r in registrations}),
            logit_transform=registrations[0].logit_transform if registrations else None,
            max_positions=service.max_positions,
        )

    def on_status(self, peer: bytes, query: StatusQuery) -> list[Outgoing]:
        return [to_rank(peer, StatusReply(request_id=query.request_id, status=self.status()))]

    def on_rank_bye(self, peer: bytes) -> list[Outgoing]:
        return self._forget_rank(peer, "it said goodbye")

    def _forget_rank(self, peer: bytes, why: str) -> list[Outgoing]:
        """Drop a rank and everything held for it: queued and parked work, its mapping, workers' links to it.

        Workers are told to forget the rank before they are told to forget its mappings."""
        rank = self.ranks.pop(peer, None)
        if rank is None:
            return []
        rank.gone = True
        at_workers = sum(1 for p in rank.requests.values() if p.ticket >= 0)
        log.info(
            "broker: forgot rank %s of service %r: %s; dropped %d of its requests (%d at workers)",
            rank.hello.rank,
            rank.hello.service,
            why,
            len(rank.requests),
            at_workers,
        )
        self.forgotten_ranks.remember(peer, why)
        service = self.service(rank.hello.service)
        service.queue.drop_rank(rank.peer)
        service.info_waiters = [(p, r) for p, r in service.info_waiters if p != peer]
        rank.parked.clear()
        out: list[Outgoing] = []
        forget = ForgetRank(rank=rank.hello.rank, reply_to=rank.hello.data_endpoint)
        for worker in self.workers.values():
            if peer in worker.ranks_served:
                worker.ranks_served.discard(peer)
                out.append(to_worker(worker.peer, forget))
        for pending in rank.requests.values():
            out.extend(self.mappings.release(pending, self.workers.values()))
        out.extend(self.mappings.release_rank(rank, self.workers.values()))
        out.extend(self.scheduler.dispatch(service))
        self._drop_if_unused(service)
        return out

    # ------------------------------------------------------------ workers
    def _known_worker(self, peer: bytes) -> tuple[WorkerRecord | None, list[Outgoing]]:
        worker = self.workers.get(peer)
        if worker is not None:
            worker.last_seen = self.clock()
            return worker, []
        why = self.forgotten_workers.why(peer)
        if why is not None:
            message = f"broker {self.name} (instance {self.instance}) forgot this worker: {why}; register again"
            return None, [to_worker(peer, ErrorReply(message=message, code="forgotten"))]
        message = "this broker does not know this worker (it restarted, or the worker was silent too long): register again"
        return None, [to_worker(peer, ErrorReply(message=message, code="unknown_peer"))]

    def _announce_service_workers(self, service: ServiceRecord) -> list[Outgoing]:
        """Tell the service's ranks how many ready workers it has now."""
        message = ServiceWorkers(service=service.name, workers=service.ready_workers)
        return [to_rank(r.peer, message) for r in self.ranks.values() if r.hello.service == service.name]

    def _drop_if_unused(self, service: ServiceRecord) -> None:
        """A service with no worker, no rank and nothing queued is forgotten (its target pin with it)."""
        if service.workers or service.queue or service.info_waiters or any(r.hello.service == service.name for r in self.ranks.values()):
            return
        self.services.pop(service.name, None)

    def _worker_keys(self, service: ServiceRecord) -> list[str]:
        return sorted({w.key for w in service.workers.values() if w.key is not None})

    def _announce_worker_keys(self, service: ServiceRecord) -> list[Outgoing]:
        """Tell the service's ranks (on a secure broker) which workers their data sockets admit."""
        message = WorkerKeys(keys=self._worker_keys(service))
        return [to_rank(r.peer, message) for r in self.ranks.values() if r.key is not None and r.hello.service == service.name]

    def on_register(self, peer: bytes, register: Register, key: str | None = None) -> list[Outgoing]:
        """``key``: the worker's authenticated public key when the broker is secure."""
        out: list[Outgoing] = []
        if peer in self.workers and register.worker.encode() == peer:
            # A worker registers again after it lost sight of the broker; it has dropped its queue and mappings.
            out.extend(self._remove_worker(peer, "it registered again (it had lost sight of this broker)"))
        service = self.service(register.service)
        refusal = refuse_registration(peer, register, service)
        if refusal is not None:
            self.counters["workers_refused"] += 1
            log.warning("broker: refused registration: %s", refusal)
            return out + [to_worker(peer, ErrorReply(message=refusal, code="refused"))]
        service.info = register.info
        worker = WorkerRecord(peer, register, self.clock(), key=key)
        self.workers[peer] = worker
        service.workers[peer] = worker
        if self.forgotten_workers.take(peer) is not None:
            self._uncharge_deaths(peer)
        log.info(
            "broker: worker %s (host %s, pid %d, engine %s, capacity %d) registered for service %r",
            register.worker,
            register.host,
            register.pid,
            register.engine,
            register.capacity,
            register.service,
        )
        if key is not None:
            out.extend(self._announce_worker_keys(service))  # before its first dispatch reaches a rank
        out.append(to_worker(peer, Registered(broker=self.name, instance=self.instance, liveness=self.settings.liveness_message)))
        out.extend(self._announce_service_workers(service))
        for waiter, request_id in service.info_waiters:
            out.append(to_rank(waiter, self._model_info_reply(service, request_id)))
        service.info_waiters.clear()
        return out + self.scheduler.dispatch(service)

    def on_worker_heartbeat(self, peer: bytes, heartbeat: WorkerHeartbeat) -> list[Outgoing]:
        worker, out = self._known_worker(peer)
        if worker is not None:
            worker.rank_links, worker.mappings_held, worker.pairs = heartbeat.rank_links, heartbeat.mappings, heartbeat.pairs
            worker.in_engine = heartbeat.in_engine
        return out

    def on_draining(self, peer: bytes) -> list[Outgoing]:
        worker = self.workers.get(peer)
        if worker is None or worker.draining:
            return []
        worker.draining = True
        log.info("broker: worker %s is draining: it gets no more work", worker.name)
        return self._announce_service_workers(self.service(worker.registration.service))

    def on_worker_bye(self, peer: bytes) -> list[Outgoing]:
        return self._remove_worker(peer, "it said goodbye")

    def on_done(self, peer: bytes, done: Done) -> list[Outgoing]:
        worker, out = self._known_worker(peer)
        if worker is None:
            return out
        pending = worker.in_flight.pop(done.ticket, None)
        if pending is None:
            return []  # an earlier attempt, already requeued elsewhere
        if worker.in_engine == done.ticket:
            worker.in_engine = None
        service = self.service(worker.registration.service)
        if done.outcome == "missing_mapping" and done.missing_mapping is not None:
            return self._on_missing_mapping(worker, pending, done.missing_mapping, service)
        if done.hands_back:
            worker.handed_back += 1
            if done.outcome == "retry":  # the engine could not run it here: it counts against the request
                pending.charge(peer, f"worker {worker.name}: {done.message}")
            return self._requeue([(pending, done.outcome)], service)
        if done.outcome == "served":
            worker.served += 1
            if pending.request.kind in ("eagle3", "dspark"):
                worker.batches += 1
            service.completions.append(self.clock())
        elif done.outcome == "failed":
            worker.failed += 1
        if log.isEnabledFor(logging.DEBUG):  # describe() is not free, and this runs once per request
            waited_ms = 1000 * (self.clock() - pending.enqueued_at)
            log.debug("broker: %s %s by worker %s, %.1f ms after it arrived", pending.describe(), done.outcome, worker.name, waited_ms)
        out = self._complete(pending, service)
        if done.rank_unreachable and not pending.rank.gone:
            hello = pending.rank.hello
            message = (
                f"worker {worker.name} on {worker.registration.host} cannot reach this rank's data socket "
                f"{hello.data_endpoint}; pass data_endpoint='tcp://<an address workers can reach>:*' to the remote target"
            )
            out.append(to_rank(pending.rank.peer, ErrorReply(message=message, code="unreachable")))
            out.extend(self._forget_rank(pending.rank.peer, f"worker {worker.name} cannot reach its data socket"))
        return out + self.scheduler.dispatch(service)

    def _on_missing_mapping(self, worker: WorkerRecord, pending: Pending, digest: str, service: ServiceRecord) -> list[Outgoing]:
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
        return self._requeue([(pending, "missing_mapping")], service)

    def _complete(self, pending: Pending, service: ServiceRecord) -> list[Outgoing]:
        rank = pending.rank
        if rank.requests.pop(pending.request.request_id, None) is None:
            return []
        out = self.mappings.release(pending, self.workers.values())
        rank.completed += 1
        if rank.parked and not rank.gone:
            out.extend(self._enqueue(rank.parked.popleft(), service))
        return out

    def _requeue(self, requeued: list[tuple[Pending, str]], service: ServiceRecord) -> list[Outgoing]:
        """Put requests back at the front of their queue, in their order; fail those out of attempts. Each comes with
        why it goes back (counted in ``requeues``)."""
        out: list[Outgoing] = []
        back: list[Pending] = []
        for pending, cause in sorted(requeued, key=lambda item: item[0].enqueued_at):
            pending.ticket = -1
            if pending.rank.gone:
                continue  # its rank was forgotten; if it came back, it sent the request again under a new record
            if pending.failures >= self.settings.max_attempts:
                self.counters["requests_failed"] += 1
                tries = "; ".join(what for _worker, what in pending.attempts)
                message = (
                    f"{pending.describe()} failed on {pending.failures} workers of service {service.name!r} "
                    f"(--max-attempts {self.settings.max_attempts}): {tries}"
                )
                log.warning("broker: %s", message)
                out.append(to_rank(pending.rank.peer, ErrorReply(request_id=pending.request.request_id, message=message, code="failed")))
                out.extend(self._complete(pending, service))
                continue
            self.counters["requeued"] += 1
            self.requeues[cause] += 1
            back.append(pending)
        service.queue.push_front(back)
        return out + self.scheduler.dispatch(service)

    def _remove_worker(self, peer: bytes, why: str, *, died: bool = False) -> list[Outgoing]:
        """Forget a worker and requeue what it held. Of a worker that died, the request it was computing (its last
        heartbeat said which) is charged with the death; the ones waiting in its queue are not."""
        worker = self.workers.pop(peer, None)
        if worker is None:
            return []
        log.info(
            "broker: forgot worker %s of service %r: %s; %d requests it held go back to the queue",
            worker.name,
            worker.registration.service,
            why,
            len(worker.in_flight),
        )
        self.forgotten_workers.remember(peer, why)
        service = self.service(worker.registration.service)
        service.workers.pop(peer, None)
        pendings = list(worker.in_flight.values())
        worker.in_flight.clear()
        computing = [p for p in pendings if died and p.ticket == worker.in_engine]
        for pending in computing:
            pending.charge(peer, f"worker {worker.name} died with it in its engine ({why})")
            self._death_charges.setdefault(peer, []).append(pending)
        self._death_charges = {w: live for w, ps in self._death_charges.items() if (live := [p for p in ps if not p.finished])}
        # Ranks it served release their pair groups with it (docs/data-planes.md).
        gone = WorkerGone(worker=worker.name)
        out = [to_rank(rank, gone) for rank in worker.ranks_served if rank in self.ranks]
        if worker.key is not None:
            out.extend(self._announce_worker_keys(service))
        out.extend(self._announce_service_workers(service))
        left = "worker_gone" if died or why == "it said goodbye" else "worker_registered_again"
        out.extend(self._requeue([(p, "died_in_engine" if p in computing else left) for p in pendings], service))
        self._drop_if_unused(service)
        return out

    def _uncharge_deaths(self, peer: bytes) -> None:
        """A worker forgotten as dead registers again: it was frozen, not dead, and its death charges nothing."""
        for pending in self._death_charges.pop(peer, []):
            if not pending.finished:
                pending.uncharge(peer)

    # ------------------------------------------------------------ time
    def on_tick(self) -> list[Outgoing]:
        """Expire silent peers and send everyone a heartbeat; call once per heartbeat interval."""
        now = self.clock()
        out: list[Outgoing] = []
        window = self.settings.window_s
        for peer in [p for p, w in self.workers.items() if now - w.last_seen > window]:
            self.counters["workers_expired"] += 1
            silent = f"silent for {now - self.workers[peer].last_seen:.1f} s (liveness window {window:.1f} s)"
            out.extend(self._remove_worker(peer, silent, died=True))
        for peer in [p for p, r in self.ranks.items() if now - r.last_seen > window]:
            self.counters["ranks_expired"] += 1
            out.extend(self._forget_rank(peer, f"silent for {now - self.ranks[peer].last_seen:.1f} s (liveness window {window:.1f} s)"))
        beat = Heartbeat(instance=self.instance)
        out.extend(to_rank(peer, beat) for peer in self.ranks)
        out.extend(to_worker(peer, beat) for peer in self.workers)
        for service in self.services.values():
            while service.completions and now - service.completions[0] > THROUGHPUT_WINDOW_S:
                service.completions.popleft()
        return out

    def start_draining(self) -> None:
        """Dispatch nothing more; what workers hold still completes."""
        self.scheduler.draining = True

    @property
    def draining(self) -> bool:
        return self.scheduler.draining

    @property
    def in_flight(self) -> int:
        return sum(len(w.in_flight) for w in self.workers.values())

    def goodbye(self) -> list[Outgoing]:
        message = Goodbye(instance=self.instance)
        return [to_rank(peer, message) for peer in self.ranks] + [to_worker(peer, message) for peer in self.workers]

    def status(self) -> dict[str, Any]:
        now = self.clock()
        broker = {
            "broker": self.name,
            "instance": self.instance,
            "uptime_s": round(now - self.started_at, 3),
            "draining": self.draining,
            "liveness_window_s": self.settings.window_s,
            "counters": {**self.counters, "rejected_messages": sum(self.rejections.values())},
            "requeues": dict(self.requeues),
            "rejections": dict(self.rejections),
            "refusals": dict(self.refusals),
            "dispatched": self.scheduler.dispatched,
        }
        return status_document(broker, now, self.services, self.ranks)
