"""A pair group as the worker's plane to one rank (gloo or nccl): one generation, from ``pair_open`` to its close.

The worker hosts a one-off TCPStore on its interface towards the rank, tells the rank to join it (``pair_open`` on
the rank's data socket) and builds its side of the group on a thread (dataplane/pair_group/transport.py is the transport).
Once built, each answer goes as a ``result`` header with ``plane: "pair"`` on the socket and its tensors on the
group. A send that fails leaves the group out of step: it is reported (``failed``) and never used again.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from draftfeed.dataplane.frames.worker import SendResult
from draftfeed.dataplane.pair_group.transport import SENDER, DataPlaneError, PairGroup, describe, host_store, join_store
from draftfeed.dataplane.worker_plane import FromRank, OutgoingAnswer, PlaneFailed, PlaneState
from draftfeed.net import local_address_towards
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import PairOpen, Result

log = logging.getLogger("draftfeed.worker")


class PairGroupPlane:
    """One generation of a pair group with one rank. Called from the worker's compute thread."""

    def __init__(
        self,
        worker: str,
        rank: str,
        data_endpoint: str,
        backend: str,
        generation: int,
        reason: str,
        timeout_s: float,
        send: Callable[[list[Any]], bool],
        failed: Callable[[str], None],
    ) -> None:
        """``send``: a control message to the rank, without blocking (whether it went out); ``failed``: the pair's
        report of a failed send (tear down, frames, a new group after the backoff)."""
        self.worker, self.rank, self.data_endpoint = worker, rank, data_endpoint
        self.name, self.generation, self.reason, self.timeout_s = backend, generation, reason, timeout_s
        self._send, self._failed = send, failed
        self.state: PlaneState = "opening"
        self._group: PairGroup | None = None
        self._store: dist.Store | None = None  # the rendezvous server, held until the group is built
        self._opening: threading.Thread | None = None
        self._opened: list[Any] = []  # the opening thread's PairGroup or exception

    def open(self) -> bool:
        host = local_address_towards(self.data_endpoint)
        try:
            store = host_store(host, timeout_s=self.timeout_s)
        except (RuntimeError, OSError) as exc:
            raise PlaneFailed(f"no rendezvous store: {exc}") from exc
        nonce = secrets.token_hex(16)
        message = PairOpen(
            worker=self.worker,
            generation=self.generation,
            backend=self.name,
            store_host=host,
            store_port=store.port,
            nonce=nonce,
            timeout_s=self.timeout_s,
            reason=self.reason[:512],
        )
        if not self._send(pack(message)):
            return False  # the rank's link is busy or not up yet: try again with the next answer
        self._store = store
        self._opening = threading.Thread(
            target=_build,
            args=(host, store.port, self.name, self.generation, nonce, self.timeout_s, self._opened),
            name=f"draftfeed-pair-{self.generation}",
            daemon=True,
        )
        self._opening.start()
        log.info("worker %s: opening %s pair group %d with rank %s", self.worker, self.name, self.generation, self.rank)
        return True

    def check(self) -> None:
        if self._opening is None or self._opening.is_alive():
            return
        outcome = self._opened[0] if self._opened else RuntimeError("the opening thread ended without a result")
        self._opening = None
        if not isinstance(outcome, PairGroup):
            log.warning(
                "worker %s: %s pair group %s with rank %s could not be built: %s", self.worker, self.name, self.generation, self.rank, outcome
            )
            raise PlaneFailed(f"could not be built: {outcome}")
        self._group, self.state = outcome, "ready"
        self._store = None  # built and warmed up: the group no longer needs the store, which stops listening
        log.info("worker %s: %s pair group %d with rank %s is ready", self.worker, self.name, self.generation, self.rank)

    def receive(self, message: FromRank, frames: list[Any]) -> None:
        """A pair group takes nothing from the rank but its pair_close (the pair's)."""

    def deliver(self, answer: OutgoingAnswer) -> SendResult | None:
        """The header on the socket, then the tensors on the group; None: the group failed and was torn down (the
        rank drops what it got), send it as frames."""
        group = self._group
        if group is None:
            return None
        header = Result(tensors=describe(answer.tensors), plane="pair", generation=self.generation, chunk_bytes=answer.chunk_bytes, **answer.fields)
        delivery = answer.send(pack(header))
        if delivery is not SendResult.SENT:
            return delivery  # the rank is gone or unreachable: its pair was released with it
        try:
            group.send(answer.tensors, answer.chunk_bytes)
            return SendResult.SENT
        except DataPlaneError as exc:
            self._failed(str(exc))  # the rank drops what it got; frames follow
        except Exception as exc:  # e.g. a device error copying the tensors: the group is out of step too
            log.exception("worker %s: sending on the pair group to %s failed", self.worker, answer.rank)
            group.close()
            self._failed(f"{type(exc).__name__}: {exc}")
        return None

    def close(self) -> None:
        self.state = "closed"
        if self._group is not None:
            self._group.close()
        self._group = None
        if self._opening is not None:
            # Still joining: the thread ends at its timeout; whatever it built is closed then.
            threading.Thread(target=_close_when_built, args=(self._opening, self._opened), daemon=True).start()
        self._opening, self._opened, self._store = None, [], None


def _build(host: str, port: int, backend: str, generation: int, nonce: str, timeout_s: float, out: list[Any]) -> None:
    """The worker's side, as a client of its own store: the group keeps its store alive, and the server, which
    the plane holds apart, must be able to stop once the group is built."""
    try:
        store = join_store(host, port, timeout_s=timeout_s)
        group = PairGroup(store, SENDER, backend, generation=generation, timeout_s=timeout_s, namespace=nonce)
        group.warm_up()
        out.append(group)
    except (DataPlaneError, RuntimeError, ValueError) as exc:
        out.append(exc)


def _close_when_built(opening: threading.Thread, opened: list[Any]) -> None:
    opening.join()
    for outcome in opened:
        if isinstance(outcome, PairGroup):
            outcome.close()
