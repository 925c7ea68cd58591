"""Simulated ranks and workers speaking the real protocol to a real broker, for ``draftfeed bench --scenario cluster``
and the cluster tests: raw pyzmq, each message built and parsed with ``draftfeed.schemas``, one DEALER per peer.

A simulated worker registers, takes dispatches, "computes" each for ``compute_ms`` (one at a time, its queue FIFO,
as a worker does), answers ``done`` (naming the ticket it computes next) and heartbeats once per interval as
draftfeed's worker does (its pairs as changes: each rank's pair once, then a few in turn). A simulated rank says
hello, keeps ``prefetch`` requests in flight, and heartbeats once per interval; the answer to its request is
in-process (the worker marks it done), so only the broker's work is measured. No torch: the request's tensors are
three small int64 frames, as a batch's token tensors are.

The simulator is one thread that must outrun the broker: it waits on its sockets' file descriptors with epoll
(O(sockets ready), where a zmq poll over a thousand sockets is O(all of them) each turn), and on the hot path it
writes ``submit`` and ``done`` headers from templates the schemas made and reads a dispatch's rank, ticket and
request id with ``json.loads``; everything else is built and parsed with ``draftfeed.schemas``.

What is measured (``ClusterRun``): requests completed per second against the ideal (workers / compute time),
how long a request waits at the broker before a credit frees (queueing, which Little's law fixes) and how long the
broker takes to hand it out once it can (from the later of its submit and the ``done`` that freed the credit, to the
dispatch at the worker: the broker's own latency), every request dispatched once and each rank's in order, and
every error or ``forgotten`` a peer heard.
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import select
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import zmq

from draftfeed.consumers.pair_report import REFRESH_PER_BEAT
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    FRONTEND_OUTBOUND,
    Bye,
    Computing,
    Dispatch,
    Done,
    Eagle3TargetInfo,
    ErrorReply,
    ForgetRanks,
    Heartbeat,
    Hello,
    Liveness,
    PairStatus,
    Register,
    Registered,
    Submit,
    TensorSpec,
    Welcome,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import PAIRS_PER_BEAT, SIGNATURE
from draftfeed.schemas.settings import Settings, setting

SERVICE = "cluster"
PEERS_PER_PROCESS = 4000
INFO = Eagle3TargetInfo(num_hidden_layers=32, hidden_size=4096, vocab_size=128256, aux_layer_ids=[1, 15, 28])
TOKENS = 16
SPECS = [TensorSpec(name=name, dtype="int64", shape=[1, TOKENS]) for name in ("input_ids", "attention_mask", "loss_mask")]
PAYLOAD = bytes(8 * TOKENS)
RANK_HEARTBEAT = pack(Heartbeat())


def _template(message: Any, **marks: int) -> bytes:
    """``message``'s header JSON with each field of ``marks`` (set to its mark value) made a ``%d`` slot, in order."""
    text = message.model_dump_json().replace("%", "%%")
    for name, mark in marks.items():
        text = text.replace(f'"{name}":{mark}', f'"{name}":%d', 1)
    return text.encode()


_MARK = 987654321  # a number no real field holds, to find each slot
SUBMIT = _template(Submit(request_id=_MARK, kind="eagle3", token=_MARK + 1, tensors=SPECS), request_id=_MARK, token=_MARK + 1)
DONE = _template(Done(ticket=_MARK, outcome="served"), ticket=_MARK)
DONE_NEXT = _template(Done(ticket=_MARK, outcome="served", next_ticket=_MARK + 1), ticket=_MARK, next_ticket=_MARK + 1)


class Load(Settings):
    """The simulated cluster: how many peers, how fast its workers, how long the run. ``draftfeed bench --scenario
    cluster`` makes a flag of each field (launch/flags.py)."""

    GROUP: ClassVar[str] = "the cluster scenario"

    ranks: int = setting(1000, "cluster scenario: simulated training ranks")
    workers: int = setting(256, "cluster scenario: simulated workers")
    compute_ms: float = setting(60.0, "cluster scenario: milliseconds a simulated worker computes a request")
    prefetch: int = setting(2, "cluster scenario: requests each rank keeps in flight (its prefetch_depth)")
    capacity: int = setting(2, "cluster scenario: requests each worker holds (its --capacity)")
    warmup_s: float = setting(5.0, "cluster scenario: seconds served before measuring")
    measure_s: float = setting(20.0, "cluster scenario: seconds measured")
    processes: int = setting(
        0, "cluster scenario: simulator processes, each with its share of the peers as a service of its own (0: one per 4,000 peers)"
    )
    heartbeat_s: float = setting(1.0, "cluster scenario: the broker's --heartbeat-interval, which the peers keep", flag="--heartbeat-interval")

    @property
    def ideal_per_s(self) -> float:
        return self.workers / (self.compute_ms / 1000)

    def parts(self) -> list[Load]:
        """The loads of the simulator processes: a process's file descriptors (two a socket) bound its peers."""
        count = self.processes or max(1, math.ceil((self.ranks + self.workers) / PEERS_PER_PROCESS))
        return [
            self.model_copy(
                update={
                    "ranks": self.ranks // count + (part < self.ranks % count),
                    "workers": self.workers // count + (part < self.workers % count),
                    "processes": 1,
                }
            )
            for part in range(count)
        ]


@dataclass(frozen=True)
class _Dispatched:
    ticket: int
    rank: str
    request_id: int


@dataclass(eq=False)
class _Worker:
    name: str
    sock: zmq.Socket
    queue: deque = field(default_factory=deque)  # dispatches not computed yet
    computing: _Dispatched | None = None
    announced: int | None = None
    credits_freed: deque = field(default_factory=deque)  # when each free credit freed, oldest first
    pairs: dict[str, PairStatus] = field(default_factory=dict)
    unreported: deque = field(default_factory=deque)  # new pairs the next heartbeats report
    turn: int = 0


@dataclass(eq=False)
class _Rank:
    name: str
    sock: zmq.Socket
    next_id: int = 0
    sent_at: dict[int, float] = field(default_factory=dict)  # request id -> when submitted
    dispatches: list[tuple[int, int]] = field(default_factory=list)  # (ticket, request id) of each dispatch


@dataclass
class ClusterRun:
    """What a run measured; ``report()`` is its JSON."""

    load: Load
    completed: int = 0
    measured_s: float = 0.0
    waits_s: list[float] = field(default_factory=list)  # submit to dispatch at the worker
    dispatch_s: list[float] = field(default_factory=list)  # the broker's own: from when it could, to the dispatch
    duplicates: int = 0
    out_of_order: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    worker_heartbeat_bytes: int = 0  # the largest heartbeat header a worker sent
    simulator_cpu_s: float = 0.0
    submitted: int = 0
    dispatched: int = 0
    answered: int = 0

    def report(self, samples: bool = False) -> dict[str, Any]:
        """Its numbers; with ``samples`` the latencies themselves too (for ``merge``)."""
        return {
            "rate_per_s": self.completed / self.measured_s if self.measured_s else 0.0,
            "ideal_per_s": self.load.ideal_per_s,
            "wait_p50_ms": _percentile(self.waits_s, 50) * 1000,
            "wait_p99_ms": _percentile(self.waits_s, 99) * 1000,
            "dispatch_p50_ms": _percentile(self.dispatch_s, 50) * 1000,
            "dispatch_p99_ms": _percentile(self.dispatch_s, 99) * 1000,
            **({"waits_s": self.waits_s, "dispatch_s": self.dispatch_s} if samples else {}),
            "duplicates": self.duplicates,
            "out_of_order": self.out_of_order,
            "errors": self.errors,
            "worker_heartbeat_bytes": self.worker_heartbeat_bytes,
            "simulator_cpu_s": self.simulator_cpu_s,
            "measured_s": self.measured_s,
            "completed": self.completed,
            "submitted": self.submitted,
            "dispatched": self.dispatched,
            "answered": self.answered,
        }


def merge(reports: list[dict[str, Any]], load: Load) -> dict[str, Any]:
    """One report of the simulator processes' (each made with ``samples``): counts and rates added, latencies
    taken over every process's samples."""
    waits = [value for report in reports for value in report["waits_s"]]
    dispatches = [value for report in reports for value in report["dispatch_s"]]
    errors: dict[str, int] = {}
    for report in reports:
        for key, count in report["errors"].items():
            errors[key] = errors.get(key, 0) + count
    added = ("rate_per_s", "duplicates", "out_of_order", "simulator_cpu_s", "completed", "submitted", "dispatched", "answered")
    return {
        **{key: sum(report[key] for report in reports) for key in added},
        "ideal_per_s": load.ideal_per_s,
        "wait_p50_ms": _percentile(waits, 50) * 1000,
        "wait_p99_ms": _percentile(waits, 99) * 1000,
        "dispatch_p50_ms": _percentile(dispatches, 50) * 1000,
        "dispatch_p99_ms": _percentile(dispatches, 99) * 1000,
        "errors": errors,
        "worker_heartbeat_bytes": max(report["worker_heartbeat_bytes"] for report in reports),
        "measured_s": max(report["measured_s"] for report in reports),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


class SimulatedCluster:
    """``load``'s ranks and workers on the broker at ``frontend`` / ``backend``. ``start()`` connects them all and
    waits for every welcome and registration; ``run()`` serves for the warm-up and the measured time; ``leave()``
    says every peer's bye; ``close()`` closes the sockets. ``on_tick`` runs once per heartbeat interval during
    ``run`` (the bench samples the broker's memory there)."""

    def __init__(self, frontend: str, backend: str, load: Load, part: int = 0) -> None:
        self.load = load
        self.service, self.prefix = f"{SERVICE}-{part}", f"sim{part}"
        self.frontend, self.backend = frontend, backend
        self.context = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, load.ranks + load.workers + 64)
        self.workers: list[_Worker] = []
        self.ranks: dict[str, _Rank] = {}
        self.run_stats = ClusterRun(load)
        self._measuring = False
        self._seen: set[tuple[str, int]] = set()
        self._due: list[tuple[float, int, _Worker]] = []  # (when its request is computed, order, worker)
        self._order = itertools.count()
        self._check: set[_Worker] = set()
        self._started_beat = 0.0

    # ------------------------------------------------------------ setup and teardown
    def start(self, timeout_s: float = 120.0) -> None:
        """Connect every worker and rank and wait for each one's answer; the peers already answered heartbeat meanwhile
        (connecting thousands takes longer than the broker's liveness period)."""
        deadline = time.monotonic() + timeout_s
        self._started_beat = time.monotonic()
        for index in range(self.load.workers):
            name = f"{self.prefix}-w{index}"
            sock = self._socket(name, self.backend)
            register = Register(
                worker=name,
                service=self.service,
                task="eagle3",
                engine="simulated",
                info=INFO,
                capacity=self.load.capacity,
                host="simulated",
                pid=os.getpid(),
            )
            sock.send_multipart(pack(register))
            self.workers.append(_Worker(name, sock))
        for count, worker in enumerate(self.workers):
            self._await(worker.sock, Registered, deadline, f"worker {worker.name}'s registration")
            worker.credits_freed.extend([time.monotonic()] * self.load.capacity)
            self._beat_while_starting(self.workers[: count + 1], [])
        for index in range(self.load.ranks):
            name = f"{self.prefix}-r{index}"
            sock = self._socket(name, self.frontend)
            hello = Hello(
                rank=name, service=self.service, data_endpoint=f"tcp://127.0.0.1:9/{name}", window=self.load.prefetch, host="simulated", pid=1
            )
            sock.send_multipart(pack(hello))
            self.ranks[name] = _Rank(name, sock)
            self._beat_while_starting(self.workers, self.ranks.values())  # known to the broker from its hello
        for rank in self.ranks.values():
            self._await(rank.sock, Welcome, deadline, f"rank {rank.name}'s welcome")
            self._beat_while_starting(self.workers, self.ranks.values())

    def _beat_while_starting(self, workers: Iterable[_Worker], ranks: Iterable[_Rank]) -> None:
        if time.monotonic() - self._started_beat < self.load.heartbeat_s:
            return
        self._started_beat = time.monotonic()
        beat = pack(WorkerHeartbeat())
        for worker in workers:
            worker.sock.send_multipart(beat)
        for rank in ranks:
            rank.sock.send_multipart(RANK_HEARTBEAT)

    def _socket(self, name: str, endpoint: str) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, name.encode())
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(endpoint)
        return sock

    def _await(self, sock: zmq.Socket, kind: type, deadline: float, what: str) -> None:
        accepts = FRONTEND_OUTBOUND if kind is Welcome else BACKEND_OUTBOUND
        while time.monotonic() < deadline:
            if sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                message, _ = unpack(sock.recv_multipart(), accepts)
                if isinstance(message, kind):
                    return
                if isinstance(message, ErrorReply):
                    raise RuntimeError(f"{what}: the broker answered {message.message}")
        raise TimeoutError(f"no answer for {what}")

    def keep_alive(self, until: Any) -> None:
        """Heartbeat every peer once per interval until ``until`` (a file) has a line to read: the peers of a process
        that started first wait for the others without being expired as silent."""
        beat = pack(WorkerHeartbeat())
        while True:
            ready, _, _ = select.select([until], [], [], self.load.heartbeat_s)
            if ready:
                until.readline()
                return
            for rank in self.ranks.values():
                rank.sock.send_multipart(RANK_HEARTBEAT)
            for worker in self.workers:
                worker.sock.send_multipart(beat)

    def leave(self) -> None:
        for rank in self.ranks.values():
            rank.sock.send_multipart(pack(Bye()))
        for worker in self.workers:
            worker.sock.send_multipart(pack(Bye()))

    def close(self) -> None:
        for rank in self.ranks.values():
            rank.sock.close(linger=0)
        for worker in self.workers:
            worker.sock.close(linger=0)
        self.context.term()

    # ------------------------------------------------------------ the run
    def run(self, on_tick: Any = None) -> ClusterRun:
        """Submit and serve for the warm-up, then measure for ``measure_s``. Each peer heartbeats once per interval,
        their beats spread evenly over it (two rotations, in the order they are due)."""
        load, stats = self.load, self.run_stats
        cpu_start = time.process_time()
        started = time.monotonic()
        for rank in self.ranks.values():
            for _ in range(load.prefetch):
                self._submit(rank, started)
        epoll = select.epoll()
        by_fd: dict[int, _Worker] = {}
        for worker in self.workers:
            fd = worker.sock.get(zmq.FD)
            epoll.register(fd, select.EPOLLIN)
            by_fd[fd] = worker
        self._check = set(self.workers)  # sockets to read whatever their fd says (zmq's fd is edge-triggered)
        beats: deque[tuple[float, Any]] = deque()  # (when due, peer), due times in order
        peers: list[Any] = [*self.workers, *self.ranks.values()]
        for index, peer in enumerate(peers):
            beats.append((started + load.heartbeat_s * index / len(peers), peer))
        measure_from, ends = started + load.warmup_s, started + load.warmup_s + load.measure_s
        next_tick = started + load.heartbeat_s
        due = self._due
        while (now := time.monotonic()) < ends:
            if not self._measuring and now >= measure_from:
                self._measuring, stats.completed = True, 0
                stats.waits_s.clear()
                stats.dispatch_s.clear()
            soonest = min(due[0][0] if due else now + 0.01, beats[0][0] if beats else now + 0.01)
            timeout = 0.0 if self._check else max(0.0, min(0.01, soonest - now))
            for fd, _event in epoll.poll(math.ceil(timeout * 1000) / 1000):
                self._check.add(by_fd[fd])
            while self._check:
                self._read_worker(self._check.pop())
            now = time.monotonic()
            while due and due[0][0] <= now:
                self._finish(heapq.heappop(due)[2], now)
            while beats and beats[0][0] <= now:
                when, peer = beats.popleft()
                if isinstance(peer, _Worker):
                    self._worker_beat(peer)
                else:
                    self._rank_beat(peer)
                beats.append((when + load.heartbeat_s, peer))
            if now >= next_tick:
                next_tick = now + load.heartbeat_s
                if on_tick is not None:
                    on_tick()
        epoll.close()
        for rank in self.ranks.values():
            ordered = [request_id for _ticket, request_id in sorted(rank.dispatches)]
            stats.out_of_order += sum(1 for a, b in zip(ordered, ordered[1:]) if b < a)
        stats.measured_s = time.monotonic() - measure_from
        stats.simulator_cpu_s = time.process_time() - cpu_start
        return stats

    def _submit(self, rank: _Rank, now: float) -> None:
        request_id = rank.next_id
        rank.next_id += 1
        rank.sent_at[request_id] = now
        rank.sock.send_multipart([SIGNATURE, SUBMIT % (request_id, request_id), PAYLOAD, PAYLOAD, PAYLOAD])
        self.run_stats.submitted += 1

    def _read_worker(self, worker: _Worker) -> None:
        sock = worker.sock
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart()
            if frames[1].startswith(b'{"type":"dispatch"'):
                header = json.loads(frames[1])
                self._dispatched(worker, _Dispatched(header["ticket"], header["rank"], header["request"]["request_id"]))
                continue
            message, _tensors = unpack(frames, BACKEND_OUTBOUND)
            if isinstance(message, Dispatch):
                self._dispatched(worker, _Dispatched(message.ticket, message.rank, message.request.request_id))
            elif isinstance(message, ErrorReply):
                self._error(f"worker:{message.code}")
            elif isinstance(message, ForgetRanks):
                for address in message.ranks:
                    worker.pairs.pop(address.rank, None)

    def _dispatched(self, worker: _Worker, dispatch: _Dispatched) -> None:
        now = time.monotonic()
        stats = self.run_stats
        stats.dispatched += 1
        rank = self.ranks[dispatch.rank]
        request_id = dispatch.request_id
        key = (dispatch.rank, request_id)
        if key in self._seen:
            stats.duplicates += 1
        self._seen.add(key)
        rank.dispatches.append((dispatch.ticket, request_id))
        submitted = rank.sent_at.get(request_id, now)
        freed = worker.credits_freed.popleft() if worker.credits_freed else now
        if self._measuring:
            stats.waits_s.append(now - submitted)
            stats.dispatch_s.append(now - max(submitted, freed))
        if dispatch.rank not in worker.pairs:
            pair = PairStatus(rank=dispatch.rank, plane="frames", state="frames", reason="simulated: the rank asks for frames")
            worker.pairs[dispatch.rank] = pair
            worker.unreported.append(pair)
        worker.queue.append(dispatch)
        if worker.computing is None:
            self._begin(worker, now)

    def _begin(self, worker: _Worker, now: float) -> None:
        dispatch = worker.queue.popleft()
        worker.computing = dispatch
        heapq.heappush(self._due, (now + self.load.compute_ms / 1000, next(self._order), worker))
        if worker.announced != dispatch.ticket:
            worker.sock.send_multipart(pack(Computing(ticket=dispatch.ticket)))
            self._check.add(worker)
        worker.announced = None

    def _finish(self, worker: _Worker, now: float) -> None:
        dispatch = worker.computing
        assert dispatch is not None
        worker.computing = None
        worker.announced = worker.queue[0].ticket if worker.queue else None
        header = DONE % dispatch.ticket if worker.announced is None else DONE_NEXT % (dispatch.ticket, worker.announced)
        worker.sock.send_multipart([SIGNATURE, header])
        self._check.add(worker)
        worker.credits_freed.append(now)
        stats = self.run_stats
        stats.answered += 1
        if self._measuring:
            stats.completed += 1
        rank = self.ranks[dispatch.rank]
        rank.sent_at.pop(dispatch.request_id, None)
        self._submit(rank, now)  # its answer arrived: the rank keeps its prefetch full
        if worker.queue:
            self._begin(worker, now)

    def _worker_beat(self, worker: _Worker) -> None:
        reported: list[PairStatus] = []
        while worker.unreported and len(reported) < PAIRS_PER_BEAT:
            reported.append(worker.unreported.popleft())
        if worker.pairs and len(reported) < PAIRS_PER_BEAT:
            pairs = list(worker.pairs.values())
            for offset in range(min(REFRESH_PER_BEAT, len(pairs))):
                reported.append(pairs[(worker.turn + offset) % len(pairs)])
            worker.turn = (worker.turn + REFRESH_PER_BEAT) % len(pairs)
        beat = WorkerHeartbeat(rank_links=len(worker.pairs), pair_count=len(worker.pairs), pairs=reported[:PAIRS_PER_BEAT])
        frames = pack(beat)
        self.run_stats.worker_heartbeat_bytes = max(self.run_stats.worker_heartbeat_bytes, len(frames[1]))
        worker.sock.send_multipart(frames)
        self._check.add(worker)

    def _rank_beat(self, rank: _Rank) -> None:
        rank.sock.send_multipart(RANK_HEARTBEAT)
        while True:
            try:
                frames = rank.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            message, _ = unpack(frames, FRONTEND_OUTBOUND)
            if isinstance(message, ErrorReply):
                self._error(f"rank:{message.code}")

    def _error(self, key: str) -> None:
        self.run_stats.errors[key] = self.run_stats.errors.get(key, 0) + 1


def forward(heartbeat_s: float = 1.0) -> None:
    """A broker with no policy for the simulated cluster, in raw pyzmq: the baseline the broker's CPU per request is
    measured against in the same run. It answers hellos and registrations, hands each submit to a worker of its
    service with a free credit (in turn; a FIFO when none is free), takes each done's credit back, heartbeats every
    peer once per interval, and reads nothing of any message but its type and the few fields it routes by. It
    prints its endpoints, then serves until every peer it knew said bye."""
    context = zmq.Context()
    frontend, backend = context.socket(zmq.ROUTER), context.socket(zmq.ROUTER)
    for sock in (frontend, backend):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    host = "tcp://127.0.0.1"
    print(
        json.dumps({"frontend": f"{host}:{frontend.bind_to_random_port(host)}", "backend": f"{host}:{backend.bind_to_random_port(host)}"}), flush=True
    )
    welcome = pack(Welcome(broker="forwarder", instance="forwarder", services={}, liveness=_LIVENESS))[1]
    registered = pack(Registered(broker="forwarder", instance="forwarder", liveness=_LIVENESS))[1]
    beat = pack(Heartbeat(instance="forwarder"))[1]
    ranks: dict[bytes, tuple[str, bytes]] = {}  # rank -> its service, its part of a dispatch header
    workers: dict[bytes, str] = {}  # worker -> its service
    free: dict[str, deque[bytes]] = {}  # service -> one entry per free credit
    waiting: dict[str, deque[tuple[bytes, bytes, list]]] = {}  # service -> (rank, submit header, tensor frames)
    tickets = itertools.count()
    poller = zmq.Poller()
    poller.register(frontend, zmq.POLLIN)
    poller.register(backend, zmq.POLLIN)
    next_beat, seen_any = time.monotonic() + heartbeat_s, False

    def dispatch(worker: bytes, rank: bytes, header: bytes, tensors: list) -> None:
        head = b'{"type":"dispatch","ticket":%d,%s,"request":%s}' % (next(tickets), ranks[rank][1], header)
        backend.send_multipart([worker, SIGNATURE, head, *tensors])

    def on_rank(peer: bytes, kind: bytes, header: bytes, tensors: list) -> None:
        nonlocal seen_any
        if kind == b"submit":
            service = ranks[peer][0]
            if free.get(service):
                dispatch(free[service].popleft(), peer, header, tensors)
            else:
                waiting.setdefault(service, deque()).append((peer, header, tensors))
        elif kind == b"hello":
            fields = json.loads(header)
            names = (fields["rank"].encode(), fields["data_endpoint"].encode(), fields["service"].encode())
            ranks[peer] = (fields["service"], b'"rank":"%s","data_endpoint":"%s","service":"%s"' % names)
            frontend.send_multipart([peer, SIGNATURE, welcome])
            seen_any = True
        elif kind == b"bye":
            ranks.pop(peer, None)

    def on_worker(peer: bytes, kind: bytes, header: bytes) -> None:
        if kind == b"done":
            service = workers[peer]
            if waiting.get(service):
                dispatch(peer, *waiting[service].popleft())
            else:
                free.setdefault(service, deque()).append(peer)
        elif kind == b"register":
            fields = json.loads(header)
            service = workers[peer] = fields["service"]
            credits = free.setdefault(service, deque())
            credits.extend([peer] * fields["capacity"])
            backend.send_multipart([peer, SIGNATURE, registered])
            queued = waiting.get(service, deque())
            while queued and credits:
                dispatch(credits.popleft(), *queued.popleft())
        elif kind == b"bye":
            workers.pop(peer, None)

    while not seen_any or ranks or workers:
        for sock, _event in poller.poll(100):
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                peer, _signature, header, *tensors = sock.recv_multipart(copy=False)
                peer, header = peer.bytes, header.bytes
                kind = header[9 : header.find(b'"', 9)]
                if sock is frontend:
                    on_rank(peer, kind, header, tensors)
                else:
                    on_worker(peer, kind, header)
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + heartbeat_s
            for rank in ranks:
                frontend.send_multipart([rank, SIGNATURE, beat])
            for worker in workers:
                backend.send_multipart([worker, SIGNATURE, beat])
    frontend.close(0)
    backend.close(0)
    context.term()


_LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=5)


def main() -> None:
    """``python -m draftfeed.bench.cluster simulate FRONTEND BACKEND LOAD_JSON PART``: start (and say so on a line),
    run once a line comes on stdin, leave, and print the report's JSON with its samples; ``python -m
    draftfeed.bench.cluster forward``: the policy-free forwarder."""
    import sys

    command, *args = sys.argv[1:]
    if command == "forward":
        forward(float(args[0]) if args else 1.0)
        return
    frontend, backend, load_json, part = args
    cluster = SimulatedCluster(frontend, backend, Load.model_validate_json(load_json), int(part))
    try:
        cluster.start()
        print(json.dumps({"started": True}), flush=True)
        cluster.keep_alive(until=sys.stdin)  # go: every process has started
        run = cluster.run()
        cluster.leave()
        print(json.dumps(run.report(samples=True)), flush=True)
    finally:
        cluster.close()


if __name__ == "__main__":
    main()
