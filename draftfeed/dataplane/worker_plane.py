"""One pair's plane on the worker, whatever carries it: the interface ``PairGroupPlane`` (dataplane/pair_group/worker.py) and
``NixlPlane`` (dataplane/nixl/worker.py) both have, which PairPlanes (dataplane/worker_pairs.py) and AnswerDelivery (answer_delivery.py)
use without asking which it is.

A plane object is one generation of one pair: made when the pair opens, never used again once it fails or closes (a
send that failed part way leaves the two sides out of step); the pair's next try is a new object under the next
generation. Its life:

- ``open()`` sends its open message to the rank (``pair_open`` or ``nixl_open``) and starts its side;
- ``check()`` while it opens, and ``receive()`` for what the rank sends back on the data link, move it to ready;
- ``deliver()`` carries one answer: a header on the rank's data socket and the tensors on the plane;
- ``close()`` releases what it holds.

Failures while it opens are raised (``PlaneFailed``: the pair is torn down, the rank told, a new one opened after
the backoff); a failure delivering an answer, now or once a write in flight ends, is reported through the ``failed``
callback the plane was made with (the pair counts a fallback and is torn down the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from draftfeed.dataplane.frames.worker import SendResult
from draftfeed.schemas.messages import NixlGrant, NixlReady

PlaneState = Literal["opening", "ready", "closed"]
# What a rank sends back on its data link for a pair's plane (its pair_close is the pair's, not the plane's).
FromRank = NixlReady | NixlGrant


class PlaneFailed(Exception):
    """The plane could not open, or failed while opening: the reason, for the log and the rank's pair_close."""


@dataclass(frozen=True)
class OutgoingAnswer:
    """One result on its way to a rank, as a plane delivers it, with the delivery's bounded waits."""

    tensors: dict[str, torch.Tensor]
    fields: dict[str, Any]  # the result header's fields: request id, token, kind, worker
    rank: str
    send: Callable[[list[Any]], SendResult]  # to the rank's data socket, until it takes it or the delivery's bounds pass
    gone: Callable[[], bool]  # whether the broker reported the rank gone since the delivery began
    take_from_ranks: Callable[[], None]  # file what ranks sent back (grants, readiness, closes) with their planes
    await_rank: Callable[[int], None]  # wait up to so many milliseconds for this rank to send something back
    chunk_bytes: int  # the pieces a plane that moves the tensors itself sends them in (--transfer-chunk-bytes)


class PairPlane(Protocol):
    """One generation of one pair's plane (see the module's docstring)."""

    name: str  # what carried an answer, as Delivered says: gloo, nccl or nixl
    generation: int
    state: PlaneState

    def open(self) -> bool:
        """Send the open message and start this side; False: the rank's link took nothing (try again with the next
        answer). Raises PlaneFailed when it cannot open here."""
        ...

    def check(self) -> None:
        """While opening: move on to ready when this side is up; raises PlaneFailed when it cannot be."""
        ...

    def receive(self, message: FromRank, frames: list[Any]) -> None:
        """A message of this generation from the rank; raises PlaneFailed when it makes the plane unusable."""
        ...

    def deliver(self, answer: OutgoingAnswer) -> SendResult | None:
        """Carry the answer when ready: what became of it, or None to send it as frames (the plane declined it, or
        failed and reported so)."""
        ...

    def close(self) -> None:
        """Release what the plane holds; it is never used again."""
        ...
