"""What the broker holds about each rank, worker, service, request and vocab mapping, and the messages it sends.

Plain records: the policy that changes them is in state.py (handlers), ranks.py, workers.py, delivery.py,
mappings.py and scheduler.py.
"""

from __future__ import annotations

import sys
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from draftfeed.broker.fair_queue import FairQueue
from draftfeed.broker.free_workers import FreeWorkers
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import AnyTargetInfo, Hello, PairStatus, Register, SetVocabMapping, Submit

Side = Literal["frontend", "backend"]


@dataclass
class Outgoing:
    """One message to send: on the ranks' socket (frontend) or the workers' (backend), to one peer."""

    side: Side
    peer: bytes
    frames: list[Any]


def to_rank(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
    return Outgoing("frontend", peer, pack(message, list(frames)))


def to_worker(peer: bytes, message: Any, frames: Iterable[Any] = ()) -> Outgoing:
    return Outgoing("backend", peer, pack(message, list(frames)))


def silent_peers(records: OrderedDict[bytes, Any], now: float, liveness_s: float) -> list[bytes]:
    """The peers not heard for longer than the liveness period, of ``records`` kept least recently heard first (a
    record moves to the end each time its peer is heard): O(the silent ones)."""
    out = []
    for peer, record in records.items():
        if now - record.last_seen <= liveness_s:
            break
        out.append(peer)
    return out


@dataclass(slots=True)
class Pending:
    """A rank's request from its arrival until a worker reports it done."""

    rank: RankRecord
    request: Submit
    frames: list[Any]
    enqueued_at: float
    ticket: int = -1  # of its current dispatch; -1 while queued
    placed_at: float = 0.0  # when it took its current place: queued, parked or dispatched (a rank's ``where`` hears it)
    parked: bool = False  # waiting beyond its rank's window for a done (``RankRecord.parked``)
    worker: bytes | None = None  # the worker it is dispatched to, while it is
    request_json: bytes | None = None  # the request, encoded once for every dispatch of it
    failures: int = 0  # tries that failed in the engine (a poison batch must not kill every worker)
    deaths: int = 0  # of those, workers that died with it in their engine (deaths.py: counted unless churn explains them)
    excluded: set[bytes] = field(default_factory=set)  # workers it failed on
    attempts: list[tuple[bytes, str]] = field(default_factory=list)  # each failed try: the worker, what it said
    finished: bool = False  # completed, or its rank forgotten: it holds no mapping and is never dispatched again
    mapping_refused_by: set[bytes] = field(default_factory=set)  # workers that said they lack its mapping
    stalled: bool = False  # its answer stalled once on the way to its rank (sent again once; a second stall fails it)

    @property
    def mapping(self) -> str | None:
        """The vocab mapping it is computed with (its digest), None for the identity."""
        return self.request.mapping_digest

    def charge(self, worker: bytes, what: str, *, death: bool = False) -> None:
        """A try that failed in the engine of ``worker`` (``death``: the worker died with it there): it counts against
        the request's attempts."""
        self.failures += 1
        self.deaths += death
        self.excluded.add(worker)
        self.attempts.append((worker, what))

    def uncharge(self, worker: bytes) -> None:
        """The worker was not dead after all (frozen, and back): its death no longer counts against the request."""
        kept = [(peer, what) for peer, what in self.attempts if peer != worker]
        self.failures -= len(self.attempts) - len(kept)
        self.deaths -= len(self.attempts) - len(kept)
        self.attempts = kept
        self.excluded.discard(worker)

    def own_failures(self, churning: bool) -> int:
        """The failures that are its own: the deaths count only while no churn explains them (deaths.py)."""
        return self.failures - (self.deaths if churning else 0)

    def describe(self) -> str:
        """Which request this is, for an error that names it."""
        shapes = ", ".join(f"{spec.name} {spec.shape}" for spec in self.request.tensors[:1])
        return f"request {self.request.request_id} of rank {self.rank.hello.rank}" + (f" ({shapes})" if shapes else "")

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
    peak_outstanding: int = 0
    submitted: int = 0
    completed: int = 0
    mapping_digest: str | None = None  # the mapping it set last (it may still have requests naming earlier ones)
    dispatch_fields: bytes | None = None  # this rank's part of every dispatch header, encoded once
    key: str | None = None  # its authenticated CURVE public key, on a secure broker
    order: int = 0  # when it said hello, among all ranks (where a status page of ranks starts)
    gone: bool = False  # forgotten: a later hello of the same rank makes a new record
    workers_served: set[bytes] = field(default_factory=set)  # the workers that hold a link to it (told when it goes)
    finished: OrderedDict[int, Finished] = field(default_factory=OrderedDict)  # its last FINISHED_KEPT requests done

    def remember_finished(self, request_id: int, finished: Finished) -> None:
        self.finished[request_id] = finished
        self.finished.move_to_end(request_id)
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)

    @property
    def outstanding(self) -> int:
        """Its requests queued or at a worker (those parked beyond its window not counted)."""
        return len(self.requests) - len(self.parked)


class Finished(NamedTuple):
    """A request that left the broker's care, kept a while so that a rank that still waits for it hears where it went."""

    worker: str | None  # the worker that reported it done (None: the broker failed it)
    outcome: str  # served, failed, undelivered
    at: float


# How many of a rank's finished requests the broker remembers, to say where one went when the rank asks about it (its
# answer never came). One forgotten is answered "unknown", which the rank sends again all the same: the record only
# names the worker and what it said, for the rank's log.
FINISHED_KEPT = 64


class PairRecord(NamedTuple):
    """One pair's status as the broker keeps it: a tuple of interned strings, a fifth of the model's memory (a
    broker of a thousand ranks and 256 workers keeps 256,000 of them)."""

    plane: str
    state: str
    reason: str
    generation: int | None
    sent_over_pair: int
    fallbacks: int

    @classmethod
    def of(cls, pair: PairStatus) -> PairRecord:
        return cls(sys.intern(pair.plane), sys.intern(pair.state), sys.intern(pair.reason), pair.generation, pair.sent_over_pair, pair.fallbacks)

    def as_json(self, rank: str) -> dict[str, Any]:
        """What ``PairStatus.model_dump(mode="json")`` gives for it."""
        return {"rank": rank, **self._asdict()}


@dataclass
class WorkerRecord:
    peer: bytes
    registration: Register
    last_seen: float
    in_flight: dict[int, Pending] = field(default_factory=dict)  # by ticket
    mappings_sent: set[str] = field(default_factory=set)  # what the broker believes it holds
    ranks_served: set[bytes] = field(default_factory=set)
    served: int = 0
    failed: int = 0
    handed_back: int = 0
    last_assigned: int = -1
    draining: bool = False
    rank_links: int = 0
    mappings_held: int = 0
    pairs: dict[str, PairRecord] = field(default_factory=dict)  # its data plane to each rank, by rank, from its heartbeats
    pair_count: int = 0  # how many pairs it says it has (``pairs`` catches up over a few heartbeats)
    key: str | None = None  # its authenticated CURVE public key, on a secure broker
    in_engine: int | None = None  # the ticket it computes now, as it last said (``computing``, or a done's next)
    batches: int = 0  # supervision batches served (served counts every request, embeddings fetches too)
    order: int = 0  # when it registered, among all workers (the scheduler's last tie-break)
    version: int = 0  # bumped at each change of its credits (free_workers.py)
    removed: bool = False  # it left its service
    target_version: int = 0  # the version of the target's weights it serves (its registration's, then updates': versions.py)
    checkpoint: str | None = None  # where those weights came from
    updating: bool = False  # told to load an update and not answered yet: it is given no work meanwhile (versions.py)

    @property
    def free_credits(self) -> int:
        return 0 if self.draining or self.updating else self.registration.capacity - len(self.in_flight)

    @property
    def name(self) -> str:
        return self.registration.worker


@dataclass
class ServiceRecord:
    """A service, its workers and ranks, and its queue. What is derived from its workers (the free ones, the ready
    count, the longest row all take) is kept up to date as workers join, change and leave, never recomputed per
    request: ``add_worker``, ``credits_changed``, ``drains``, ``remove_worker``."""

    name: str
    workers: dict[bytes, WorkerRecord] = field(default_factory=dict)
    ranks: set[bytes] = field(default_factory=set)  # the ranks known for it
    queue: FairQueue[Pending] = field(default_factory=FairQueue)  # round-robin across ranks (fair_queue.py)
    info_waiters: list[tuple[bytes, int]] = field(default_factory=list)
    completions: deque[float] = field(default_factory=deque)
    # The service's target, fixed by its first worker or by a rank's checked expectation: every worker
    # that registers later must match it, so a mis-launched worker can never feed a run.
    info: AnyTargetInfo | None = None
    free: FreeWorkers = field(default_factory=FreeWorkers)  # the workers with free credits, best first
    ready_workers: int = 0  # workers that take work (registered, not draining)
    max_positions: int | None = None  # the longest row every worker of the service takes, None when none says
    in_flight: int = 0  # requests at its workers

    def add_worker(self, worker: WorkerRecord) -> None:
        self.workers[worker.peer] = worker
        self.ready_workers += not worker.draining
        self._limits_changed()
        self.free.update(worker)

    def remove_worker(self, peer: bytes) -> None:
        worker = self.workers.pop(peer, None)
        if worker is None:
            return
        worker.removed = True
        self.ready_workers -= not worker.draining
        self._limits_changed()
        self.free.remove(worker)

    def drains(self, worker: WorkerRecord) -> None:
        """The worker takes no more work."""
        if not worker.draining:
            worker.draining = True
            self.ready_workers -= 1
            self.free.update(worker)

    def credits_changed(self, worker: WorkerRecord) -> None:
        if not worker.removed:
            self.free.update(worker)

    def _limits_changed(self) -> None:
        limits = [w.registration.max_positions for w in self.workers.values() if w.registration.max_positions is not None]
        self.max_positions = min(limits) if limits else None


@dataclass
class MappingRecord:
    """A vocab mapping, kept while a rank uses it (``users``) or a live request names it (``requests``)."""

    header: SetVocabMapping
    frames: list[Any]
    users: set[bytes] = field(default_factory=set)
    requests: int = 0
    sent_to: set[bytes] = field(default_factory=set)  # the workers believed to hold it

    @property
    def needed(self) -> bool:
        return bool(self.users) or self.requests > 0
