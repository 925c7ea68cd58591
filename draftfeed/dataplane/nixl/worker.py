"""A nixl pair as the worker's plane to one rank: one generation, from ``nixl_open`` to its close, and the delivery of
one answer on it (docs/data-planes.md, "The nixl plane"; the rank's side is dataplane/nixl/rank.py):

    worker -> rank   nixl_open    generation, the worker's agent name
    rank -> worker   nixl_ready   + one frame: the rank's agent metadata, loaded here
    worker -> rank   nixl_want    room for an answer of n bytes
    rank -> worker   nixl_grant   a slot (address, bytes, device), or refused: that answer goes as frames
    worker ~> rank   NIXL write into the slot, then the notification "generation:slot:want"
    worker -> rank   result       plane nixl, the slot, the tensors' specs

The worker's agent, where an answer is written from and the writes in flight are the worker's, shared by all its
pairs (worker_writes.py). A grant is awaited at most the pair's timeout; a write that cannot start, or fails in
flight, is reported (``failed``) and the plane is never used again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from draftfeed.dataplane.frames.worker import SendResult
from draftfeed.dataplane.nixl.layout import notification, packed_layout
from draftfeed.dataplane.nixl.memory import MemoryKind, Region
from draftfeed.dataplane.nixl.transport import NixlError
from draftfeed.dataplane.nixl.worker_writes import NixlSender
from draftfeed.dataplane.pair_group.transport import describe
from draftfeed.dataplane.worker_plane import FromRank, OutgoingAnswer, PlaneFailed, PlaneState
from draftfeed.schemas.frames import frame_bytes, pack
from draftfeed.schemas.messages import NixlGrant, NixlOpen, NixlReady, NixlWant, Result

log = logging.getLogger("draftfeed.worker")


class NixlPlane:
    """One generation of a nixl pair with one rank. Called from the worker's compute thread."""

    name = "nixl"

    def __init__(
        self,
        worker: str,
        rank: str,
        generation: int,
        reason: str,
        timeout_s: float,
        min_bytes: int,
        sender: NixlSender,
        send: Callable[[list[Any]], bool],
        failed: Callable[[str], None],
    ) -> None:
        """``min_bytes``: smaller answers go as frames; ``send``: a control message to the rank, without blocking
        (whether it went out); ``failed``: the pair's report of a failed write (tear down, a new pair after the
        backoff)."""
        self.worker, self.rank, self.generation, self.reason = worker, rank, generation, reason
        self.timeout_s, self.min_bytes, self.sender = timeout_s, min_bytes, sender
        self._send, self._failed = send, failed
        self.state: PlaneState = "opening"
        self._opening_until = 0.0  # the rank's nixl_ready must come before this
        self.remote_agent: str | None = None  # the rank's agent, once its metadata is loaded
        self.memory: MemoryKind = "DRAM"  # the rank's slots: DRAM or VRAM
        self._grants: dict[int, NixlGrant] = {}  # want -> the rank's grant, until its answer takes it

    def open(self) -> bool:
        try:
            agent = self.sender.name
        except NixlError as exc:
            raise PlaneFailed(str(exc)) from exc
        message = NixlOpen(worker=self.worker, generation=self.generation, agent=agent, timeout_s=self.timeout_s, reason=self.reason[:512])
        if not self._send(pack(message)):
            return False  # the rank's link is busy or not up yet: try again with the next answer
        self._opening_until = time.monotonic() + self.timeout_s
        log.info("worker %s: opening nixl pair %d with rank %s", self.worker, self.generation, self.rank)
        return True

    def check(self) -> None:
        if time.monotonic() > self._opening_until:
            raise PlaneFailed(f"the rank did not answer nixl_open within {self.timeout_s:.0f} s")

    def receive(self, message: FromRank, frames: list[Any]) -> None:
        if isinstance(message, NixlReady):
            self._ready(message, frames)
        elif isinstance(message, NixlGrant):
            self._granted(message, frames)

    def _ready(self, message: NixlReady, frames: list[Any]) -> None:
        """The rank's side is up: load its agent metadata."""
        if self.state != "opening":
            return
        try:
            if len(frames) != 1:
                raise NixlError(f"nixl_ready carries {len(frames)} frames, not the one of agent metadata")
            name = self.sender.connect(frame_bytes(frames[0]))
        except NixlError as exc:
            raise PlaneFailed(f"the rank's agent could not be loaded: {exc}") from exc
        if name != message.agent:
            self.sender.disconnect(name)
            raise PlaneFailed(f"the rank's agent metadata names {name!r}, not {message.agent!r}")
        self.remote_agent, self.memory, self.state = name, "VRAM" if message.memory == "VRAM" else "DRAM", "ready"
        log.info("worker %s: nixl pair %d with rank %s is ready (its slots in %s)", self.worker, self.generation, self.rank, message.memory)

    def _granted(self, message: NixlGrant, frames: list[Any]) -> None:
        """A grant; with one frame, the metadata of a slot the rank registered since this pair opened: loaded now."""
        if self.state != "ready":
            return
        if frames:
            try:
                self.sender.connect(frame_bytes(frames[0]))
            except NixlError as exc:
                raise PlaneFailed(f"a new slot's metadata could not be loaded: {exc}") from exc
        self._grants[message.want] = message

    def deliver(self, answer: OutgoingAnswer) -> SendResult | None:
        """Ask the rank for a slot, write the answer into it, then send the header; None: send it as frames (too small,
        no slot was granted, or the pair failed and was torn down)."""
        specs = describe(answer.tensors)
        offsets, total = packed_layout(specs)
        if total < max(1, self.min_bytes) or self.remote_agent is None:
            return None
        want = self.sender.next_want()
        delivery = answer.send(pack(NixlWant(worker=self.worker, generation=self.generation, want=want, nbytes=total)))
        if delivery is not SendResult.SENT:
            return delivery
        grant = self._await_grant(want, answer)
        if grant is None:
            return None
        if grant.refused is not None:
            log.debug("worker %s: rank %s granted no slot (%s); this answer goes as frames", self.worker, self.rank, grant.refused)
            return None
        self.sender.make_room()
        if self.state != "ready":
            return None  # an earlier write failed and took this pair down
        try:
            source = self.sender.prepare(answer.tensors, offsets, total)
            slot = Region(grant.address, total, grant.device, self.memory)
            note = notification(self.generation, grant.slot, want)
            self.sender.start(source, slot, self.remote_agent, note, self.timeout_s, answer.gone, self._failed)
        except (NixlError, RuntimeError) as exc:
            self._failed(str(exc))
            self.sender.drain()  # the arenas' turn may be out of step with the writes now: let every write land first
            return None
        # The header goes now; the rank uses the slot only once the write's notification is there too.
        return answer.send(pack(Result(tensors=specs, plane="nixl", generation=self.generation, slot=grant.slot, **answer.fields)))

    def _await_grant(self, want: int, answer: OutgoingAnswer) -> NixlGrant | None:
        """The rank's grant for ``want``, or None when the pair closes, the rank is gone, or the timeout passes (the
        pair is then torn down: a grant that comes later is never written to)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            answer.take_from_ranks()
            grant = self._grants.pop(want, None)
            if grant is not None:
                return grant
            if self.state != "ready" or answer.gone():
                return None
            if time.monotonic() > deadline:
                self._failed(f"no nixl_grant within {self.timeout_s:.0f} s")
                return None
            # Writes in flight are checked every millisecond meanwhile: checking moves them on (over TCP above all).
            self.sender.finish_writes(block=False)
            answer.await_rank(1 if self.sender.writing else 50)

    def close(self) -> None:
        self.state = "closed"
        if self.remote_agent is not None:
            self.sender.disconnect(self.remote_agent)  # the rank's agent is dropped with its pair
            log.info("worker %s: dropped the NIXL agent of rank %s", self.worker, self.rank)
        self.remote_agent, self._grants = None, {}
