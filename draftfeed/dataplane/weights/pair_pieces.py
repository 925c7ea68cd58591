"""A weight update's pieces over a pair group of their own (dataplane/pair_group/transport.py): the publisher and one
worker process on the same machine, NCCL between their GPUs (the colocated trainer and worker of an RL job), or gloo.

The worker asks for the pair (``WeightsPull`` ``pair``); the publisher opens a rendezvous store on its socket's
address, answers where it is with a namespace secret to this pull, and sends every piece of the plan in order from a
thread of its own (``PairSends``), piece ``i`` on tag ``i``, at most ``WINDOW`` in flight, straight from the trainer's
tensors (on gloo a CUDA tensor's piece is copied to the host as it goes). The worker (``PairReceives``) receives each
piece into one of ``ahead`` staging slots on its own device, checks it and writes it as a frame's, and posts the
receive of piece ``i + ahead`` once piece ``i`` is written. A failure or a timeout is a ``ConnectionError``, as a
publisher that stops answering is.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque

import torch

from draftfeed.dataplane.frames.codec import flat_bytes
from draftfeed.dataplane.pair_group.transport import RECEIVER, SENDER, WINDOW, DataPlaneError, PairGroup, host_store, join_store
from draftfeed.dataplane.weights.plan import Piece
from draftfeed.schemas.messages import WeightsPair

log = logging.getLogger("draftfeed.weights")


def pair_backend(tensors: list[torch.Tensor], asked: bool | None) -> str | None:
    """The pair group a publisher of ``tensors`` offers: NCCL when they are on a GPU and NCCL is here (unless
    ``asked`` is False), gloo only when ``asked`` (on one machine NIXL or frames move host memory as fast), or none."""
    on_gpu = bool(tensors) and all(tensor.is_cuda for tensor in tensors)
    if asked is False:
        return None
    if on_gpu and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo" if asked else None


class PairSends(threading.Thread):
    """The publisher's side for one worker process: the store, then the group, then every piece in order."""

    def __init__(self, tensors: list[torch.Tensor], pieces: list[Piece], backend: str, host: str, update: int, timeout_s: float) -> None:
        super().__init__(name="draftfeed-weights-pair", daemon=True)
        self.tensors, self.pieces, self.backend, self.timeout_s = tensors, pieces, backend, timeout_s
        self.namespace = secrets.token_hex(16)
        self._store = host_store(host, timeout_s)  # dropped once the group is built: it has no authentication
        self.offer = WeightsPair(update=update, host=host, port=self._store.port, backend=backend, namespace=self.namespace)
        self.group: PairGroup | None = None

    def run(self) -> None:
        try:
            self.group = PairGroup(self._store, SENDER, self.backend, timeout_s=self.timeout_s, namespace=self.namespace)
            self._store = None
            in_flight: deque[tuple[object, torch.Tensor]] = deque()
            for index, piece in enumerate(self.pieces):
                buffer = flat_bytes(self.tensors[piece.tensor])[piece.offset : piece.offset + piece.nbytes]
                if self.backend == "gloo" and buffer.is_cuda:
                    buffer = buffer.cpu()
                in_flight.append((self.group.post(buffer, index), buffer))
                if len(in_flight) >= WINDOW:
                    self.group.wait(*in_flight.popleft())
            while in_flight:
                self.group.wait(*in_flight.popleft())
        except (DataPlaneError, RuntimeError) as exc:  # the worker went, or timed out: it says so on its side
            log.warning("draftfeed: weights publisher: the %s pair to a worker failed: %s", self.backend, exc)
        finally:
            self._store = None

    def close(self) -> None:
        if self.group is not None:
            self.group.close()  # aborts a transfer in progress: the thread ends
        self.join(5)


class PairReceives:
    """The worker's side: the pieces of one update, received over the pair ``offer`` names into staging slots."""

    plane = "the pair group"

    def __init__(self, offer: WeightsPair, pieces: list[Piece], chunk_bytes: int, ahead: int, device: torch.device, timeout_s: float) -> None:
        self.pieces = pieces
        self.failed = False  # a receive failed: the plane's fault, not the update's
        device = device if offer.backend == "nccl" else torch.device("cpu")
        store = join_store(offer.host, offer.port, timeout_s)
        try:
            self.group = PairGroup(store, RECEIVER, offer.backend, timeout_s=timeout_s, namespace=offer.namespace)
        except DataPlaneError as exc:
            raise ConnectionError(str(exc)) from None
        self.slots = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(ahead)]
        self._receives: dict[int, object] = {}

    def ask(self, index: int) -> None:
        try:
            self._receives[index] = self.group.post(self._slot(index), index)
        except DataPlaneError as exc:
            self.failed = True
            raise ConnectionError(str(exc)) from None

    def take(self, index: int) -> torch.Tensor:
        try:
            self.group.wait(self._receives.pop(index), self._slot(index))
        except DataPlaneError as exc:
            self.failed = True
            raise ConnectionError(str(exc)) from None
        return self._slot(index)

    def _slot(self, index: int) -> torch.Tensor:
        return self.slots[index % len(self.slots)][: self.pieces[index].nbytes]

    def close(self) -> None:
        self.group.close()
