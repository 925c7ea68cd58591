"""The rank's side of its nixl pairs: one NIXL agent and one receive pool for every worker that opened one.

The protocol (docs/data-planes.md), all on the rank's data socket except the bytes themselves:

    worker -> rank   nixl_open    generation, the worker's agent name
    rank -> worker   nixl_ready   + one frame: this rank's agent metadata
    worker -> rank   nixl_want    room for an answer of n bytes
    rank -> worker   nixl_grant   a slot (address, bytes, device), or refused: that answer comes as frames
    worker ~> rank   NIXL write into the slot, then a notification "generation:slot:want"
    worker -> rank   result       plane nixl, the slot, the tensors' specs

An answer is used only once both its header and its notification are here; a header whose notification does
not come within the pair's timeout is lost (the rank asks again) and the pair is closed. When a pair closes
(either side, or the broker reports the worker gone) its answers in waiting are lost and asked for again,
and the slots granted to it are quarantined (rank_slots.py). Everything here runs on the rank's IO thread, except the
making of a large slot's memory (``_Allocation``: its want is granted once it is made, wants behind it wait their turn).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from draftfeed.dataplane.nixl.layout import packed_layout, parse_notification
from draftfeed.dataplane.nixl.memory import host_memory
from draftfeed.dataplane.nixl.rank_slots import NeedsMemory, PoolFull, ReceivePool
from draftfeed.dataplane.nixl.transport import NixlAgent, NixlError
from draftfeed.logs import RateLimitedLog
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import NixlGrant, NixlOpen, NixlReady, NixlWant, PairClose, Result
from draftfeed.schemas.tensor_specs import declared_bytes

log = logging.getLogger("draftfeed.producer")

OnResult = Callable[[Result, dict[str, torch.Tensor]], None]
OnLost = Callable[[Result, str], None]
OnRefused = Callable[[Result, str], None]
SendToWorker = Callable[[bytes, list[Any]], None]


@dataclass
class _Waiting:
    header: Result
    deadline: float


class _Allocation:
    """A large host slot's memory, made on a thread of its own (touching gigabytes takes seconds)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.memory: Any = None
        self.done = threading.Event()
        threading.Thread(target=self._make, args=(size,), name="draftfeed-nixl-slot", daemon=True).start()

    def _make(self, size: int) -> None:
        try:
            self.memory = host_memory(size)
        except MemoryError as exc:
            log.warning("draftfeed: cannot allocate a nixl receive slot of %d bytes: %s", size, exc)
        finally:
            self.done.set()


@dataclass
class _Preparing:
    """A want waiting for its turn, or for the memory of its slot (``allocation``)."""

    identity: bytes
    message: NixlWant
    allocation: _Allocation | None = None


@dataclass
class _Pair:
    identity: bytes
    opened: NixlOpen
    waiting: dict[int, _Waiting] = field(default_factory=dict)  # slot -> a header whose notification has not come
    known: set[int] = field(default_factory=set)  # slots whose registration the worker has loaded
    received: int = 0


class NixlReceivers:
    """Every nixl pair of one rank. Called from the rank's IO thread."""

    def __init__(
        self,
        rank: str,
        device: torch.device | str,
        pool_bytes: int,
        on_result: OnResult,
        on_lost: OnLost,
        on_refused: OnRefused,
        send: SendToWorker,
        max_result_bytes: int,
    ) -> None:
        self.rank, self.device, self.pool_bytes = rank, torch.device(device), pool_bytes
        self.on_result, self.on_lost, self.on_refused, self._send = on_result, on_lost, on_refused, send
        self.max_result_bytes = max_result_bytes
        self._agent: NixlAgent | None = None
        self._pool: ReceivePool | None = None
        self._pairs: dict[str, _Pair] = {}  # worker name -> its open pair
        self._by_agent: dict[str, str] = {}  # the worker's agent name -> worker name
        self._filled: set[tuple[str, int]] = set()  # (worker, slot) whose notification came before the header
        self._full = RateLimitedLog(log)
        self._preparing: deque[_Preparing] = deque()  # wants waiting for a large slot's memory, in order

    # ------------------------------------------------------------ messages from workers
    def open(self, identity: bytes, message: NixlOpen) -> None:
        old = self._pairs.get(message.worker)
        if old is not None:
            self._close(message.worker, f"replaced by generation {message.generation}")
        try:
            agent, pool = self._ensure_agent()
        except NixlError as exc:
            log.warning("draftfeed rank %s: cannot open a nixl pair with worker %s: %s", self.rank, message.worker, exc)
            self._send(identity, pack(PairClose(worker=message.worker, generation=message.generation, reason=f"the rank: {exc}"[:512])))
            return
        self._pairs[message.worker] = _Pair(identity, message, known=pool.indices())
        self._by_agent[message.agent] = message.worker
        log.info("draftfeed rank %s: worker %s opens nixl pair %d: %s", self.rank, message.worker, message.generation, message.reason)
        ready = NixlReady(worker=message.worker, generation=message.generation, agent=agent.name, memory=pool.kind)
        self._send(identity, pack(ready, [agent.metadata()]))

    def want(self, identity: bytes, message: NixlWant) -> None:
        """Grant a slot for a worker's answer, or refuse it (the answer then comes as frames). A want that needs a
        large new host slot waits, in order, for its memory to be made on a thread of its own (``poll`` grants it)."""
        pair = self._pairs.get(message.worker)
        if pair is None or pair.opened.generation != message.generation or self._pool is None:
            reason = f"no open nixl pair {message.generation} with worker {message.worker} here"
            self._send(identity, pack(NixlGrant(generation=message.generation, want=message.want, refused=reason)))
            self._send(identity, pack(PairClose(worker=message.worker, generation=message.generation, reason=reason)))  # so it stops asking
            return
        if self._preparing:  # grants go in the order asked
            self._preparing.append(_Preparing(identity, message))
            return
        self._grant(identity, message, pair)

    def _grant(self, identity: bytes, message: NixlWant, pair: _Pair, memory: Any = None) -> None:
        assert self._pool is not None
        grant = NixlGrant(generation=message.generation, want=message.want)
        extra: list[bytes] = []
        if message.nbytes > self.max_result_bytes:
            grant = grant.model_copy(update={"refused": f"{message.nbytes} bytes is over this rank's max_result_bytes of {self.max_result_bytes}"})
        else:
            try:
                slot = self._pool.grant((message.worker, message.generation, message.want), message.nbytes, memory)
            except NeedsMemory as need:
                self._preparing.appendleft(_Preparing(identity, message, _Allocation(need.size)))
                return
            except (PoolFull, NixlError) as exc:  # full, or the memory could not be registered
                self._full.warning("full", "draftfeed rank %s: %s", self.rank, exc)
                grant = grant.model_copy(update={"refused": str(exc)[:512]})
            else:
                region = slot.region
                grant = grant.model_copy(update={"slot": slot.index, "address": region.address, "nbytes": region.nbytes, "device": region.device})
                if slot.index not in pair.known and self._agent is not None:
                    try:
                        extra = [self._agent.region_metadata(region)]
                    except NixlError as exc:
                        self._pool.quarantine(message.worker, message.generation)
                        grant = NixlGrant(generation=message.generation, want=message.want, refused=str(exc)[:512])
                    else:
                        pair.known.add(slot.index)
        self._send(identity, pack(grant, extra))

    def _granting(self) -> None:
        """Grant the wants that waited for memory, in order, as their memory is made (IO thread)."""
        while self._preparing:
            head = self._preparing[0]
            if head.allocation is not None and not head.allocation.done.is_set():
                return
            self._preparing.popleft()
            pair = self._pairs.get(head.message.worker)
            if pair is None or pair.opened.generation != head.message.generation or self._pool is None:
                continue  # the pair closed meanwhile: the worker gave up on this want
            if head.allocation is not None and head.allocation.memory is None:
                refused = f"no host memory for a receive slot of {head.allocation.size} bytes"
                self._send(head.identity, pack(NixlGrant(generation=head.message.generation, want=head.message.want, refused=refused)))
                continue
            self._grant(head.identity, head.message, pair, head.allocation.memory if head.allocation is not None else None)

    def receive(self, header: Result) -> None:
        """A header of plane nixl: its tensors are (or are about to be) in the slot it names."""
        pair = self._pairs.get(header.worker)
        if pair is None or pair.opened.generation != header.generation or header.slot is None or self._pool is None:
            self.on_lost(header, f"no open nixl pair {header.generation} with worker {header.worker}")
            return
        slot = self._pool.granted_to(header.slot, header.worker, pair.opened.generation)
        if slot is None:
            reason = f"slot {header.slot} was not granted to worker {header.worker}'s pair {header.generation}"
            self.on_lost(header, reason)
            self._close(header.worker, reason, tell_worker=True)
            return
        problem = _unreceivable(header, self.max_result_bytes, slot.region.nbytes)
        if problem is not None:
            self.on_refused(header, problem)
            self._close(header.worker, problem, tell_worker=True)
            return
        pair.waiting[header.slot] = _Waiting(header, time.monotonic() + pair.opened.timeout_s)
        self._take_notifications()
        self._complete(header.worker)

    def worker_closed(self, message: PairClose) -> None:
        pair = self._pairs.get(message.worker)
        if pair is not None and pair.opened.generation == message.generation:
            self._close(message.worker, f"the worker closed it: {message.reason}")

    def close_worker(self, worker: str, reason: str) -> None:
        if worker in self._pairs:
            self._close(worker, reason)

    # ------------------------------------------------------------ the IO loop
    @property
    def waiting(self) -> bool:
        """Whether a header waits for its notification, or a want for its slot's memory (the IO loop then polls often)."""
        return bool(self._preparing) or any(pair.waiting for pair in self._pairs.values())

    def poll(self) -> None:
        """Grant the wants whose memory is made; take the notifications that arrived; complete the answers they
        finish; give up on overdue ones."""
        self._granting()
        if self._agent is None or not self._pairs:
            return
        self._take_notifications()
        now = time.monotonic()
        for worker in list(self._pairs):
            self._complete(worker)
            pair = self._pairs.get(worker)
            overdue = [w for w in pair.waiting.values() if w.deadline < now] if pair is not None else []
            if overdue:
                self._close(worker, f"no notification for slot {overdue[0].header.slot} within {pair.opened.timeout_s:.0f} s", tell_worker=True)

    def _take_notifications(self) -> None:
        if self._agent is None:
            return
        try:
            arrived = self._agent.notifications()
        except NixlError as exc:
            log.warning("draftfeed rank %s: %s", self.rank, exc)
            return
        for agent_name, messages in arrived.items():
            worker = self._by_agent.get(agent_name)
            pair = self._pairs.get(worker) if worker is not None else None
            for raw in messages:
                filled = parse_notification(raw)
                if pair is None or filled is None or filled[0] != pair.opened.generation or self._pool is None:
                    log.debug("draftfeed rank %s: ignoring NIXL notification %r from %s", self.rank, raw[:64], agent_name)
                    continue
                generation, slot, want = filled
                if self._pool.filled(slot, (pair.opened.worker, generation, want)) is not None:
                    self._filled.add((pair.opened.worker, slot))

    def stats(self) -> dict[str, int]:
        out = {"pairs": len(self._pairs), "slots": 0, "registered_bytes": 0, "taken": 0, "quarantined": 0}
        pool = self._pool
        if pool is not None:
            out.update(pool.stats())
        return out

    def planes(self) -> dict[str, str]:
        return {worker: f"nixl {pair.opened.generation}" for worker, pair in list(self._pairs.items())}

    def close(self) -> None:
        for worker in list(self._pairs):
            self._close(worker, "the rank is closing", level=logging.DEBUG)
        if self._pool is not None:
            self._pool.close()
        if self._agent is not None:
            self._agent.close()
        self._agent = self._pool = None

    # ------------------------------------------------------------ internals
    def _ensure_agent(self) -> tuple[NixlAgent, ReceivePool]:
        if self._agent is None or self._pool is None:
            agent = NixlAgent(f"draftfeed-rank-{self.rank}-{uuid.uuid4().hex[:6]}")
            self._pool = ReceivePool(self.device, self.pool_bytes, agent.register, agent.deregister)
            self._agent = agent
        return self._agent, self._pool

    def _complete(self, worker: str) -> None:
        pair = self._pairs.get(worker)
        if pair is None or self._pool is None:
            return
        for index in [index for index in pair.waiting if (worker, index) in self._filled]:
            waiting = pair.waiting.pop(index)
            self._filled.discard((worker, index))
            slot = self._pool.granted_to(index, worker, pair.opened.generation)
            if slot is None or slot.state != "filled":
                self.on_lost(waiting.header, f"slot {index} is no longer this answer's")
                continue
            try:
                tensors = self._pool.take(slot, waiting.header.tensors)
            except (MalformedMessage, RuntimeError) as exc:
                self.on_refused(waiting.header, f"its tensors cannot be read from slot {index}: {exc}")
                continue
            pair.received += 1
            self.on_result(waiting.header, tensors)

    def _close(self, worker: str, reason: str, tell_worker: bool = False, level: int = logging.INFO) -> None:
        pair = self._pairs.pop(worker, None)
        if pair is None:
            return
        self._by_agent.pop(pair.opened.agent, None)
        self._filled = {(w, s) for w, s in self._filled if w != worker}
        quarantined = self._pool.quarantine(worker) if self._pool is not None else 0
        log.log(
            level,
            "draftfeed rank %s: nixl pair %d with worker %s closed (%s); %d slots quarantined",
            self.rank,
            pair.opened.generation,
            worker,
            reason,
            quarantined,
        )
        for waiting in pair.waiting.values():
            self.on_lost(waiting.header, reason)
        if tell_worker:
            self._send(pair.identity, pack(PairClose(worker=worker, generation=pair.opened.generation, reason=reason[:512])))


def _unreceivable(header: Result, limit: int, slot_bytes: int) -> str | None:
    """Why the answer the header announces will not be read from its slot, checked before any tensor is built."""
    total = declared_bytes(header.tensors)
    if total is None:
        return f"the answer names a dtype this rank does not know ({', '.join(s.dtype for s in header.tensors)})"
    if total > limit:
        return f"the answer announces {total} bytes, over this rank's max_result_bytes of {limit}"
    _offsets, end = packed_layout(header.tensors)
    if end > slot_bytes:
        return f"the answer's {end} bytes do not fit slot {header.slot} of {slot_bytes} bytes"
    return None
