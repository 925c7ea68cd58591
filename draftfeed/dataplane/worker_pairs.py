"""The worker's side of the data planes: per rank, frames, a pair group or a nixl pair, and its life.

For each rank it serves, the worker chooses a plane once (dataplane/choice.py, logged with the reason).
A pair plane is opened without stopping work; answers go as frames until it is ready. What opens it and carries
answers on it is the plane object (dataplane/worker_plane.py: one interface): ``PairGroupPlane`` (dataplane/pair_group/worker.py: gloo,
nccl) or ``NixlPlane`` (dataplane/nixl/worker.py); this module keeps the bookkeeping every plane shares: which plane a rank's
pair uses, its generations, its state, its failures and their backoff, its counts for ``draftfeed status``.

A pair that fails is torn down (``pair_close`` to the rank), the answer in hand goes again as frames, and a
new pair, under a new generation, is opened after a backoff that doubles with each failure. A pair is never
used again after a failure: a send that failed part way leaves the two sides out of step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from draftfeed.dataplane.choice import PlaneChoice, choose_plane
from draftfeed.dataplane.nixl.worker import NixlPlane
from draftfeed.dataplane.nixl.worker_writes import NixlSender
from draftfeed.dataplane.pair_group.worker import PairGroupPlane
from draftfeed.dataplane.worker_plane import FromRank, PairPlane, PlaneFailed
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import DataPlaneOffer, PairClose, PairStatus

log = logging.getLogger("draftfeed.worker")


class PlaneRefused(Exception):
    """A data plane was forced (worker --data-plane, or the rank's data_plane) that this pair cannot have."""


# Seconds before a failed pair group is opened again: doubles per failure, up to the second number.
REOPEN_BACKOFF_S = (1.0, 60.0)


@dataclass
class _Pair:
    data_endpoint: str
    rank: str
    choice: PlaneChoice
    generation: int | None = None  # the last one opened
    plane: PairPlane | None = None  # the plane of that generation while it opens or is ready
    reopen_at: float = 0.0
    failures: int = 0
    sent_over_pair: int = 0
    fallbacks: int = 0

    @property
    def state(self) -> str:
        """frames (for good) | down (opened again at reopen_at) | opening | ready."""
        plane = self.plane
        if self.choice.plane == "frames":
            return "frames"
        return "down" if plane is None else plane.state

    def status(self) -> PairStatus:
        return PairStatus(
            rank=self.rank,
            plane=self.choice.plane,
            state=self.state,
            reason=self.choice.reason[:512],
            generation=self.generation,
            sent_over_pair=self.sent_over_pair,
            fallbacks=self.fallbacks,
        )


class PairPlanes:
    """Every rank's plane, for one worker. Called from the worker's compute thread only, except
    ``statuses`` (the heartbeat thread)."""

    def __init__(
        self,
        worker: str,
        offer: DataPlaneOffer,
        send: Callable[[str, list[Any]], bool],
        timeout_s: float = 30.0,
        nixl_min_bytes: int = 1 << 20,
    ) -> None:
        self.worker = worker
        self.offer = offer
        self.nixl = NixlSender(worker, torch.device(offer.device))  # the worker's agent and writes, for every nixl pair
        self.timeout_s = timeout_s
        self.nixl_min_bytes = nixl_min_bytes  # smaller answers go as frames on a nixl pair too
        self._send = send  # (rank data endpoint, frames) -> whether it went out, without blocking
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._next_generation = 0
        # How each plane is made for a pair's generation, by the plane the pair chose.
        self._makers: dict[str, Callable[[_Pair, int], PairPlane]] = {"gloo": self._group, "nccl": self._group, "nixl": self._nixl}

    def plane_for(self, data_endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> PairPlane | None:
        """The ready plane to this rank, or None: send this answer as frames. Raises PlaneRefused when the plane
        this pair was made to use cannot be had (the reason says why)."""
        pair = self._pairs.get(data_endpoint)
        if pair is None:
            pair = self._new_pair(data_endpoint, rank, rank_offer)
        if pair.choice.refused:
            raise PlaneRefused(pair.choice.reason)
        if pair.plane is not None and pair.plane.state == "opening":
            try:
                pair.plane.check()
            except PlaneFailed as exc:
                self._tear_down(pair, str(exc), tell_rank=True)
        if pair.state == "down" and time.monotonic() >= pair.reopen_at:
            self._open(pair)
        plane = pair.plane
        return plane if plane is not None and plane.state == "ready" else None

    def receive(self, data_endpoint: str, message: FromRank, frames: list[Any]) -> None:
        """What the rank sent back for its pair's plane (a nixl pair's readiness, a grant): to the plane of that
        generation; one that makes the plane unusable tears the pair down."""
        pair = self._pairs.get(data_endpoint)
        if pair is None or pair.plane is None or pair.generation != message.generation:
            return
        try:
            pair.plane.receive(message, frames)
        except PlaneFailed as exc:
            self._tear_down(pair, str(exc), tell_rank=True)

    def sent(self, data_endpoint: str) -> None:
        pair = self._pairs[data_endpoint]
        pair.sent_over_pair += 1
        pair.failures = 0  # the group works: a later failure starts the backoff afresh

    def failed(self, data_endpoint: str, reason: str) -> None:
        """The group to this rank failed: tear it down, tell the rank, reopen after the backoff."""
        pair = self._pairs.get(data_endpoint)
        if pair is None:
            return
        pair.fallbacks += 1
        log.warning(
            "worker %s: %s pair group %s with rank %s failed (%s); this answer goes as frames",
            self.worker,
            pair.choice.plane,
            pair.generation,
            pair.rank,
            reason,
        )
        self._tear_down(pair, reason, tell_rank=True)

    def rank_closed(self, data_endpoint: str, message: PairClose) -> None:
        """The rank tore the group of ``message.generation`` down on its side."""
        pair = self._pairs.get(data_endpoint)
        if pair is not None and pair.generation == message.generation and pair.state in ("opening", "ready"):
            log.warning("worker %s: rank %s closed pair group %d: %s", self.worker, pair.rank, message.generation, message.reason)
            self._tear_down(pair, message.reason, tell_rank=False)

    def forget(self, data_endpoint: str) -> None:
        """The rank is gone: release its group now."""
        with self._lock:
            pair = self._pairs.pop(data_endpoint, None)
        if pair is not None:
            self._release(pair)

    def statuses(self) -> list[PairStatus]:
        with self._lock:
            return [pair.status() for pair in self._pairs.values()]

    # ------------------------------------------------------------ work in flight on the planes (nixl writes)
    @property
    def in_flight(self) -> int:
        """How many transfers are in flight (the compute loop checks on them every millisecond meanwhile)."""
        return self.nixl.writing

    def finish(self, block: bool) -> None:
        """Check on the transfers in flight, dropping those that ended (``block``: wait for the oldest); one that
        failed takes its pair down."""
        self.nixl.finish_writes(block)

    def close(self) -> None:
        for data_endpoint in list(self._pairs):
            self.forget(data_endpoint)

    def shut_down(self) -> None:
        """Let every transfer in flight end, close every pair and the NIXL agent (the worker is exiting)."""
        self.nixl.drain()
        self.close()
        self.nixl.close()

    # ------------------------------------------------------------ internals
    def _new_pair(self, data_endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> _Pair:
        choice = choose_plane(self.offer, rank_offer)
        if choice.refused:
            log.error("worker %s: data plane to rank %s refused: %s; its requests fail", self.worker, rank, choice.reason)
        else:
            log.info("worker %s: data plane to rank %s: %s (%s)", self.worker, rank, choice.plane, choice.reason)
        pair = _Pair(data_endpoint, rank, choice)
        with self._lock:
            self._pairs[data_endpoint] = pair
        return pair

    def _open(self, pair: _Pair) -> None:
        plane = self._makers[pair.choice.plane](pair, self._next_generation)
        try:
            opened = plane.open()
        except PlaneFailed as exc:
            self._backoff(pair, str(exc))
            return
        if opened:
            self._next_generation += 1
            pair.generation, pair.plane = plane.generation, plane

    def _group(self, pair: _Pair, generation: int) -> PairPlane:
        return PairGroupPlane(
            self.worker,
            pair.rank,
            pair.data_endpoint,
            pair.choice.plane,
            generation,
            pair.choice.reason,
            self.timeout_s,
            send=functools.partial(self._send, pair.data_endpoint),
            failed=functools.partial(self.failed, pair.data_endpoint),
        )

    def _nixl(self, pair: _Pair, generation: int) -> PairPlane:
        return NixlPlane(
            self.worker,
            pair.rank,
            generation,
            pair.choice.reason,
            self.timeout_s,
            self.nixl_min_bytes,
            self.nixl,
            send=functools.partial(self._send, pair.data_endpoint),
            failed=functools.partial(self.failed, pair.data_endpoint),
        )

    def _tear_down(self, pair: _Pair, reason: str, tell_rank: bool) -> None:
        if tell_rank and pair.generation is not None:
            self._send(pair.data_endpoint, pack(PairClose(worker=self.worker, generation=pair.generation, reason=reason[:512])))
        self._release(pair)
        self._backoff(pair, reason)

    def _backoff(self, pair: _Pair, reason: str) -> None:
        pair.failures += 1
        low, high = REOPEN_BACKOFF_S
        delay = min(high, low * 2 ** (pair.failures - 1))
        pair.reopen_at = time.monotonic() + delay
        log.info("worker %s: rank %s gets frames; a new pair group in %.0f s (%s)", self.worker, pair.rank, delay, reason)

    @staticmethod
    def _release(pair: _Pair) -> None:
        plane, pair.plane = pair.plane, None
        if plane is not None:
            plane.close()
