"""Delivering one answer (a result or a failure) to one rank; the outcome says what became of it.

A result goes on the plane chosen for that pair (dataplane/worker_pairs.py): frames on the rank's direct socket
(dataplane/frames/worker.py), or the pair's ready plane carries it (dataplane/worker_plane.py: a header on the socket and the tensors on
the pair's own torch.distributed group, dataplane/pair_group/worker.py, or written into a slot the rank granted,
dataplane/nixl/worker.py). A pair that fails is torn down and the answer goes again as frames. A failure always goes as frames.

Every wait is bounded. A send is tried until the rank takes it, the broker reports the rank gone (the broker
link counts each ``forget_ranks``: one that arrives mid-delivery ends the wait at once, before the compute loop
files it), the rank was never reached within --connect-timeout (it is not tried again), it took nothing for
--send-timeout, or, once the worker is stopping, for --drain-timeout. An answer over --transfer-chunk-bytes goes in
pieces, each with a wait of its own: a transfer that keeps moving is never given up, one that stops is (the broker
sends its request again, once). A nixl grant is awaited at most
--pair-timeout, and at most ``ARENAS`` nixl writes are in flight (a staged answer's arena must be free again:
dataplane/nixl/worker.py, worker_writes.py).

Called from the worker's compute loop only, except ``links``/``pairs`` (the heartbeat thread). The worker opens
the sockets and planes and hands them over; it turns each outcome into its ``done`` for the broker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from draftfeed.consumers.settings import WorkerSettings
from draftfeed.dataplane.digests import digests
from draftfeed.dataplane.frames.codec import pack_tensors, tensor_bytes
from draftfeed.dataplane.frames.worker import RankLinks, SendResult
from draftfeed.dataplane.frames.worker_chunks import ChunkedResult
from draftfeed.dataplane.worker_pairs import PairPlanes, PlaneRefused
from draftfeed.dataplane.worker_plane import OutgoingAnswer
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import DATA_OUTBOUND, Dispatch, Failure, NonFiniteAt, PairClose, PairStatus, Result

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

    why: SendResult

    @property
    def rank_unreachable(self) -> bool:
        return self.why is SendResult.UNREACHABLE


@dataclass(frozen=True)
class Refused:
    """The result was not sent and never can be: the plane this pair was made to use cannot be had, or the answer
    is over the rank's max_result_bytes. ``message`` says why, for the failure the rank is sent instead."""

    message: str


Outcome = Delivered | Undelivered | Refused


class AnswerDelivery:
    """Delivers answers to ranks for one worker: owns the rank links and the pair planes."""

    def __init__(
        self,
        worker: str,
        settings: WorkerSettings,
        ranks: RankLinks,
        planes: PairPlanes,
        forgets: Callable[[str], int],
        stopping_since: Callable[[], float | None],
    ) -> None:
        """``forgets``: the broker link's count of ``forget_ranks`` per data_endpoint; ``stopping_since``: when the worker
        was told to stop (time.monotonic), None while it serves."""
        self.worker = worker
        self.settings = settings
        self.ranks = ranks
        self.planes = planes
        self._forgets = forgets
        self._stopping_since = stopping_since

    # ------------------------------------------------------------ the worker's view
    @property
    def writing(self) -> int:
        """How many nixl writes are in flight (the compute loop checks on them every millisecond meanwhile)."""
        return self.planes.in_flight

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
        """Let every nixl write land (each is bounded by --pair-timeout), then shut the planes and links down; what a
        link still holds for its rank goes out for up to --drain-timeout."""
        self.planes.shut_down()
        self.ranks.close(linger_s=self.settings.drain_timeout_s)

    # ------------------------------------------------------------ one answer
    def forgets(self, data_endpoint: str) -> int:
        """How many ``forget_ranks`` for the rank at ``data_endpoint`` the link has passed on so far."""
        return self._forgets(data_endpoint)

    def result(self, dispatch: Dispatch, tensors: dict[str, torch.Tensor], since: int, target_version: int = 0) -> Outcome:
        """Send a result on the pair's plane when it has a ready one, else (or when that fails) as frames. ``since``:
        ``forgets(data_endpoint)`` when the request was filed; a ``forget_ranks`` after that, also one that came while
        the request was computed, ends every wait of this delivery at once. ``target_version``: the version of the
        target's weights that computed it, which the result says."""
        request, data_endpoint = dispatch.request, dispatch.data_endpoint
        too_big = _over_limit(tensors, dispatch.max_result_bytes)
        if too_big is not None:
            return Refused(too_big)
        fields: dict[str, Any] = dict(request_id=request.request_id, token=request.token, kind=request.kind, worker=self.worker)
        if target_version:
            fields["target_version"] = target_version
        if self.settings.checksum:
            fields["digests"] = digests(tensors)
        try:
            plane = self.planes.plane_for(data_endpoint, dispatch.rank, dispatch.data_plane)
        except PlaneRefused as exc:
            return Refused(f"the data plane asked for cannot be had: {exc}; use data_plane='auto' (frames where a pair group cannot be had)")
        nbytes = tensor_bytes(tensors)
        if plane is not None:
            answer = OutgoingAnswer(
                tensors,
                fields,
                dispatch.rank,
                send=lambda frames: self._send(data_endpoint, frames, since),
                gone=lambda: self._forgets(data_endpoint) != since,
                take_from_ranks=self.take_from_ranks,
                await_rank=lambda ms: self.ranks.socket(data_endpoint).poll(ms, zmq.POLLIN),
                chunk_bytes=self.settings.transfer_chunk_bytes,
            )
            delivery = plane.deliver(answer)
            if delivery is SendResult.SENT:
                self.planes.sent(data_endpoint)
            if delivery is not None:
                return _outcome(delivery, plane.name, nbytes)
        return _outcome(self._send_frames(data_endpoint, tensors, fields, since), "frames", nbytes)

    def failure(self, dispatch: Dispatch, message: str, nonfinite: NonFiniteAt | None = None) -> Outcome:
        """Tell the rank why its request could not be served (as frames)."""
        request = dispatch.request
        failure = Failure(request_id=request.request_id, token=request.token, worker=self.worker, message=message, nonfinite=nonfinite)
        return _outcome(self._send(dispatch.data_endpoint, pack(failure)), "frames", 0)

    def _send_frames(self, data_endpoint: str, tensors: dict[str, torch.Tensor], fields: dict[str, Any], since: int) -> SendResult:
        """A result as frames: in one message up to --transfer-chunk-bytes, else its header and then each piece
        (dataplane/frames/worker_chunks.py). Each message has its own wait, so an answer that keeps moving is never
        given up, however long it takes; one that stops for --send-timeout is (STALLED)."""
        chunk_bytes = self.settings.transfer_chunk_bytes
        if tensor_bytes(tensors) <= chunk_bytes:
            return self._send(data_endpoint, pack_tensors(Result, tensors, **fields), since)
        answer = ChunkedResult(tensors, chunk_bytes, **fields)
        sent = self._send(data_endpoint, answer.header, since)
        for piece in answer.pieces():
            if sent is not SendResult.SENT:
                break
            sent = self._send(data_endpoint, piece, since)
        return sent

    # ------------------------------------------------------------ waits
    def finish_writes(self, block: bool) -> None:
        """Check on the nixl writes in flight, oldest first, dropping those that have landed (``block``: wait for the
        oldest). One that failed takes its pair down (``pair_close``): the rank gives up on its answer and asks
        again, and the pair is rebuilt after the backoff."""
        self.planes.finish(block)

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
            else:
                self.planes.receive(data_endpoint, message, extra)

    def _send(self, data_endpoint: str, frames: list[Any], since: int | None = None) -> SendResult:
        """Send to a rank, trying until it takes the message, the broker reports it gone (the link counts its
        ``forget_ranks``; ``since``: the count when this delivery began, default now), it was never reached within
        connect_timeout, or it took nothing for send_timeout (drain_timeout once stopping)."""
        started = time.monotonic()
        forgets = self._forgets(data_endpoint) if since is None else since
        while True:
            delivery = self.ranks.try_send(data_endpoint, frames)
            if delivery is not SendResult.BLOCKED:
                return delivery
            if self._forgets(data_endpoint) != forgets:
                return SendResult.FORGOTTEN  # the forget_ranks itself is filed next, with the rest of the link's messages
            waited = time.monotonic() - started
            if not self.ranks.ever_sent(data_endpoint) and waited > self.settings.connect_timeout_s:
                # Never reached: a wrong or firewalled data data_endpoint. Fail fast for it from now on.
                log.error("worker %s: cannot reach rank data data_endpoint %s within %.0f s; not trying it again", self.worker, data_endpoint, waited)
                self.forget(data_endpoint)
                return SendResult.UNREACHABLE
            stopping_since = self._stopping_since()
            if stopping_since is not None and time.monotonic() - max(started, stopping_since) > self.settings.drain_timeout_s:
                log.error(
                    "worker %s: stopping, and rank at %s took nothing for %.0f s (--drain-timeout): giving up on it",
                    self.worker,
                    data_endpoint,
                    waited,
                )
                return SendResult.STALLED
            if waited > self.settings.send_timeout_s:
                log.error("worker %s: rank at %s took nothing for %.0f s; dropping its link", self.worker, data_endpoint, waited)
                self.planes.forget(data_endpoint)
                self.ranks.drop(data_endpoint)
                return SendResult.STALLED
            self.ranks.socket(data_endpoint).poll(100, zmq.POLLOUT)


def _outcome(delivery: SendResult, plane: str, nbytes: int) -> Outcome:
    return Delivered(plane, nbytes) if delivery is SendResult.SENT else Undelivered(delivery)


def _over_limit(tensors: dict[str, torch.Tensor], limit: int | None) -> str | None:
    """Why an answer is too big for its rank (``max_result_bytes`` from its hello), or None."""
    size = tensor_bytes(tensors)
    if limit is None or size <= limit:
        return None
    return (
        f"the answer is {size} bytes, over this rank's max_result_bytes of {limit}: "
        "raise max_result_bytes on the remote target, or send smaller batches"
    )
