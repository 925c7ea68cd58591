"""The worker's side of the data planes: per rank, frames, a pair group or a nixl pair, and its life.

For each rank it serves, the worker chooses a plane once (dataplane/choice.py, logged with the reason).
A pair plane is opened without stopping work; answers go as frames until it is ready:

- a pair group (gloo, nccl): the worker hosts a one-off TCPStore, tells the rank to join it (``pair_open``
  on the rank's data socket) and builds its side of the group on a thread;
- a nixl pair: the worker starts its NIXL agent (nixl_senders.py) and sends ``nixl_open``; the rank's
  ``nixl_ready`` brings its agent metadata, which the worker loads.

A pair that fails is torn down (``pair_close`` to the rank), the answer in hand goes again as frames, and a
new pair, under a new generation, is opened after a backoff that doubles with each failure. A pair is never
used again after a failure: a send that failed part way leaves the two sides out of step.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from draftfeed.consumers.nixl_senders import NixlSender
from draftfeed.dataplane.choice import PlaneChoice, choose_plane
from draftfeed.dataplane.nixl.transport import NixlError
from draftfeed.dataplane.pair_group import SENDER, DataPlaneError, PairGroup, host_store, join_store
from draftfeed.net import local_address_towards
from draftfeed.schemas.frames import frame_bytes, pack
from draftfeed.schemas.messages import DataPlaneOffer, NixlGrant, NixlOpen, NixlReady, PairClose, PairOpen, PairStatus

log = logging.getLogger("draftfeed.worker")


class PlaneRefused(Exception):
    """A data plane was forced (worker --data-plane, or the rank's data_plane) that this pair cannot have."""


# Seconds before a failed pair group is opened again: doubles per failure, up to the second number.
REOPEN_BACKOFF_S = (1.0, 60.0)


@dataclass(frozen=True)
class NixlLink:
    """A ready nixl pair: where to write for this rank."""

    sender: NixlSender
    remote_agent: str
    memory: str  # the rank's slots: DRAM or VRAM


@dataclass
class _Pair:
    data_endpoint: str
    rank: str
    choice: PlaneChoice
    state: str = "frames"  # frames (for good) | down (open at reopen_at) | opening | ready
    generation: int | None = None
    group: PairGroup | None = None
    store: dist.Store | None = None
    opening: threading.Thread | None = None
    opened: list[Any] = field(default_factory=list)  # the opening thread's PairGroup or exception
    reopen_at: float = 0.0
    opening_until: float = 0.0  # a nixl pair: the rank's nixl_ready must come before this
    nixl: NixlLink | None = None
    grants: dict[int, NixlGrant] = field(default_factory=dict)  # want -> the rank's grant, until taken
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
        self.nixl = NixlSender(worker, torch.device(offer.device))
        self._next_want = 0
        self.timeout_s = timeout_s
        self._send = send  # (rank data endpoint, frames) -> whether it went out, without blocking
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._next_generation = 0

    def group_for(self, data_endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> tuple[PairGroup | NixlLink, int] | None:
        """The ready group or nixl link to this rank and its generation, or None: send this answer as frames.
        Raises PlaneRefused when the plane this pair was made to use cannot be had (the reason says why)."""
        pair = self._pairs.get(data_endpoint)
        if pair is None:
            pair = self._new_pair(data_endpoint, rank, rank_offer)
        if pair.choice.refused:
            raise PlaneRefused(pair.choice.reason)
        if pair.state == "opening":
            self._check_opening(pair)
        if pair.state == "down" and time.monotonic() >= pair.reopen_at:
            self._open(pair)
        if pair.state == "ready" and pair.generation is not None:
            if pair.group is not None:
                return pair.group, pair.generation
            if pair.nixl is not None:
                return pair.nixl, pair.generation
        return None

    # ------------------------------------------------------------ nixl pairs
    def nixl_ready(self, data_endpoint: str, message: NixlReady, frames: list[Any]) -> None:
        """The rank's side of a nixl pair is up: load its agent metadata."""
        pair = self._pairs.get(data_endpoint)
        if pair is None or pair.generation != message.generation or pair.state != "opening" or pair.choice.plane != "nixl":
            return
        try:
            if len(frames) != 1:
                raise NixlError(f"nixl_ready carries {len(frames)} frames, not the one of agent metadata")
            name = self.nixl.connect(frame_bytes(frames[0]))
        except NixlError as exc:
            self._tear_down(pair, f"the rank's agent could not be loaded: {exc}", tell_rank=True)
            return
        if name != message.agent:
            self.nixl.disconnect(name)
            self._tear_down(pair, f"the rank's agent metadata names {name!r}, not {message.agent!r}", tell_rank=True)
            return
        pair.nixl, pair.state = NixlLink(self.nixl, name, message.memory), "ready"
        log.info("worker %s: nixl pair %d with rank %s is ready (its slots in %s)", self.worker, pair.generation, pair.rank, message.memory)

    def granted(self, data_endpoint: str, message: NixlGrant, frames: list[Any]) -> None:
        """A grant; with one frame, the metadata of a slot the rank registered since this pair opened: loaded now."""
        pair = self._pairs.get(data_endpoint)
        if pair is None or pair.generation != message.generation or pair.state != "ready":
            return
        if frames:
            try:
                self.nixl.connect(frame_bytes(frames[0]))
            except NixlError as exc:
                self._tear_down(pair, f"a new slot's metadata could not be loaded: {exc}", tell_rank=True)
                return
        pair.grants[message.want] = message

    def take_grant(self, data_endpoint: str, generation: int, want: int) -> NixlGrant | None:
        pair = self._pairs.get(data_endpoint)
        if pair is None or pair.generation != generation:
            return None
        return pair.grants.pop(want, None)

    def is_ready(self, data_endpoint: str, generation: int) -> bool:
        pair = self._pairs.get(data_endpoint)
        return pair is not None and pair.generation == generation and pair.state == "ready"

    def next_want(self) -> int:
        self._next_want += 1
        return self._next_want

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

    def close(self) -> None:
        for data_endpoint in list(self._pairs):
            self.forget(data_endpoint)

    def shut_down(self) -> None:
        """Close every pair and the NIXL agent (the worker is exiting)."""
        self.close()
        self.nixl.close()

    # ------------------------------------------------------------ internals
    def _new_pair(self, data_endpoint: str, rank: str, rank_offer: DataPlaneOffer | None) -> _Pair:
        choice = choose_plane(self.offer, rank_offer)
        if choice.refused:
            log.error("worker %s: data plane to rank %s refused: %s; its requests fail", self.worker, rank, choice.reason)
        else:
            log.info("worker %s: data plane to rank %s: %s (%s)", self.worker, rank, choice.plane, choice.reason)
        pair = _Pair(data_endpoint, rank, choice, state="frames" if choice.plane == "frames" else "down")
        with self._lock:
            self._pairs[data_endpoint] = pair
        return pair

    def _open(self, pair: _Pair) -> None:
        if pair.choice.plane == "nixl":
            self._open_nixl(pair)
            return
        generation = self._next_generation
        host = local_address_towards(pair.data_endpoint)
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
        if not self._send(pair.data_endpoint, pack(message)):
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

    def _open_nixl(self, pair: _Pair) -> None:
        try:
            agent = self.nixl.name
        except NixlError as exc:
            self._backoff(pair, str(exc))
            return
        generation = self._next_generation
        message = NixlOpen(worker=self.worker, generation=generation, agent=agent, timeout_s=self.timeout_s, reason=pair.choice.reason[:512])
        if not self._send(pair.data_endpoint, pack(message)):
            return  # the rank's link is busy or not up yet: try again with the next answer
        self._next_generation += 1
        pair.generation, pair.state, pair.opening_until = generation, "opening", time.monotonic() + self.timeout_s
        log.info("worker %s: opening nixl pair %d with rank %s", self.worker, generation, pair.rank)

    def _check_opening(self, pair: _Pair) -> None:
        if pair.choice.plane == "nixl":
            if time.monotonic() > pair.opening_until:
                self._tear_down(pair, f"the rank did not answer nixl_open within {self.timeout_s:.0f} s", tell_rank=True)
            return
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
            self._send(pair.data_endpoint, pack(PairClose(worker=self.worker, generation=pair.generation, reason=reason[:512])))
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
        if pair.nixl is not None:
            pair.nixl.sender.disconnect(pair.nixl.remote_agent)  # the rank's agent is dropped with its pair
            log.info("worker %s: dropped the NIXL agent of rank %s", pair.nixl.sender.worker, pair.rank)
        pair.nixl, pair.grants = None, {}
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
