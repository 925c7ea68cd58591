"""The worker's side of the data planes: per rank, frames or a pair group, and that group's life.

For each rank it serves, the worker chooses a plane once (dataplane/choice.py, logged with the reason).
A pair plane is opened without stopping work: the worker hosts a one-off TCPStore, tells the rank to
join it (``pair_open`` on the rank's data socket) and builds its side of the group on a thread; answers
go as frames until the group is ready. A group that fails is torn down (``pair_close`` to the rank), the
answer in hand goes again as frames, and a new group, under a new generation, is opened after a backoff
that doubles with each failure. A group is never used again after a failure: a send that failed part way
leaves the two sides out of step.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from draftfeed.dataplane.choice import PlaneChoice, choose_plane
from draftfeed.dataplane.pair_group import SENDER, DataPlaneError, PairGroup, host_store, join_store
from draftfeed.net import local_address_towards
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import DataPlaneOffer, PairClose, PairOpen, PairStatus

log = logging.getLogger("draftfeed.worker")


class PlaneRefused(Exception):
    """A data plane was forced (worker --data-plane, or the rank's data_plane) that this pair cannot have."""


# Seconds before a failed pair group is opened again: doubles per failure, up to the second number.
REOPEN_BACKOFF_S = (1.0, 60.0)


@dataclass
class _Pair:
    endpoint: str
    rank: str
    choice: PlaneChoice
    state: str = "frames"  # frames (for good) | down (open at reopen_at) | opening | ready
    generation: int | None = None
    group: PairGroup | None = None
    store: dist.Store | None = None
    opening: threading.Thread | None = None
    opened: list[Any] = field(default_factory=list)  # the opening thread's PairGroup or exception
    reopen_at: float = 0.0
    failures: int = 0
    sent_over_pair: int = 0
    fallbacks: int = 0

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

    def __init__(self, worker: str, offer: DataPlaneOffer, send: Callable[[str, list[Any]], bool], timeout_s: float = 30.0) -> None:
        self.worker = worker
        self.offer = offer
        self.timeout_s = timeout_s
        self._send = send  # (rank endpoint, frames) -> whether it went out, without blocking
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._next_generation = 0

    def group_for(self, endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> tuple[PairGroup, int] | None:
        """The ready group to this rank and its generation, or None: send this answer as frames. Raises
        PlaneRefused when the plane this pair was made to use cannot be had (the reason says why)."""
        pair = self._pairs.get(endpoint)
        if pair is None:
            pair = self._new_pair(endpoint, rank, rank_offer)
        if pair.choice.refused:
            raise PlaneRefused(pair.choice.reason)
        if pair.state == "opening":
            self._check_opening(pair)
        if pair.state == "down" and time.monotonic() >= pair.reopen_at:
            self._open(pair)
        if pair.state == "ready" and pair.group is not None and pair.generation is not None:
            return pair.group, pair.generation
        return None

    def sent(self, endpoint: str) -> None:
        pair = self._pairs[endpoint]
        pair.sent_over_pair += 1
        pair.failures = 0  # the group works: a later failure starts the backoff afresh

    def failed(self, endpoint: str, reason: str) -> None:
        """The group to this rank failed: tear it down, tell the rank, reopen after the backoff."""
        pair = self._pairs.get(endpoint)
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

    def rank_closed(self, endpoint: str, message: PairClose) -> None:
        """The rank tore the group of ``message.generation`` down on its side."""
        pair = self._pairs.get(endpoint)
        if pair is not None and pair.generation == message.generation and pair.state in ("opening", "ready"):
            log.warning("worker %s: rank %s closed pair group %d: %s", self.worker, pair.rank, message.generation, message.reason)
            self._tear_down(pair, message.reason, tell_rank=False)

    def forget(self, endpoint: str) -> None:
        """The rank is gone: release its group now."""
        with self._lock:
            pair = self._pairs.pop(endpoint, None)
        if pair is not None:
            self._release(pair)

    def statuses(self) -> list[PairStatus]:
        with self._lock:
            return [pair.status() for pair in self._pairs.values()]

    def close(self) -> None:
        for endpoint in list(self._pairs):
            self.forget(endpoint)

    # ------------------------------------------------------------ internals
    def _new_pair(self, endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> _Pair:
        choice = choose_plane(self.offer, rank_offer)
        if choice.refused:
            log.error("worker %s: data plane to rank %s refused: %s; its requests fail", self.worker, rank, choice.reason)
        else:
            log.info("worker %s: data plane to rank %s: %s (%s)", self.worker, rank, choice.plane, choice.reason)
        pair = _Pair(endpoint, rank, choice, state="frames" if choice.plane == "frames" else "down")
        with self._lock:
            self._pairs[endpoint] = pair
        return pair

    def _open(self, pair: _Pair) -> None:
        generation = self._next_generation
        host = local_address_towards(pair.endpoint)
        try:
            store = host_store(host, timeout_s=self.timeout_s)
        except (RuntimeError, OSError) as exc:
            self._backoff(pair, f"no rendezvous store: {exc}")
            return
        backend = pair.choice.plane
        nonce = secrets.token_hex(16)
        message = PairOpen(
            worker=self.worker,
            generation=generation,
            backend=backend,
            store_host=host,
            store_port=store.port,
            nonce=nonce,
            timeout_s=self.timeout_s,
            reason=pair.choice.reason[:512],
        )
        if not self._send(pair.endpoint, pack(message)):
            return  # the rank's link is busy or not up yet: try again with the next answer
        self._next_generation += 1
        pair.generation, pair.store, pair.state, pair.opened = generation, store, "opening", []
        pair.opening = threading.Thread(
            target=_build,
            args=(host, store.port, backend, generation, nonce, self.timeout_s, pair.opened),
            name=f"draftfeed-pair-{generation}",
            daemon=True,
        )
        pair.opening.start()
        log.info("worker %s: opening %s pair group %d with rank %s", self.worker, backend, generation, pair.rank)

    def _check_opening(self, pair: _Pair) -> None:
        if pair.opening is None or pair.opening.is_alive():
            return
        outcome = pair.opened[0] if pair.opened else RuntimeError("the opening thread ended without a result")
        pair.opening = None
        if isinstance(outcome, PairGroup):
            pair.group, pair.state = outcome, "ready"
            pair.store = None  # built and warmed up: the group no longer needs the store, which stops listening
            log.info("worker %s: %s pair group %d with rank %s is ready", self.worker, pair.choice.plane, pair.generation, pair.rank)
        else:
            log.warning(
                "worker %s: %s pair group %s with rank %s could not be built: %s", self.worker, pair.choice.plane, pair.generation, pair.rank, outcome
            )
            self._tear_down(pair, f"could not be built: {outcome}", tell_rank=True)

    def _tear_down(self, pair: _Pair, reason: str, tell_rank: bool) -> None:
        if tell_rank and pair.generation is not None:
            self._send(pair.endpoint, pack(PairClose(worker=self.worker, generation=pair.generation, reason=reason[:512])))
        self._release(pair)
        self._backoff(pair, reason)

    def _backoff(self, pair: _Pair, reason: str) -> None:
        pair.failures += 1
        low, high = REOPEN_BACKOFF_S
        delay = min(high, low * 2 ** (pair.failures - 1))
        pair.state, pair.reopen_at = "down", time.monotonic() + delay
        log.info("worker %s: rank %s gets frames; a new pair group in %.0f s (%s)", self.worker, pair.rank, delay, reason)

    @staticmethod
    def _release(pair: _Pair) -> None:
        if pair.group is not None:
            pair.group.close()
        pair.group = None
        if pair.opening is not None:
            # Still joining: the thread ends at its timeout; whatever it built is closed then.
            opening, opened = pair.opening, pair.opened
            threading.Thread(target=_close_when_built, args=(opening, opened), daemon=True).start()
        pair.opening, pair.opened, pair.store = None, [], None


def _build(host: str, port: int, backend: str, generation: int, nonce: str, timeout_s: float, out: list[Any]) -> None:
    """The worker's side, as a client of its own store: the group keeps its store alive, and the server, which
    the pair holds apart, must be able to stop once the group is built."""
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
