"""The broker's policy, apart from its sockets: one handler per message, each returning what to send.

Every handler takes a parsed message and returns the messages to send (``Outgoing``); nothing here touches a
socket, so the policy is tested and read on its own. Tensor frames are carried as received and forwarded
untouched: the broker never reads payload bytes. Who does what: admission.py refuses, ranks.py and workers.py
keep the records of ranks and workers (and of those forgotten), delivery.py carries a request from arrival to
done, mappings.py keeps the vocab mappings, scheduler.py picks workers and writes dispatches, status.py reports;
this module ties them to the messages and to the clock.

Delivery: a request stays with the broker from its arrival until a worker reports it done. A worker
found dead (silent for the liveness period), re-registering, or handing a request back has its
requests put back at the front of their rank's queue, under a new ticket, so a late ``done`` from an earlier
attempt matches nothing. Ranks resend what is outstanding after a broker restart; a request id the
broker already holds is ignored, so resends are idempotent.

Vocab mappings: every request names the mapping it is computed with (``Submit.mapping_digest``). The broker
takes a request only while it holds that mapping (else ``unknown_mapping``: the rank sends it, then the
request again), and a worker that turns out not to hold it hands the request back (``Done.missing_mapping``)
and is sent the mapping again; a request is never computed without its mapping (mappings.py).

A forgotten peer (silent too long, gone, unreachable) is remembered by name for a while, so that its next
message is answered ``forgotten`` with the reason; its old records are never used again (``RankRecord.gone``).

Cost: no handler's work grows with the number of ranks or workers the broker knows. A request costs O(log W) to
dispatch (the service keeps its free workers best first), a peer's message O(1) beyond what it carries, a departure
O(the peers that held state of it), and what that departure has to tell others gathers in ``notices`` (notices.py),
said in one message per peer. Only the heartbeat tick visits every peer, to send each its heartbeat.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

from draftfeed.broker import links
from draftfeed.broker.admission import refuse_hello, refuse_registration, refuse_submit
from draftfeed.broker.deaths import DeathJudge
from draftfeed.broker.delivery import Delivery
from draftfeed.broker.mappings import MappingTable
from draftfeed.broker.notices import Notices
from draftfeed.broker.ranks import RankBook, worker_keys
from draftfeed.broker.records import Outgoing, ServiceRecord, to_rank, to_worker
from draftfeed.broker.scheduler import Scheduler
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.status import THROUGHPUT_WINDOW_S, status_document, status_page
from draftfeed.broker.versions import UpdateBook
from draftfeed.broker.whereabouts import locate
from draftfeed.broker.workers import WorkerBook, model_info_reply
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    Ack,
    Computing,
    Done,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    ModelInfoQuery,
    Register,
    Registered,
    SetVocabMapping,
    StatusQuery,
    StatusReply,
    Submit,
    UpdateTarget,
    WeightsUpdated,
    Welcome,
    Where,
    WorkerHeartbeat,
)
from draftfeed.schemas.tensor_specs import check_frames

log = logging.getLogger("draftfeed.broker")
# what the status' counters count
COUNTERS = ("workers_expired", "ranks_expired", "requeued", "workers_refused", "mappings_resent", "requests_failed")


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
        self.rank_book = RankBook(name, self.instance, clock)
        self.deaths = DeathJudge(self.settings.churn_window_s, clock)
        self.worker_book = WorkerBook(name, self.instance, clock, self.deaths)
        self.ranks = self.rank_book.records
        self.workers = self.worker_book.records
        self.forgotten_ranks = self.rank_book.forgotten
        self.forgotten_workers = self.worker_book.forgotten
        self.mappings = MappingTable(self.workers)
        self.scheduler = Scheduler(self.mappings, clock)
        self.notices = Notices()  # what departures and arrivals tell other peers, said at the next flush
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.updates = UpdateBook()
        self.delivery = Delivery(self.settings, self.mappings, self.scheduler, self.counters, clock, self.deaths)
        self.requeues: Counter[str] = self.delivery.requeues  # why requests went back to the queue (delivery.py)
        # Messages refused before any handler took them, by reason (malformed, wrong_port, protocol_version; their sum
        # is the status' rejected_messages), and submits refused by a handler, by the error code the rank was sent.
        self.rejections: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()

    def service(self, name: str) -> ServiceRecord:
        record = self.services.get(name)
        if record is None:
            record = self.services[name] = ServiceRecord(name)
        return record

    # ------------------------------------------------------------ ranks
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
        known = self.ranks.get(peer)
        if known is not None and known.hello.service != hello.service:
            self.service(known.hello.service).ranks.discard(peer)
        _rank, resumed = self.rank_book.greet(peer, hello, key)
        service.ranks.add(peer)
        welcome = Welcome(
            broker=self.name,
            instance=self.instance,
            resumed=resumed,
            services={name: record.ready_workers for name, record in sorted(self.services.items()) if record.workers or name == hello.service},
            liveness=self.settings.liveness_message,
            worker_keys=worker_keys(service) if key is not None else [],
        )
        return [to_rank(peer, welcome)]

    def on_rank_heartbeat(self, peer: bytes) -> list[Outgoing]:
        return self.rank_book.known(peer, None)[1]

    def on_submit(self, peer: bytes, submit: Submit, frames: list[Any], header_json: bytes | None = None) -> list[Outgoing]:
        """``header_json``: the submit's header as received (validated as ``submit``), forwarded in its dispatches."""
        rank, out = self.rank_book.known(peer, submit.request_id)
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
        return self.delivery.accept(rank, submit, frames, header_json, service)

    def on_set_vocab_mapping(self, peer: bytes, message: SetVocabMapping, frames: list[Any]) -> list[Outgoing]:
        rank, out = self.rank_book.known(peer, message.request_id)
        if rank is None:
            return out
        try:
            check_frames(message.tensors, frames)
        except MalformedMessage as exc:
            return [to_rank(peer, ErrorReply(request_id=message.request_id, message=str(exc)))]
        out = self.mappings.set_for(rank, message, frames)
        out.append(to_rank(peer, Ack(request_id=message.request_id)))
        return out

    def on_model_info(self, peer: bytes, query: ModelInfoQuery) -> list[Outgoing]:
        rank, out = self.rank_book.known(peer, query.request_id)
        if rank is None:
            return out
        service = self.service(rank.hello.service)
        if service.info is None or not service.workers:
            service.info_waiters.append((peer, query.request_id))
            return []
        return [to_rank(peer, model_info_reply(service, query.request_id))]

    def on_status(self, peer: bytes, query: StatusQuery) -> list[Outgoing]:
        return [to_rank(peer, StatusReply(request_id=query.request_id, status=self.status(query)))]

    def on_where(self, peer: bytes, where: Where) -> list[Outgoing]:
        """Where the rank's requests are (whereabouts.py); a rank this broker does not know says hello again."""
        rank, out = self.rank_book.known(peer, None)
        if rank is None:
            return out
        service = self.services.get(rank.hello.service)
        return [to_rank(peer, locate(rank, where.request_ids, self.workers, self.clock(), service))]

    # ------------------------------------------------------------ target versions
    def on_update_target(self, peer: bytes, message: UpdateTarget) -> list[Outgoing]:
        """Every worker of the service below the new version is told to load it (versions.py); its sender hears how
        each went."""
        return self.updates.start(peer, message, self.services.get(message.service))

    def on_weights_updated(self, peer: bytes, message: WeightsUpdated) -> list[Outgoing]:
        """A worker says how its update went; requests waiting for its new version go to it."""
        worker, out = self.worker_book.known(peer)
        if worker is None:
            return out
        if message.ok:
            log.info("broker: worker %s serves target version %d now (%s)", worker.name, message.target_version, message.checkpoint)
        else:
            log.warning("broker: worker %s kept target version %d: %s", worker.name, message.target_version, message.message)
        out = self.updates.answered(worker, message)
        return out + self.scheduler.dispatch(self.service(worker.registration.service))

    def on_rank_bye(self, peer: bytes) -> list[Outgoing]:
        return self._forget_rank(peer, "it said goodbye")

    def _forget_rank(self, peer: bytes, why: str) -> list[Outgoing]:
        """Drop a rank and everything held for it: queued and parked work, its mapping, workers' links to it.

        Every worker that holds a link to it is to forget it (notices.py): at once the ones computing its requests,
        the others at the next flush. Workers are told to forget the rank before they are told to forget its
        mappings (a worker's notices go before any other message to it)."""
        rank = self.rank_book.remove(peer, why)
        if rank is None:
            return []
        service = self.service(rank.hello.service)
        service.ranks.discard(peer)
        service.queue.drop_rank(rank.peer)
        if service.info_waiters:
            service.info_waiters = [(p, r) for p, r in service.info_waiters if p != peer]
        rank.parked.clear()
        self.notices.drop_rank(peer)
        out: list[Outgoing] = []
        links.release_rank(rank, self.workers, self.notices)
        computing = {pending.worker for pending in rank.requests.values() if pending.worker is not None}
        for worker_peer in computing:
            out.extend(self.notices.take("backend", worker_peer))
        for pending in rank.requests.values():
            out.extend(self.mappings.release(pending))
        out.extend(self.mappings.release_rank(rank))
        out.extend(self.scheduler.dispatch(service))
        self._drop_if_unused(service)
        return out

    def _drop_if_unused(self, service: ServiceRecord) -> None:
        """A service with no worker, no rank and nothing queued is forgotten (its target pin with it)."""
        if service.workers or service.queue or service.info_waiters or service.ranks:
            return
        self.services.pop(service.name, None)

    # ------------------------------------------------------------ workers
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
        before = service.ready_workers
        service.add_worker(self.worker_book.add(peer, register, key))
        if key is not None:
            out.extend(self.rank_book.announce_worker_keys(service))  # before its first dispatch reaches a rank
        out.append(to_worker(peer, Registered(broker=self.name, instance=self.instance, liveness=self.settings.liveness_message)))
        self.notices.workers_changed(service, before)
        for waiter, request_id in service.info_waiters:
            out.append(to_rank(waiter, model_info_reply(service, request_id)))
        service.info_waiters.clear()
        return out + self.scheduler.dispatch(service)

    def on_worker_heartbeat(self, peer: bytes, heartbeat: WorkerHeartbeat) -> list[Outgoing]:
        """Its stats, and the pairs whose status changed (links.py)."""
        worker, out = self.worker_book.known(peer)
        if worker is not None:
            worker.rank_links, worker.mappings_held, worker.pair_count = heartbeat.rank_links, heartbeat.mappings, heartbeat.pair_count
            links.record_pairs(worker, heartbeat, self.ranks)
        return out

    def on_computing(self, peer: bytes, computing: Computing) -> list[Outgoing]:
        worker, out = self.worker_book.known(peer)
        if worker is not None and computing.ticket in worker.in_flight:
            worker.in_engine = computing.ticket
        return out

    def on_draining(self, peer: bytes) -> list[Outgoing]:
        worker = self.workers.get(peer)
        if worker is None or worker.draining:
            return []
        service = self.service(worker.registration.service)
        before = service.ready_workers
        service.drains(worker)
        log.info("broker: worker %s is draining: it gets no more work", worker.name)
        self.notices.workers_changed(service, before)
        return []

    def on_worker_bye(self, peer: bytes) -> list[Outgoing]:
        return self._remove_worker(peer, "it said goodbye")

    def on_done(self, peer: bytes, done: Done) -> list[Outgoing]:
        worker, out = self.worker_book.known(peer)
        if worker is None:
            return out
        pending = worker.in_flight.pop(done.ticket, None)
        if worker.in_engine == done.ticket or done.next_ticket is not None:
            worker.in_engine = done.next_ticket if done.next_ticket in worker.in_flight else None
        if pending is None:
            return []  # an earlier attempt, already requeued elsewhere
        pending.worker = None
        service = self.service(worker.registration.service)
        service.in_flight -= 1
        service.credits_changed(worker)
        if done.outcome == "missing_mapping" and done.missing_mapping is not None:
            return self.delivery.missing_mapping(worker, pending, done.missing_mapping, service)
        if done.hands_back:
            return self.delivery.hand_back(worker, pending, done, service)
        out = self.delivery.finished(worker, pending, done, service)
        if done.rank_unreachable and not pending.rank.gone:
            hello = pending.rank.hello
            message = (
                f"worker {worker.name} on {worker.registration.host} cannot reach this rank's data socket "
                f"{hello.data_endpoint}; pass data_endpoint='tcp://<an address workers can reach>:*' to the remote target"
            )
            out.append(to_rank(pending.rank.peer, ErrorReply(message=message, code="unreachable")))
            out.extend(self._forget_rank(pending.rank.peer, f"worker {worker.name} cannot reach its data socket"))
        return out + self.scheduler.dispatch(service)

    def _remove_worker(self, peer: bytes, why: str, *, died: bool = False) -> list[Outgoing]:
        """Forget a worker and requeue what it held. Of a worker that died, the request it was computing (its last
        heartbeat said which) is charged with the death; the ones waiting in its queue are not (workers.py)."""
        removed = self.worker_book.remove(peer, why, died=died)
        if removed is None:
            return []
        worker, requeued = removed
        service = self.service(worker.registration.service)
        before = service.ready_workers
        service.remove_worker(peer)
        service.in_flight -= len(requeued)
        out_updates = self.updates.worker_left(worker)
        self.mappings.worker_left(worker)
        self.notices.drop_worker(peer)
        links.release_worker(worker, self.ranks, self.notices)
        out: list[Outgoing] = []
        if worker.key is not None:
            out.extend(self.rank_book.announce_worker_keys(service))
        self.notices.workers_changed(service, before)
        out.extend(out_updates)
        out.extend(self.delivery.requeue(requeued, service))
        self._drop_if_unused(service)
        return out

    # ------------------------------------------------------------ time
    def on_tick(self) -> list[Outgoing]:
        """Expire silent peers and send everyone a heartbeat; call once per heartbeat interval."""
        now = self.clock()
        out: list[Outgoing] = []
        liveness_s = self.settings.liveness_s
        for peer in self.worker_book.silent(now, liveness_s):
            self.counters["workers_expired"] += 1
            silent = f"silent for {now - self.workers[peer].last_seen:.1f} s (liveness period {liveness_s:.1f} s)"
            out.extend(self._remove_worker(peer, silent, died=True))
        for peer in self.rank_book.silent(now, liveness_s):
            self.counters["ranks_expired"] += 1
            out.extend(self._forget_rank(peer, f"silent for {now - self.ranks[peer].last_seen:.1f} s (liveness period {liveness_s:.1f} s)"))
        beat = pack(Heartbeat(instance=self.instance))  # one encoding for every peer
        out.extend(Outgoing("frontend", peer, beat) for peer in self.ranks)
        out.extend(Outgoing("backend", peer, beat) for peer in self.workers)
        for service in self.services.values():
            while service.completions and now - service.completions[0] > THROUGHPUT_WINDOW_S:
                service.completions.popleft()
        return out + self.notices.flush(tick=True)

    def start_draining(self) -> None:
        """Dispatch nothing more; what workers hold still completes."""
        self.scheduler.draining = True

    @property
    def draining(self) -> bool:
        return self.scheduler.draining

    @property
    def in_flight(self) -> int:
        return self.worker_book.in_flight

    def goodbye(self) -> list[Outgoing]:
        message = pack(Goodbye(instance=self.instance))
        return [Outgoing("frontend", peer, message) for peer in self.ranks] + [Outgoing("backend", peer, message) for peer in self.workers]

    def status(self, query: StatusQuery | None = None) -> dict[str, Any]:
        """The status document: whole (for the metrics endpoint, in process), or one page of it for ``query``, which
        fits one reply however many peers there are (status.py)."""
        broker = broker_summary(self)
        if query is None:
            return status_document(broker, self.clock(), self.services, self.ranks)
        return status_page(broker, self.clock(), self.services, self.ranks, query)


def broker_summary(state: BrokerState) -> dict[str, Any]:
    """The broker's own part of the status: its name, uptime, counters and peer counts."""
    return {
        "broker": state.name,
        "instance": state.instance,
        "uptime_s": round(state.clock() - state.started_at, 3),
        "draining": state.draining,
        "liveness_s": state.settings.liveness_s,
        "counters": {**state.counters, "rejected_messages": sum(state.rejections.values())},
        "requeues": dict(state.requeues),
        "rejections": dict(state.rejections),
        "refusals": dict(state.refusals),
        "dispatched": state.scheduler.dispatched,
        "rank_count": len(state.ranks),
        "worker_count": len(state.workers),
    }
