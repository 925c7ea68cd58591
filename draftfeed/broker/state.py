"""The broker's policy, apart from its sockets: services, queues, credits, ranks, workers, liveness.

Every handler takes a parsed message and returns the messages to send (``Outgoing``); nothing here
touches a socket, so the policy is tested and read on its own. Tensor frames are carried as received
and forwarded untouched: the broker never reads payload bytes.

Delivery: a request stays with the broker from its arrival until a worker reports it done. A worker
found dead (silent for the liveness window), re-registering, or handing a request back has its
requests put back at the front of their rank's queue, under a new ticket, so a late ``done`` from an earlier
attempt matches nothing. Ranks resend what is outstanding after a broker restart; a request id the
broker already holds is ignored, so resends are idempotent.

Vocab mappings: every request names the mapping it is computed with (``Submit.mapping_digest``). The broker
takes a request only while it holds that mapping (else ``unknown_mapping``: the rank sends it, then the
request again), keeps a mapping while a rank uses it or a live request names it, and sends it to a worker
before the first request naming it. A worker that turns out not to hold it hands the request back
(``Done.missing_mapping``) and is sent the mapping again; a request is never computed without its mapping.

A forgotten peer (silent too long, gone, unreachable) is remembered by name for a while, so that its next
message is answered ``forgotten`` with the reason; its old records are never used again (``RankRecord.gone``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from draftfeed.broker.fair_queue import FairQueue
from draftfeed.schemas.frames import pack
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_REQUEST_BYTES, SIGNATURE
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.tensor_specs import check_frames, declared_bytes
from draftfeed.schemas.messages import (
    Ack,
    Done,
    DrainAck,
    DSparkTargetInfo,
    Eagle3TargetInfo,
    ErrorReply,
    ForgetRank,
    ForgetMapping,
    Goodbye,
    Heartbeat,
    Hello,
    Liveness,
    ModelInfoQuery,
    ModelInfoReply,
    Register,
    Registered,
    SetVocabMapping,
    StatusQuery,
    StatusReply,
    Submit,
    PairStatus,
    VocabMapping,
    Welcome,
    WorkerGone,
    WorkerHeartbeat,
    WorkerKeys,
)

Side = Literal["frontend", "backend"]
log = logging.getLogger("draftfeed.broker")
THROUGHPUT_WINDOW_S = 10.0
FORGOTTEN_KEPT = 4096  # peers remembered as forgotten, each with why, for a clear answer to their next message


@dataclass(frozen=True)
class BrokerSettings:
    heartbeat_interval_s: float = 1.0
    liveness: int = 5
    max_queued_per_service: int = 4096
    # Most requests one rank may have at the broker: a rank's hello asking for a larger window is refused.
    max_queued_per_rank: int = 256
    max_attempts: int = 3
    # Largest frame either broker socket takes: libzmq drops a peer that sends a bigger one before allocating it.
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    # Tensor bytes one request may declare, per service (others: max_request_bytes); checked before queueing.
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    service_max_request_bytes: dict[str, int] = field(default_factory=dict)

    def request_limit(self, service: str) -> int:
        return self.service_max_request_bytes.get(service, self.max_request_bytes)

    @property
    def liveness_message(self) -> Liveness:
        return Liveness(heartbeat_interval_s=self.heartbeat_interval_s, liveness=self.liveness)

    @property
    def window_s(self) -> float:
        return self.heartbeat_interval_s * self.liveness


@dataclass
class Outgoing:
    side: Side
    peer: bytes
    frames: list[Any]


@dataclass
class Pending:
    """A rank's request from its arrival until a worker reports it done."""

    rank: "RankRecord"
    request: Submit
    frames: list[Any]
    enqueued_at: float
    ticket: int = -1
    request_json: bytes | None = None  # the request, encoded once for every dispatch of it
    failures: int = 0  # dispatches handed back or lost with a dead worker (a poison batch must not kill every worker)
    excluded: set[bytes] = field(default_factory=set)
    last_error: str | None = None
    finished: bool = False  # completed, or its rank forgotten: it holds no mapping and is never dispatched again
    mapping_refused_by: set[bytes] = field(default_factory=set)  # workers that said they lack its mapping

    @property
    def mapping(self) -> str | None:
        """The vocab mapping it is computed with (its digest), None for the identity."""
        return self.request.mapping_digest

    @property
    def rank_key(self) -> bytes:
        """Its rank, for the service's fair queue."""
        return self.rank.peer


@dataclass
class RankRecord:
    peer: bytes
    hello: Hello
    last_seen: float
    requests: dict[int, Pending] = field(default_factory=dict)  # every live request, by request id
    parked: deque[Pending] = field(default_factory=deque)  # beyond the window, waiting for a done
    outstanding: int = 0  # queued or at a worker
    peak_outstanding: int = 0
    submitted: int = 0
    completed: int = 0
    mapping_digest: str | None = None  # the mapping it set last (it may still have requests naming earlier ones)
    dispatch_fields: bytes | None = None  # this rank's part of every dispatch header, encoded once
    key: str | None = None  # its authenticated CURVE public key, on a secure broker
    gone: bool = False  # forgotten: a later hello of the same rank makes a new record


@dataclass
class WorkerRecord:
    peer: bytes
    registration: Register
    last_seen: float
    in_flight: dict[int, Pending] = field(default_factory=dict)
    mappings_sent: set[str] = field(default_factory=set)
    ranks_served: set[bytes] = field(default_factory=set)
    served: int = 0
    failed: int = 0
    handed_back: int = 0
    last_assigned: int = -1
    draining: bool = False
    rank_links: int = 0
    mappings_held: int = 0
    pairs: list[PairStatus] = field(default_factory=list)  # its data plane to each rank, from its heartbeats
    key: str | None = None  # its authenticated CURVE public key, on a secure broker

    @property
    def free_credits(self) -> int:
        return 0 if self.draining else self.registration.capacity - len(self.in_flight)


@dataclass
class ServiceRecord:
    name: str
    workers: dict[bytes, WorkerRecord] = field(default_factory=dict)
    queue: FairQueue[Pending] = field(default_factory=FairQueue)  # round-robin across ranks (fair_queue.py)
    info_waiters: list[tuple[bytes, int]] = field(default_factory=list)
    completions: deque[float] = field(default_factory=deque)
    # The service's target, fixed by its first worker or by a rank's checked expectation: every worker
    # that registers later must match it, so a mis-launched worker can never feed a run.
    info: Eagle3TargetInfo | DSparkTargetInfo | None = None


@dataclass
class MappingRecord:
    """A vocab mapping, kept while a rank uses it (``users``) or a live request names it (``requests``)."""

    header: SetVocabMapping
    frames: list[Any]
    users: set[bytes] = field(default_factory=set)
    requests: int = 0

    @property
    def needed(self) -> bool:
        return bool(self.users) or self.requests > 0


def to_rank(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
    return Outgoing("frontend", peer, pack(message, list(frames)))


def to_worker(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
    return Outgoing("backend", peer, pack(message, list(frames)))


class BrokerState:
    """Requests queue per service, taken round-robin across its ranks (fair_queue.py), and each goes to the
    worker with the most free credits (workers are not taken round-robin)."""

    def __init__(self, name: str, settings: BrokerSettings | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.instance = uuid.uuid4().hex[:12]
        self.settings = settings or BrokerSettings()
        self.clock = clock
        self.services: dict[str, ServiceRecord] = {}
        self.ranks: dict[bytes, RankRecord] = {}
        self.workers: dict[bytes, WorkerRecord] = {}
        self.mappings: dict[str, MappingRecord] = {}
        self.forgotten_ranks: OrderedDict[bytes, str] = OrderedDict()  # peer -> why, newest last
        self.forgotten_workers: OrderedDict[bytes, str] = OrderedDict()
        self.draining = False
        self.counters = {
            "rejected_messages": 0, "workers_expired": 0, "ranks_expired": 0, "requeued": 0, "workers_refused": 0,
            "mappings_resent": 0,
        }
        self._next_ticket = 0
        self.started_at = time.time()

    def service(self, name: str) -> ServiceRecord:
        record = self.services.get(name)
        if record is None:
            record = self.services[name] = ServiceRecord(name)
        return record

    # ------------------------------------------------------------ ranks
    def _known_rank(self, peer: bytes, request_id: int | None) -> tuple[RankRecord | None, list[Outgoing]]:
        rank = self.ranks.get(peer)
        if rank is None:
            why = self.forgotten_ranks.get(peer)
            if why is not None:
                message = f"broker {self.name} (instance {self.instance}) forgot this rank: {why}; say hello again and resend"
                return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="forgotten"))]
            message = "this broker does not know this rank (it restarted, or the rank was silent too long): say hello again"
            return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="unknown_peer"))]
        rank.last_seen = self.clock()
        return rank, []

    def on_hello(self, peer: bytes, hello: Hello, key: str | None = None) -> list[Outgoing]:
        """``key``: the rank's authenticated public key when the broker is secure."""
        if hello.rank.encode() != peer:
            return [to_rank(peer, ErrorReply(message=f"hello names rank {hello.rank!r}, but this connection is {peer!r}: a rank speaks only for itself"))]
        if hello.window > self.settings.max_queued_per_rank:
            message = (
                f"rank {hello.rank} asks for a prefetch window of {hello.window}, over this broker's cap of "
                f"{self.settings.max_queued_per_rank} requests per rank (--max-queued-per-rank): use prefetch_depth "
                f"{self.settings.max_queued_per_rank} or less"
            )
            log.warning("broker: %s", message)
            return [to_rank(peer, ErrorReply(message=message, code="over_limit"))]
        service = self.service(hello.service)
        if hello.expect is not None:
            if service.info is not None and service.info != hello.expect:
                message = (
                    f"service {service.name!r} serves another target than this rank checked: "
                    f"{hello.expect.describe_mismatch(service.info, 'rank expects', 'workers serve')}"
                )
                return [to_rank(peer, ErrorReply(message=message, code="mismatch"))]
            service.info = hello.expect
        rank = self.ranks.get(peer)
        resumed = rank is not None
        if rank is None:
            self.ranks[peer] = rank = RankRecord(peer, hello, self.clock())
            why = self.forgotten_ranks.pop(peer, None)
            again = f" again (it had been forgotten: {why})" if why else ""
            log.info("broker: rank %s (host %s, pid %d) connected%s for service %r", hello.rank, hello.host, hello.pid, again, hello.service)
        else:  # the same rank again (its link flickered): keep its requests, take its new settings
            rank.hello, rank.last_seen, rank.dispatch_fields = hello, self.clock(), None
        rank.key = key
        welcome = Welcome(
            broker=self.name, instance=self.instance, resumed=resumed, services=sorted(self.services),
            liveness=self.settings.liveness_message, worker_keys=self._worker_keys(service) if key is not None else [],
        )
        return [to_rank(peer, welcome)]

    def on_rank_heartbeat(self, peer: bytes) -> list[Outgoing]:
        return self._known_rank(peer, None)[1]

    def on_submit(self, peer: bytes, submit: Submit, frames: list[Any]) -> list[Outgoing]:
        rank, out = self._known_rank(peer, submit.request_id)
        if rank is None:
            return out
        if submit.request_id in rank.requests:
            return []  # a resend of a request the broker already holds
        refusal = self._refuse_submit(rank, submit, frames)
        if refusal is not None:
            code, message = refusal
            return [to_rank(peer, ErrorReply(request_id=submit.request_id, message=message, code=code))]
        pending = Pending(rank, submit, frames, self.clock())
        if pending.mapping is not None:
            self.mappings[pending.mapping].requests += 1
        rank.requests[submit.request_id] = pending
        rank.submitted += 1
        if rank.outstanding >= rank.hello.window:
            # The rank counts a request done when its result arrives, the broker when the worker's done
            # does: a rank may rightly send its next request in between. Park it until that done.
            rank.parked.append(pending)
            return []
        return self._enqueue(pending)

    def _refuse_submit(self, rank: RankRecord, submit: Submit, frames: list[Any]) -> tuple[str, str] | None:
        name = rank.hello.service
        limit = self.settings.request_limit(name)
        declared = declared_bytes(submit.tensors)
        if declared is not None and declared > limit:
            return "refused", (
                f"request {submit.request_id} declares {declared} bytes of tensors, over the limit of service {name!r} ({limit} "
                f"bytes): send smaller batches, or start the broker with --service-max-request-bytes {name}=BYTES"
            )
        try:
            check_frames(submit.tensors, frames, max_message_bytes=limit)
        except MalformedMessage as exc:
            return "refused", str(exc)
        if submit.mapping_digest is not None and submit.mapping_digest not in self.mappings:
            return "unknown_mapping", (
                f"broker {self.name} holds no vocab mapping {submit.mapping_digest}, which request {submit.request_id} names: "
                "send the mapping, then the request again"
            )
        if rank.outstanding >= rank.hello.window and len(rank.parked) >= rank.hello.window:
            return "refused", (
                f"rank {rank.hello.rank} has {rank.outstanding + len(rank.parked)} requests outstanding, "
                f"its prefetch window is {rank.hello.window}: wait for results before sending more"
            )
        service = self.service(rank.hello.service)
        if service.info is not None and submit.kind in ("eagle3", "dspark") and submit.kind != service.info.task:
            return "refused", f"service {service.name!r} serves {service.info.task} supervision, not {submit.kind}: connect to a {submit.kind} service"
        if len(service.queue) >= self.settings.max_queued_per_service:
            return "busy", f"service {service.name!r} has {len(service.queue)} requests queued, its limit: send again later"
        return None

    def _enqueue(self, pending: Pending) -> list[Outgoing]:
        rank = pending.rank
        rank.outstanding += 1
        rank.peak_outstanding = max(rank.peak_outstanding, rank.outstanding)
        service = self.service(rank.hello.service)
        service.queue.append(pending)
        return self._dispatch(service)

    def on_set_vocab_mapping(self, peer: bytes, message: SetVocabMapping, frames: list[Any]) -> list[Outgoing]:
        rank, out = self._known_rank(peer, message.request_id)
        if rank is None:
            return out
        try:
            check_frames(message.tensors, frames)
        except MalformedMessage as exc:
            return [to_rank(peer, ErrorReply(request_id=message.request_id, message=str(exc)))]
        if rank.mapping_digest != message.digest:
            out = self._release_mapping(rank)
            record = self.mappings.get(message.digest)
            if record is None:
                record = self.mappings[message.digest] = MappingRecord(message, frames)
            record.users.add(peer)
            rank.mapping_digest = message.digest
        out.append(to_rank(peer, Ack(request_id=message.request_id)))
        return out

    def _release_mapping(self, rank: RankRecord) -> list[Outgoing]:
        """The rank no longer uses the mapping it set (requests naming it keep it)."""
        digest, rank.mapping_digest = rank.mapping_digest, None
        record = self.mappings.get(digest) if digest else None
        if record is None:
            return []
        record.users.discard(rank.peer)
        return self._drop_mapping_if_unneeded(digest)

    def _drop_mapping_if_unneeded(self, digest: str) -> list[Outgoing]:
        """Forget a mapping nobody needs, and tell the workers that hold it, which forget it with the broker."""
        record = self.mappings.get(digest)
        if record is None or record.needed:
            return []
        del self.mappings[digest]
        out = []
        for worker in self.workers.values():
            if digest in worker.mappings_sent:
                worker.mappings_sent.discard(digest)
                out.append(to_worker(worker.peer, ForgetMapping(digest=digest)))
        return out

    def _finish(self, pending: Pending) -> list[Outgoing]:
        """A request leaves the broker's care (completed, or its rank forgotten): its mapping may go."""
        if pending.finished:
            return []
        pending.finished = True
        if pending.mapping is None:
            return []
        record = self.mappings.get(pending.mapping)
        if record is not None:
            record.requests -= 1
        return self._drop_mapping_if_unneeded(pending.mapping)

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
        log.info(
            "broker: forgot rank %s of service %r: %s; dropped %d of its requests (%d at workers)",
            rank.hello.rank, rank.hello.service, why, len(rank.requests), sum(1 for p in rank.requests.values() if p.ticket >= 0),
        )
        self._remember_forgotten(self.forgotten_ranks, peer, why)
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
            out.extend(self._finish(pending))
        out.extend(self._release_mapping(rank))
        return out + self._dispatch(service)

    @staticmethod
    def _remember_forgotten(forgotten: OrderedDict[bytes, str], peer: bytes, why: str) -> None:
        forgotten[peer] = why
        forgotten.move_to_end(peer)
        while len(forgotten) > FORGOTTEN_KEPT:
            forgotten.popitem(last=False)

    # ------------------------------------------------------------ workers
    def _known_worker(self, peer: bytes) -> tuple[WorkerRecord | None, list[Outgoing]]:
        worker = self.workers.get(peer)
        if worker is None:
            why = self.forgotten_workers.get(peer)
            if why is not None:
                message = f"broker {self.name} (instance {self.instance}) forgot this worker: {why}; register again"
                return None, [to_worker(peer, ErrorReply(message=message, code="forgotten"))]
            message = "this broker does not know this worker (it restarted, or the worker was silent too long): register again"
            return None, [to_worker(peer, ErrorReply(message=message, code="unknown_peer"))]
        worker.last_seen = self.clock()
        return worker, []

    def _worker_keys(self, service: ServiceRecord) -> list[str]:
        return sorted({w.key for w in service.workers.values() if w.key is not None})

    def _announce_worker_keys(self, service: ServiceRecord) -> list[Outgoing]:
        """Tell the service's ranks (on a secure broker) which workers their data sockets admit."""
        message = WorkerKeys(keys=self._worker_keys(service))
        return [to_rank(c.peer, message) for c in self.ranks.values() if c.key is not None and c.hello.service == service.name]

    def on_register(self, peer: bytes, register: Register, key: str | None = None) -> list[Outgoing]:
        """``key``: the worker's authenticated public key when the broker is secure."""
        if register.worker.encode() != peer:
            return [to_worker(peer, ErrorReply(message=f"registration names worker {register.worker!r}, but this connection is {peer!r}"))]
        out: list[Outgoing] = []
        if peer in self.workers:
            # A worker registers again after it lost sight of the broker; it has dropped its queue and mappings.
            out.extend(self._remove_worker(peer, "it registered again (it had lost sight of this broker)"))
        service = self.service(register.service)
        if service.info is not None and register.info != service.info:
            self.counters["workers_refused"] += 1
            reason = (
                f"worker {register.worker} on {register.host} serves another target than service {service.name!r}: "
                f"{register.info.describe_mismatch(service.info, 'worker has', 'service has')}"
            )
            log.warning("broker: refused registration: %s", reason)
            return out + [to_worker(peer, ErrorReply(message=reason, code="refused"))]
        service.info = register.info
        worker = WorkerRecord(peer, register, self.clock(), key=key)
        self.workers[peer] = worker
        service.workers[peer] = worker
        self.forgotten_workers.pop(peer, None)
        log.info(
            "broker: worker %s (host %s, pid %d, engine %s, capacity %d) registered for service %r",
            register.worker, register.host, register.pid, register.engine, register.capacity, register.service,
        )
        if key is not None:
            out.extend(self._announce_worker_keys(service))  # before its first dispatch reaches a rank
        out.append(to_worker(peer, Registered(broker=self.name, instance=self.instance, liveness=self.settings.liveness_message)))
        for waiter, request_id in service.info_waiters:
            out.append(to_rank(waiter, self._model_info_reply(service, request_id)))
        service.info_waiters.clear()
        out.extend(self._dispatch(service))
        return out

    def on_worker_heartbeat(self, peer: bytes, heartbeat: WorkerHeartbeat) -> list[Outgoing]:
        worker, out = self._known_worker(peer)
        if worker is not None:
            worker.rank_links, worker.mappings_held, worker.pairs = heartbeat.rank_links, heartbeat.mappings, heartbeat.pairs
        return out

    def on_draining(self, peer: bytes) -> list[Outgoing]:
        worker = self.workers.get(peer)
        if worker is not None:
            worker.draining = True
        return [to_worker(peer, DrainAck())]

    def on_worker_bye(self, peer: bytes) -> list[Outgoing]:
        return self._remove_worker(peer, "it said goodbye")

    def on_done(self, peer: bytes, done: Done) -> list[Outgoing]:
        worker, out = self._known_worker(peer)
        if worker is None:
            return out
        pending = worker.in_flight.pop(done.ticket, None)
        if pending is None:
            return []  # an earlier attempt, already requeued elsewhere
        service = self.service(worker.registration.service)
        if done.retry and done.missing_mapping is not None:
            return self._on_missing_mapping(worker, pending, done.missing_mapping, service)
        if done.retry:
            worker.handed_back += 1
            if not worker.draining:  # a draining worker hands work back through no fault of the request
                pending.excluded.add(peer)
                pending.failures += 1
                pending.last_error = f"worker {worker.registration.worker}: {done.message}"
            return self._requeue([pending], service)
        if done.ok:
            worker.served += 1
            service.completions.append(self.clock())
        else:
            worker.failed += 1
        out = self._complete(pending)
        if done.rank_unreachable and not pending.rank.gone:
            hello = pending.rank.hello
            message = (
                f"worker {worker.registration.worker} on {worker.registration.host} cannot reach this rank's data socket "
                f"{hello.data_endpoint}; pass data_endpoint='tcp://<an address workers can reach>:*' to the remote target"
            )
            out.append(to_rank(pending.rank.peer, ErrorReply(message=message, code="unreachable")))
            out.extend(self._forget_rank(pending.rank.peer, f"worker {worker.registration.worker} cannot reach its data socket"))
        return out + self._dispatch(service)

    def _on_missing_mapping(self, worker: WorkerRecord, pending: Pending, digest: str, service: ServiceRecord) -> list[Outgoing]:
        """The worker lacks a mapping the broker believed it held: forget that belief and send the request again,
        the mapping first. A second time from the same worker counts as a failure of it (it cannot keep one)."""
        worker.mappings_sent.discard(digest)
        worker.handed_back += 1
        self.counters["mappings_resent"] += 1
        log.info("broker: worker %s lacks vocab mapping %s; it gets the mapping again before request %d", worker.registration.worker, digest, pending.request.request_id)
        if worker.peer in pending.mapping_refused_by:
            pending.excluded.add(worker.peer)
            pending.failures += 1
            pending.last_error = f"worker {worker.registration.worker} lacked vocab mapping {digest} twice"
        pending.mapping_refused_by.add(worker.peer)
        return self._requeue([pending], service)

    def _complete(self, pending: Pending) -> list[Outgoing]:
        rank = pending.rank
        if rank.requests.pop(pending.request.request_id, None) is None:
            return []
        out = self._finish(pending)
        rank.outstanding -= 1
        rank.completed += 1
        if rank.parked and not rank.gone:
            out.extend(self._enqueue(rank.parked.popleft()))
        return out

    def _requeue(self, pendings: list[Pending], service: ServiceRecord) -> list[Outgoing]:
        """Put requests back at the front of their queue, in their order; fail those out of attempts."""
        out: list[Outgoing] = []
        back: list[Pending] = []
        for pending in sorted(pendings, key=lambda p: p.enqueued_at):
            if pending.rank.gone:
                continue  # its rank was forgotten; if it came back, it sent the request again under a new record
            if pending.failures >= self.settings.max_attempts:
                message = f"request failed on {pending.failures} workers of service {service.name!r}; last: {pending.last_error}"
                out.append(to_rank(pending.rank.peer, ErrorReply(request_id=pending.request.request_id, message=message, code="failed")))
                out.extend(self._complete(pending))
                continue
            self.counters["requeued"] += 1
            back.append(pending)
        service.queue.push_front(back)
        return out + self._dispatch(service)

    def _remove_worker(self, peer: bytes, why: str, *, died: bool = False) -> list[Outgoing]:
        """Forget a worker and requeue what it held; a worker that died counts as a failure of each request."""
        worker = self.workers.pop(peer, None)
        if worker is None:
            return []
        log.info(
            "broker: forgot worker %s of service %r: %s; %d requests it held go back to the queue",
            worker.registration.worker, worker.registration.service, why, len(worker.in_flight),
        )
        self._remember_forgotten(self.forgotten_workers, peer, why)
        service = self.service(worker.registration.service)
        service.workers.pop(peer, None)
        pendings = list(worker.in_flight.values())
        worker.in_flight.clear()
        if died:
            for pending in pendings:
                pending.failures += 1
                pending.last_error = f"worker {worker.registration.worker} died while it held the request"
        # Ranks it served release their pair groups with it (docs/data-planes.md).
        gone = WorkerGone(worker=worker.registration.worker)
        out = [to_rank(rank, gone) for rank in worker.ranks_served if rank in self.ranks]
        if worker.key is not None:
            out.extend(self._announce_worker_keys(service))
        return out + self._requeue(pendings, service)

    # ------------------------------------------------------------ scheduling
    def _dispatch(self, service: ServiceRecord) -> list[Outgoing]:
        if self.draining:
            return []
        out: list[Outgoing] = []
        skipped: list[Pending] = []
        while service.queue:
            if not any(w.free_credits > 0 for w in service.workers.values()):
                break
            pending = service.queue.pop()  # the next rank's oldest request, round-robin across ranks
            if pending.rank.gone:
                continue
            candidates = [w for w in service.workers.values() if w.free_credits > 0 and w.peer not in pending.excluded]
            if not candidates:
                skipped.append(pending)  # every free worker has handed this one back; wait for another
                continue
            # Most free credits first; among equals the one that waited longest since its last request.
            worker = max(candidates, key=lambda w: (w.free_credits, -w.last_assigned))
            out.extend(self._assign(worker, pending))
        service.queue.push_front(skipped)
        return out

    def _assign(self, worker: WorkerRecord, pending: Pending) -> list[Outgoing]:
        out: list[Outgoing] = []
        rank = pending.rank
        digest = pending.mapping
        if digest is not None and digest not in worker.mappings_sent:
            mapping = self.mappings[digest]  # held: a live request keeps its mapping
            out.append(to_worker(worker.peer, VocabMapping(digest=digest, tensors=mapping.header.tensors), mapping.frames))
            worker.mappings_sent.add(digest)
        pending.ticket = self._next_ticket
        self._next_ticket += 1
        worker.in_flight[pending.ticket] = pending
        worker.last_assigned = pending.ticket
        worker.ranks_served.add(rank.peer)
        out.append(Outgoing("backend", worker.peer, [SIGNATURE, self._dispatch_header(pending), *pending.frames]))
        return out

    @staticmethod
    def _dispatch_header(pending: Pending) -> bytes:
        """The ``dispatch`` header (messages.Dispatch) written directly: the hot path's one JSON document,
        from the rank's fields (encoded once per rank) and the request (encoded once per request)."""
        rank = pending.rank
        if rank.dispatch_fields is None:
            hello = rank.hello
            fields = {"rank": hello.rank, "reply_to": hello.data_endpoint, "service": hello.service}
            if hello.data_plane is not None:
                fields["data_plane"] = hello.data_plane.model_dump(mode="json")
            if rank.key is not None:
                fields["reply_key"] = rank.key
            if hello.max_result_bytes is not None:
                fields["max_result_bytes"] = hello.max_result_bytes
            rank.dispatch_fields = json.dumps(fields)[1:-1].encode()
        if pending.request_json is None:
            pending.request_json = pending.request.model_dump_json().encode()
        return b'{"type":"dispatch","ticket":%d,%s,"request":%s}' % (pending.ticket, rank.dispatch_fields, pending.request_json)

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
        for peer in [p for p, c in self.ranks.items() if now - c.last_seen > window]:
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
        self.draining = True

    @property
    def in_flight(self) -> int:
        return sum(len(w.in_flight) for w in self.workers.values())

    def goodbye(self) -> list[Outgoing]:
        message = Goodbye(instance=self.instance)
        return [to_rank(peer, message) for peer in self.ranks] + [to_worker(peer, message) for peer in self.workers]

    # ------------------------------------------------------------ observability
    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {
            "broker": self.name,
            "instance": self.instance,
            "uptime_s": round(time.time() - self.started_at, 3),
            "draining": self.draining,
            "liveness_window_s": self.settings.window_s,
            "counters": dict(self.counters),
            "services": {
                name: {
                    "task": service.info.task if service.info else None,
                    "target": service.info.model_dump() if service.info else None,
                    "queued": len(service.queue),
                    "requests_per_s": round(len(service.completions) / THROUGHPUT_WINDOW_S, 3),
                    "workers": [self._worker_status(w, now) for w in service.workers.values()],
                }
                for name, service in sorted(self.services.items())
            },
            "ranks": [
                {
                    "rank": c.hello.rank,
                    "service": c.hello.service,
                    "host": c.hello.host,
                    "pid": c.hello.pid,
                    "window": c.hello.window,
                    "queued": self.service(c.hello.service).queue.count(c.peer) + len(c.parked),
                    "outstanding": c.outstanding,
                    "parked": len(c.parked),
                    "peak_outstanding": c.peak_outstanding,
                    "submitted": c.submitted,
                    "completed": c.completed,
                    "last_heartbeat_s": round(now - c.last_seen, 3),
                }
                for c in self.ranks.values()
            ],
        }

    @staticmethod
    def _worker_status(w: WorkerRecord, now: float) -> dict[str, Any]:
        state = "draining" if w.draining else ("busy" if w.in_flight else "idle")
        return {
            "worker": w.registration.worker,
            "host": w.registration.host,
            "pid": w.registration.pid,
            "engine": w.registration.engine,
            "state": state,
            "capacity": w.registration.capacity,
            "in_flight": len(w.in_flight),
            "served": w.served,
            "failed": w.failed,
            "handed_back": w.handed_back,
            "rank_links": w.rank_links,
            "mappings": w.mappings_held,
            "last_heartbeat_s": round(now - w.last_seen, 3),
            "pairs": [pair.model_dump(mode="json") for pair in w.pairs],
        }
