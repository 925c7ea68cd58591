"""The broker's policy, apart from its sockets: services, queues, credits, clients and mappings.

Every handler takes a parsed message and returns the messages to send (``Outgoing``); nothing here
touches a socket, so the policy is tested and read on its own. Tensor frames are carried as received
and forwarded untouched: the broker never reads payload bytes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import (
    Ack,
    Dispatch,
    Done,
    Eagle3TargetInfo,
    ErrorReply,
    ForgetMapping,
    Hello,
    ModelInfoQuery,
    ModelInfoReply,
    Register,
    Registered,
    SetVocabMapping,
    StatusQuery,
    StatusReply,
    Submit,
    VocabMapping,
    Welcome,
)

Side = Literal["frontend", "backend"]


@dataclass
class Outgoing:
    side: Side
    peer: bytes
    frames: list[Any]


@dataclass
class Pending:
    """A rank's request from its arrival until a worker reports it done."""

    ticket: int
    client: "ClientRecord"
    request: Submit
    frames: list[Any]
    enqueued_at: float


@dataclass
class ClientRecord:
    peer: bytes
    hello: Hello
    outstanding: int = 0
    peak_outstanding: int = 0
    submitted: int = 0
    completed: int = 0
    mapping_digest: str | None = None
    # Requests beyond the window, waiting for a done of this rank (at most one window's worth).
    parked: deque[Pending] = field(default_factory=deque)


@dataclass
class WorkerRecord:
    peer: bytes
    registration: Register
    in_flight: dict[int, Pending] = field(default_factory=dict)
    mappings_sent: set[str] = field(default_factory=set)
    served: int = 0
    failed: int = 0
    last_assigned: int = -1
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def free_credits(self) -> int:
        return self.registration.capacity - len(self.in_flight)


@dataclass
class ServiceRecord:
    name: str
    workers: dict[bytes, WorkerRecord] = field(default_factory=dict)
    queue: deque[Pending] = field(default_factory=deque)
    info_waiters: list[tuple[bytes, int]] = field(default_factory=list)

    @property
    def info(self) -> Eagle3TargetInfo | None:
        for worker in self.workers.values():
            return worker.registration.info
        return None


@dataclass
class MappingRecord:
    header: SetVocabMapping
    frames: list[Any]
    users: set[bytes] = field(default_factory=set)


class BrokerState:
    """Requests queue per service and go to the worker with the most free credits (never round-robin)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.services: dict[str, ServiceRecord] = {}
        self.clients: dict[bytes, ClientRecord] = {}
        self.workers: dict[bytes, WorkerRecord] = {}
        self.mappings: dict[str, MappingRecord] = {}
        self._next_ticket = 0
        self.started_at = time.time()

    # ------------------------------------------------------------ helpers
    def service(self, name: str) -> ServiceRecord:
        record = self.services.get(name)
        if record is None:
            record = self.services[name] = ServiceRecord(name)
        return record

    @staticmethod
    def to_client(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
        return Outgoing("frontend", peer, pack(message, list(frames)))

    @staticmethod
    def to_worker(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
        return Outgoing("backend", peer, pack(message, list(frames)))

    def error(self, peer: bytes, request_id: int | None, message: str) -> list[Outgoing]:
        return [self.to_client(peer, ErrorReply(request_id=request_id, message=message))]

    # ------------------------------------------------------------ trainers
    def on_hello(self, peer: bytes, hello: Hello) -> list[Outgoing]:
        previous = self.clients.get(peer)
        record = ClientRecord(peer, hello)
        if previous is not None:
            # A rank that says hello again keeps its counters and mapping; its window may change.
            record.outstanding, record.peak_outstanding = previous.outstanding, previous.peak_outstanding
            record.submitted, record.completed = previous.submitted, previous.completed
            record.mapping_digest, record.parked = previous.mapping_digest, previous.parked
        self.clients[peer] = record
        self.service(hello.service)
        return [self.to_client(peer, Welcome(broker=self.name, services=sorted(self.services)))]

    def _client(self, peer: bytes) -> ClientRecord | None:
        return self.clients.get(peer)

    def on_submit(self, peer: bytes, submit: Submit, frames: list[Any]) -> list[Outgoing]:
        client = self._client(peer)
        if client is None:
            return self.error(peer, submit.request_id, "this rank has not said hello; connect through RemoteEagle3Target")
        if len(frames) != len(submit.tensors):
            return self.error(peer, submit.request_id, f"header declares {len(submit.tensors)} tensors, message carries {len(frames)}")
        if client.outstanding >= client.hello.window and len(client.parked) >= client.hello.window:
            return self.error(
                peer,
                submit.request_id,
                f"rank {client.hello.client} has {client.outstanding + len(client.parked)} requests outstanding, "
                f"its prefetch window is {client.hello.window}: wait for results before sending more",
            )
        pending = Pending(self._next_ticket, client, submit, frames, time.monotonic())
        self._next_ticket += 1
        client.submitted += 1
        if client.outstanding >= client.hello.window:
            # The rank counts a request done when its result arrives, the broker when the worker's done
            # does: a rank may rightly send its next request in between. Park it until the done.
            client.parked.append(pending)
            return []
        return self._enqueue(pending)

    def _enqueue(self, pending: Pending) -> list[Outgoing]:
        client = pending.client
        client.outstanding += 1
        client.peak_outstanding = max(client.peak_outstanding, client.outstanding)
        service = self.service(client.hello.service)
        service.queue.append(pending)
        return self._dispatch(service)

    def on_set_vocab_mapping(self, peer: bytes, message: SetVocabMapping, frames: list[Any]) -> list[Outgoing]:
        client = self._client(peer)
        if client is None:
            return self.error(peer, message.request_id, "this rank has not said hello; connect through RemoteEagle3Target")
        if len(frames) != len(message.tensors):
            return self.error(peer, message.request_id, f"header declares {len(message.tensors)} tensors, message carries {len(frames)}")
        out = self._release_mapping(client)
        record = self.mappings.get(message.digest)
        if record is None:
            record = self.mappings[message.digest] = MappingRecord(message, frames)
        record.users.add(peer)
        client.mapping_digest = message.digest
        out.append(self.to_client(peer, Ack(request_id=message.request_id)))
        return out

    def _release_mapping(self, client: ClientRecord) -> list[Outgoing]:
        digest, client.mapping_digest = client.mapping_digest, None
        record = self.mappings.get(digest) if digest else None
        if record is None:
            return []
        record.users.discard(client.peer)
        if record.users:
            return []
        del self.mappings[digest]
        out = []
        for worker in self.workers.values():
            if digest in worker.mappings_sent:
                worker.mappings_sent.discard(digest)
                out.append(self.to_worker(worker.peer, ForgetMapping(digest=digest)))
        return out

    def on_model_info(self, peer: bytes, query: ModelInfoQuery) -> list[Outgoing]:
        client = self._client(peer)
        if client is None:
            return self.error(peer, query.request_id, "this rank has not said hello; connect through RemoteEagle3Target")
        service = self.service(client.hello.service)
        if service.info is None:
            service.info_waiters.append((peer, query.request_id))
            return []
        return [self.to_client(peer, ModelInfoReply(request_id=query.request_id, info=service.info))]

    def on_status(self, peer: bytes, query: StatusQuery) -> list[Outgoing]:
        return [self.to_client(peer, StatusReply(request_id=query.request_id, status=self.status()))]

    def on_client_bye(self, peer: bytes) -> list[Outgoing]:
        client = self.clients.pop(peer, None)
        if client is None:
            return []
        out = self._release_mapping(client)
        service = self.service(client.hello.service)
        service.queue = deque(p for p in service.queue if p.client is not client)
        service.info_waiters = [(p, r) for p, r in service.info_waiters if p != peer]
        return out

    # ------------------------------------------------------------ workers
    def on_register(self, peer: bytes, register: Register) -> list[Outgoing]:
        if peer in self.workers:
            return [self.to_worker(peer, ErrorReply(message=f"worker {register.worker} is registered already"))]
        worker = WorkerRecord(peer, register)
        self.workers[peer] = worker
        service = self.service(register.service)
        service.workers[peer] = worker
        out = [self.to_worker(peer, Registered(broker=self.name))]
        for waiter, request_id in service.info_waiters:
            out.append(self.to_client(waiter, ModelInfoReply(request_id=request_id, info=register.info)))
        service.info_waiters.clear()
        out.extend(self._dispatch(service))
        return out

    def on_done(self, peer: bytes, done: Done) -> list[Outgoing]:
        worker = self.workers.get(peer)
        pending = worker.in_flight.pop(done.ticket, None) if worker else None
        if worker is None or pending is None:
            return []
        worker.last_seen = time.monotonic()
        if done.ok:
            worker.served += 1
        else:
            worker.failed += 1
        client = pending.client
        client.outstanding -= 1
        client.completed += 1
        out = self._enqueue(client.parked.popleft()) if client.parked and client.peer in self.clients else []
        return out + self._dispatch(self.service(worker.registration.service))

    # ------------------------------------------------------------ scheduling
    def _dispatch(self, service: ServiceRecord) -> list[Outgoing]:
        out: list[Outgoing] = []
        while service.queue:
            # Most free credits first; among equals the one that waited longest since its last request.
            worker = max(service.workers.values(), key=lambda w: (w.free_credits, -w.last_assigned), default=None)
            if worker is None or worker.free_credits <= 0:
                break
            pending = service.queue.popleft()
            if pending.client.peer not in self.clients:
                continue
            out.extend(self._assign(worker, pending))
        return out

    def _assign(self, worker: WorkerRecord, pending: Pending) -> list[Outgoing]:
        out: list[Outgoing] = []
        digest = pending.client.mapping_digest if pending.request.kind == "eagle3" else None
        if digest is not None and digest not in worker.mappings_sent:
            mapping = self.mappings[digest]
            out.append(self.to_worker(worker.peer, VocabMapping(digest=digest, tensors=mapping.header.tensors), mapping.frames))
            worker.mappings_sent.add(digest)
        worker.in_flight[pending.ticket] = pending
        worker.last_assigned = pending.ticket
        dispatch = Dispatch(
            ticket=pending.ticket,
            client=pending.client.hello.client,
            reply_to=pending.client.hello.data_endpoint,
            service=pending.client.hello.service,
            mapping_digest=digest,
            request=pending.request,
        )
        out.append(self.to_worker(worker.peer, dispatch, pending.frames))
        return out

    # ------------------------------------------------------------ observability
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "broker": self.name,
            "uptime_s": round(time.time() - self.started_at, 3),
            "services": {
                name: {
                    "queued": len(service.queue),
                    "workers": [
                        {
                            "worker": w.registration.worker,
                            "host": w.registration.host,
                            "pid": w.registration.pid,
                            "engine": w.registration.engine,
                            "capacity": w.registration.capacity,
                            "in_flight": len(w.in_flight),
                            "served": w.served,
                            "failed": w.failed,
                            "last_seen_s": round(now - w.last_seen, 3),
                        }
                        for w in service.workers.values()
                    ],
                }
                for name, service in sorted(self.services.items())
            },
            "clients": [
                {
                    "client": c.hello.client,
                    "service": c.hello.service,
                    "host": c.hello.host,
                    "pid": c.hello.pid,
                    "window": c.hello.window,
                    "outstanding": c.outstanding,
                    "peak_outstanding": c.peak_outstanding,
                    "submitted": c.submitted,
                    "completed": c.completed,
                }
                for c in self.clients.values()
            ],
        }
