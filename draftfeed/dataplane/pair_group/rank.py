"""The rank's side of its pair groups: one receiving thread per worker that opened a group with this rank.

A worker's ``pair_open`` starts a receiver that joins the worker's store and builds the rank's side of the
group. Each ``result`` header of plane ``pair`` then queues one receive on that worker's receiver, in the
order the headers came, which is the order the worker sends in; every such header is received in full,
even an answer the rank no longer waits for, so that the group stays in step.

When a group fails (a receive error or timeout, a header for a generation this rank does not hold, the
broker reporting the worker gone), every answer queued on it is reported lost (``on_lost``): the rank then
asks for it again through the broker, and whichever answer arrives first is used. The worker is told
(``on_closed``) so that it stops sending on that group.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from draftfeed.dataplane.pair_group.transport import RECEIVER, PairGroup, join_store
from draftfeed.schemas.messages import PairClose, PairOpen, Result
from draftfeed.schemas.protocol import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_TRANSFER_CHUNK_BYTES
from draftfeed.schemas.tensor_specs import declared_bytes

log = logging.getLogger("draftfeed.producer")

OnResult = Callable[[Result, dict[str, torch.Tensor]], None]
OnLost = Callable[[Result, str], None]
OnClosed = Callable[[bytes, PairClose], None]
OnRefused = Callable[[Result, str], None]


class _Receiver:
    """One worker's group: built and served on its own thread."""

    def __init__(self, identity: bytes, opened: PairOpen, device: torch.device, owner: PairReceivers) -> None:
        self.identity, self.opened, self.device, self.owner = identity, opened, device, owner
        self.jobs: queue.Queue[Result | None] = queue.Queue()
        self.closed = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"draftfeed-pair-{opened.worker}-{opened.generation}", daemon=True)

    def submit(self, header: Result) -> bool:
        with self._lock:
            if self.closed:
                return False
            self.jobs.put(header)
            return True

    def close(self, reason: str, tell_worker: bool) -> None:
        """Stop taking answers; report every queued one lost. The thread ends after its current receive."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            pending = _drain(self.jobs)
            self.jobs.put(None)
        for header in pending:
            self.owner.on_lost(header, reason)
        if tell_worker:
            self.owner.on_closed(self.identity, PairClose(worker=self.opened.worker, generation=self.opened.generation, reason=reason[:512]))

    def _run(self) -> None:
        opened = self.opened
        try:
            store = join_store(opened.store_host, opened.store_port, timeout_s=opened.timeout_s)
            group = PairGroup(store, RECEIVER, opened.backend, generation=opened.generation, timeout_s=opened.timeout_s, namespace=opened.nonce)
            group.warm_up()
            del store  # the worker stops its store once its side is built
        except Exception as exc:
            log.warning("draftfeed: could not join %s pair group %d of worker %s: %s", opened.backend, opened.generation, opened.worker, exc)
            self.close(f"the rank could not join: {exc}", tell_worker=True)
            return
        log.info("draftfeed: %s pair group %d with worker %s is ready (%s)", opened.backend, opened.generation, opened.worker, opened.reason)
        try:
            while True:
                header = self.jobs.get()
                if header is None:
                    return
                try:
                    tensors = group.receive(header.tensors, self.device, header.chunk_bytes or DEFAULT_TRANSFER_CHUNK_BYTES)
                except Exception as exc:
                    self.owner.on_lost(header, f"receive failed: {exc}")
                    self.close(f"a receive failed: {exc}", tell_worker=True)
                    return
                self.owner.on_result(header, tensors)
        finally:
            group.close()


class PairReceivers:
    """Every pair group of one rank, keyed by worker name. Called from the rank's IO thread; the callbacks
    run on the receivers' threads (on_result, on_lost) or the caller's (on_lost, on_closed)."""

    def __init__(
        self,
        device: torch.device | str,
        on_result: OnResult,
        on_lost: OnLost,
        on_closed: OnClosed,
        on_refused: OnRefused,
        max_result_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.device = torch.device(device)
        self.on_result, self.on_lost, self.on_closed, self.on_refused = on_result, on_lost, on_closed, on_refused
        self.max_result_bytes = max_result_bytes
        self._receivers: dict[str, _Receiver] = {}

    def open(self, identity: bytes, message: PairOpen) -> None:
        """A worker opens a group (a newer generation replaces its older one)."""
        old = self._receivers.get(message.worker)
        if old is not None:
            old.close(f"replaced by generation {message.generation}", tell_worker=False)
        log.info("draftfeed: worker %s opens %s pair group %d: %s", message.worker, message.backend, message.generation, message.reason)
        receiver = _Receiver(identity, message, self.device, self)
        self._receivers[message.worker] = receiver
        receiver.thread.start()

    def receive(self, header: Result) -> None:
        """Queue the receive of an answer whose tensors come on the worker's group."""
        receiver = self._receivers.get(header.worker)
        if receiver is None or receiver.opened.generation != header.generation:
            self.on_lost(header, f"no open pair group {header.generation} with worker {header.worker}")
            return
        problem = _unreceivable(header, self.max_result_bytes)
        if problem is not None:
            # Not receiving it leaves the group out of step: close it; asking again would bring the same answer.
            self.on_refused(header, problem)
            receiver.close(problem, tell_worker=True)
            return
        if not receiver.submit(header):
            self.on_lost(header, f"pair group {header.generation} with worker {header.worker} is closed")

    def worker_closed(self, message: PairClose) -> None:
        """The worker tore its side down."""
        receiver = self._receivers.get(message.worker)
        if receiver is not None and receiver.opened.generation == message.generation:
            self.close_worker(message.worker, f"the worker closed it: {message.reason}")

    def close_worker(self, worker: str, reason: str) -> None:
        receiver = self._receivers.pop(worker, None)
        if receiver is not None:
            receiver.close(reason, tell_worker=False)

    def opened(self, worker: str) -> PairOpen | None:
        """The ``pair_open`` of the group with ``worker``, while it is open."""
        receiver = self._receivers.get(worker)
        return None if receiver is None or receiver.closed else receiver.opened

    def planes(self) -> dict[str, str]:
        """worker -> "backend generation" of each open group (for tests and logs)."""
        return {w: f"{r.opened.backend} {r.opened.generation}" for w, r in self._receivers.items() if not r.closed}

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every group and wait (up to ``timeout_s`` in all) for the receiving threads to finish, so that
        no group is torn down while the interpreter exits (that aborts the process)."""
        receivers = list(self._receivers.values())
        for worker in list(self._receivers):
            self.close_worker(worker, "the rank is closing")
        deadline = time.monotonic() + timeout_s
        for receiver in receivers:
            receiver.thread.join(max(0.0, deadline - time.monotonic()))


def _unreceivable(header: Result, limit: int) -> str | None:
    """Why the receiver will not allocate what the header announces, checked before any allocation."""
    total = declared_bytes(header.tensors)
    if total is None:
        return f"the answer names a dtype this rank does not know ({', '.join(s.dtype for s in header.tensors)})"
    if total > limit:
        return f"the answer announces {total} bytes, over this rank's max_result_bytes of {limit}"
    return None


def _drain(jobs: queue.Queue[Result | None]) -> list[Result]:
    out = []
    while True:
        try:
            item = jobs.get_nowait()
        except queue.Empty:
            return out
        if item is not None:
            out.append(item)
