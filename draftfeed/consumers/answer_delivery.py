"""Delivering one answer (a result or a failure) to one rank; the outcome says what became of it.

A result goes on the plane chosen for that pair (pair_planes.py): frames on the rank's direct socket
(rank_links.py), or a header on the socket and the tensors on the pair's own torch.distributed group, or (nixl)
a header on the socket after the tensors were written into a slot the rank granted (nixl_senders.py). A pair
that fails is torn down and the answer goes again as frames. A failure always goes as frames.

Every wait is bounded. A send is tried until the rank takes it, the broker reports the rank gone (the broker
link counts each ``forget_rank``: one that arrives mid-delivery ends the wait at once, before the compute loop
files it), the rank was never reached within --connect-timeout (it is not tried again), it took nothing for
--send-timeout, or, once the worker is stopping, --drain-timeout has passed. A nixl grant is awaited at most
--pair-timeout, and at most ``ARENAS`` nixl writes are in flight (a staged answer's arena must be free again).

Called from the worker's compute loop only, except ``links``/``pairs`` (the heartbeat thread). The worker opens
the sockets and planes and hands them over; it turns each outcome into its ``done`` for the broker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from draftfeed.consumers.config import WorkerConfig
from draftfeed.consumers.nixl_senders import ARENAS, Write
from draftfeed.consumers.pair_planes import NixlLink, PairPlanes, PlaneRefused
from draftfeed.consumers.rank_links import Delivery, RankLinks
from draftfeed.dataplane.nixl.layout import notification as nixl_notification
from draftfeed.dataplane.nixl.layout import packed_layout
from draftfeed.dataplane.nixl.memory import Region
from draftfeed.dataplane.nixl.transport import NixlError
from draftfeed.dataplane.pair_group import DataPlaneError, PairGroup, describe
from draftfeed.dataplane.tensor_codec import pack_tensors, tensor_bytes
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    DATA_OUTBOUND,
    Dispatch,
    Failure,
    NixlGrant,
    NixlReady,
    NixlWant,
    PairClose,
    PairStatus,
    Result,
)

log = logging.getLogger("draftfeed.worker")


@dataclass(frozen=True)
class Delivered:
    """The rank took the answer: ``plane`` carried it (frames, nixl, or a pair group's backend: gloo, nccl);
    ``nbytes``: the answer's tensor bytes (0 for a failure)."""

    plane: str
    nbytes: int


@dataclass(frozen=True)
class Undelivered:
    """The rank never took the answer. ``why``: FORGOTTEN (the broker reported the rank gone), UNREACHABLE (its
    data socket never answered within --connect-timeout) or STALLED (it took nothing for --send-timeout, or
    for --drain-timeout once the worker is stopping)."""

    why: Delivery

    @property
    def rank_unreachable(self) -> bool:
        return self.why is Delivery.UNREACHABLE


@dataclass(frozen=True)
class Refused:
    """The result was not sent and never can be: the plane this pair was made to use cannot be had, or the answer
    is over the rank's max_result_bytes. ``message`` says why, for the failure the rank is sent instead."""

    message: str


Outcome = Delivered | Undelivered | Refused


class AnswerDelivery:
    """Delivers answers to ranks for one worker: owns the rank links, the pair planes and the nixl writes in flight."""

    def __init__(
        self,
        worker: str,
        config: WorkerConfig,
        ranks: RankLinks,
        planes: PairPlanes,
        forgets: Callable[[str], int],
        stopping_since: Callable[[], float | None],
    ) -> None:
        """``forgets``: the broker link's count of ``forget_rank`` per data_endpoint; ``stopping_since``: when the worker
        was told to stop (time.monotonic), None while it serves."""
        self.worker = worker
        self.config = config
        self.ranks = ranks
        self.planes = planes
        self._forgets = forgets
        self._stopping_since = stopping_since
        # The nixl writes in flight, oldest first, with their ranks' endpoints: at most one per staging arena.
        self._writing: deque[tuple[Write, str]] = deque()

    # ------------------------------------------------------------ the worker's view
    @property
    def writing(self) -> int:
        """How many nixl writes are in flight (the compute loop checks on them every millisecond meanwhile)."""
        return len(self._writing)

    def links(self) -> int:
        return len(self.ranks)

    def pairs(self) -> list[PairStatus]:
        return self.planes.statuses()

    def remember(self, data_endpoint: str, key: str | None) -> None:
        """The broker dispatched for this rank: see RankLinks.remember."""
        self.ranks.remember(data_endpoint, key)

    def forget(self, data_endpoint: str) -> None:
        """The rank is gone (or never reachable): release its pair and close its link for good."""
        self.planes.forget(data_endpoint)
        self.ranks.forget(data_endpoint)

    def reset(self) -> None:
        """The broker forgot this worker and told the ranks so: they closed their sides of every pair."""
        self.planes.close()

    def close(self) -> None:
        """Let every nixl write land (each is bounded by --pair-timeout), then shut the planes and links down."""
        while self._writing:
            self.finish_writes(block=True)
        self.planes.shut_down()
        self.ranks.close()

    # ------------------------------------------------------------ one answer
    def result(self, dispatch: Dispatch, tensors: dict[str, torch.Tensor]) -> Outcome:
        """Send a result on the pair's plane when it has a ready one, else (or when that fails) as frames."""
        request, data_endpoint = dispatch.request, dispatch.data_endpoint
        since = self._forgets(data_endpoint)  # a forget_rank from now on ends every wait of this delivery
        too_big = _over_limit(tensors, dispatch.max_result_bytes)
        if too_big is not None:
            return Refused(too_big)
        fields = dict(request_id=request.request_id, token=request.token, kind=request.kind, worker=self.worker)
        try:
            pair = self.planes.group_for(data_endpoint, dispatch.rank, dispatch.data_plane)
        except PlaneRefused as exc:
            return Refused(f"the data plane asked for cannot be had: {exc}; use data_plane='auto' (frames where a pair group cannot be had)")
        nbytes = tensor_bytes(tensors)
        if pair is not None and isinstance(pair[0], NixlLink):
            delivery = self._on_nixl(dispatch, tensors, pair[0], pair[1], fields, since)
            if delivery is not None:
                return _outcome(delivery, "nixl", nbytes)
        elif pair is not None and isinstance(pair[0], PairGroup):
            group, generation = pair
            delivery = self._on_group(dispatch, tensors, group, generation, fields, since)
            if delivery is not None:
                return _outcome(delivery, group.backend, nbytes)
        return _outcome(self._send(data_endpoint, pack_tensors(Result, tensors, **fields), since), "frames", nbytes)

    def failure(self, dispatch: Dispatch, message: str) -> Outcome:
        """Tell the rank why its request could not be served (as frames)."""
        request = dispatch.request
        failure = Failure(request_id=request.request_id, token=request.token, worker=self.worker, message=message)
        return _outcome(self._send(dispatch.data_endpoint, pack(failure)), "frames", 0)

    def _on_group(
        self, dispatch: Dispatch, tensors: dict[str, torch.Tensor], group: PairGroup, generation: int, fields: dict, since: int
    ) -> Delivery | None:
        """The header on the socket, then the tensors on the pair's group; None: the group failed and was torn down
        (the rank drops what it got), send it as frames."""
        data_endpoint = dispatch.data_endpoint
        delivery = self._send(data_endpoint, pack(Result(tensors=describe(tensors), plane="pair", generation=generation, **fields)), since)
        if delivery is not Delivery.SENT:
            return delivery  # the rank is gone or unreachable: _send has released its pair
        try:
            group.send(tensors)
            self.planes.sent(data_endpoint)
            return Delivery.SENT
        except DataPlaneError as exc:
            self.planes.failed(data_endpoint, str(exc))  # the rank drops what it got; frames follow
        except Exception as exc:  # e.g. a device error copying the tensors: the group is out of step too
            log.exception("worker %s: sending on the pair group to %s failed", self.worker, dispatch.rank)
            group.close()
            self.planes.failed(data_endpoint, f"{type(exc).__name__}: {exc}")
        return None

    def _on_nixl(
        self, dispatch: Dispatch, tensors: dict[str, torch.Tensor], link: NixlLink, generation: int, fields: dict, since: int
    ) -> Delivery | None:
        """Ask the rank for a slot, write the answer into it, then send the header; None: send it as frames (no slot
        was granted, or the pair failed and was torn down)."""
        data_endpoint = dispatch.data_endpoint
        specs = describe(tensors)
        offsets, total = packed_layout(specs)
        if total < max(1, self.config.nixl_min_bytes):
            return None
        want = self.planes.next_want()
        delivery = self._send(data_endpoint, pack(NixlWant(worker=self.worker, generation=generation, want=want, nbytes=total)), since)
        if delivery is not Delivery.SENT:
            return delivery
        grant = self._await_grant(data_endpoint, generation, want, since)
        if grant is None:
            return None
        if grant.refused is not None:
            log.debug("worker %s: rank %s granted no slot (%s); this answer goes as frames", self.worker, dispatch.rank, grant.refused)
            return None
        while len(self._writing) >= ARENAS:  # at most ARENAS in flight; a staged answer's arena must be free again
            self.finish_writes(block=True)
        if not self.planes.is_ready(data_endpoint, generation):
            return None  # an earlier write failed and took this pair down
        forgets = self._forgets
        try:
            source = link.sender.prepare(tensors, offsets, total)
            slot = Region(grant.address, total, grant.device, "VRAM" if link.memory == "VRAM" else "DRAM")
            notification = nixl_notification(generation, grant.slot, want)
            gone = lambda: forgets(data_endpoint) != since  # noqa: E731
            self._writing.append((link.sender.post(source, slot, link.remote_agent, notification, self.config.pair_timeout_s, gone), data_endpoint))
        except (NixlError, RuntimeError) as exc:
            self.planes.failed(data_endpoint, str(exc))
            while self._writing:  # the arenas' turn may be out of step with the writes now: let every write land first
                self.finish_writes(block=True)
            return None
        # The header goes now; the rank uses the slot only once the write's notification is there too.
        delivery = self._send(data_endpoint, pack(Result(tensors=specs, plane="nixl", generation=generation, slot=grant.slot, **fields)), since)
        if delivery is Delivery.SENT:
            self.planes.sent(data_endpoint)
        return delivery

    # ------------------------------------------------------------ waits
    def finish_writes(self, block: bool) -> None:
        """Check on the nixl writes in flight, oldest first, dropping those that have landed (``block``: wait for the
        oldest). One that failed takes its pair down (``pair_close``): the rank gives up on its answer and asks
        again, and the pair is rebuilt after the backoff."""
        while self._writing:
            write, data_endpoint = self._writing[0]
            try:
                if block:
                    write.wait()
                elif not write.done():
                    return
            except NixlError as exc:
                self.planes.failed(data_endpoint, str(exc))
            self._writing.popleft()
            if block:
                return

    def take_from_ranks(self) -> None:
        """What ranks sent back on the data links: a rank that tore its side of a pair down, a nixl pair's
        readiness, a nixl grant."""
        for data_endpoint, frames in self.ranks.incoming():
            try:
                message, extra = unpack(frames, DATA_OUTBOUND)
            except MalformedMessage as exc:
                log.warning("worker %s: ignoring a malformed message from rank %s: %s", self.worker, data_endpoint, exc)
                continue
            if isinstance(message, PairClose):
                self.planes.rank_closed(data_endpoint, message)
            elif isinstance(message, NixlReady):
                self.planes.nixl_ready(data_endpoint, message, extra)
            elif isinstance(message, NixlGrant):
                self.planes.granted(data_endpoint, message, extra)

    def _await_grant(self, data_endpoint: str, generation: int, want: int, since: int) -> NixlGrant | None:
        """The rank's grant for ``want``, or None when the pair closes, the rank is gone, or --pair-timeout passes
        (the pair is then torn down: a grant that comes later is never written to)."""
        deadline = time.monotonic() + self.config.pair_timeout_s
        while True:
            self.take_from_ranks()
            grant = self.planes.take_grant(data_endpoint, generation, want)
            if grant is not None:
                return grant
            if not self.planes.is_ready(data_endpoint, generation) or self._forgets(data_endpoint) != since:
                return None
            if time.monotonic() > deadline:
                self.planes.failed(data_endpoint, f"no nixl_grant within {self.config.pair_timeout_s:.0f} s")
                return None
            # Writes in flight are checked every millisecond meanwhile: checking moves them on (over TCP above all).
            self.finish_writes(block=False)
            self.ranks.socket(data_endpoint).poll(1 if self._writing else 50, zmq.POLLIN)

    def _send(self, data_endpoint: str, frames: list[Any], since: int | None = None) -> Delivery:
        """Send to a rank, trying until it takes the message, the broker reports it gone (the link counts its
        ``forget_rank``; ``since``: the count when this delivery began, default now), it was never reached within
        connect_timeout, or it took nothing for send_timeout (drain_timeout once stopping)."""
        started = time.monotonic()
        forgets = self._forgets(data_endpoint) if since is None else since
        while True:
            delivery = self.ranks.try_send(data_endpoint, frames)
            if delivery is not Delivery.BLOCKED:
                return delivery
            if self._forgets(data_endpoint) != forgets:
                return Delivery.FORGOTTEN  # the forget_rank itself is filed next, with the rest of the link's messages
            waited = time.monotonic() - started
            if not self.ranks.ever_sent(data_endpoint) and waited > self.config.connect_timeout_s:
                # Never reached: a wrong or firewalled data data_endpoint. Fail fast for it from now on.
                log.error("worker %s: cannot reach rank data data_endpoint %s within %.0f s; not trying it again", self.worker, data_endpoint, waited)
                self.forget(data_endpoint)
                return Delivery.UNREACHABLE
            stopping_since = self._stopping_since()
            if stopping_since is not None and time.monotonic() - stopping_since > self.config.drain_timeout_s:
                log.error(
                    "worker %s: stopping, and rank at %s took nothing for %.0f s (--drain-timeout): giving up on it",
                    self.worker,
                    data_endpoint,
                    waited,
                )
                return Delivery.STALLED
            if waited > self.config.send_timeout_s:
                log.error("worker %s: rank at %s took nothing for %.0f s; dropping its link", self.worker, data_endpoint, waited)
                self.planes.forget(data_endpoint)
                self.ranks.drop(data_endpoint)
                return Delivery.STALLED
            self.ranks.socket(data_endpoint).poll(100, zmq.POLLOUT)


def _outcome(delivery: Delivery, plane: str, nbytes: int) -> Outcome:
    return Delivered(plane, nbytes) if delivery is Delivery.SENT else Undelivered(delivery)


def _over_limit(tensors: dict[str, torch.Tensor], limit: int | None) -> str | None:
    """Why an answer is too big for its rank (``max_result_bytes`` from its hello), or None."""
    size = tensor_bytes(tensors)
    if limit is None or size <= limit:
        return None
    return (
        f"the answer is {size} bytes, over this rank's max_result_bytes of {limit}: "
        "raise max_result_bytes on the remote target, or send smaller batches"
    )
