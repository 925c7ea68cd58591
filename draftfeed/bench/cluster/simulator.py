"""The simulated ranks and workers of the cluster scenario, one thread over epoll (the package's docstring says how
and what they measure)."""

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
from typing import Any

import zmq

from draftfeed.bench.cluster.load import ClusterRun, Load
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
    PairStatus,
    Register,
    Registered,
    Submit,
    TensorSpec,
    Welcome,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import PAIRS_PER_BEAT, SIGNATURE

SERVICE = "cluster"
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
