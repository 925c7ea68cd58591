"""The messages between a worker and the broker's backend: registration, done, computing, heartbeats and draining one
way; registered, dispatches, vocab mappings and departures the other.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, model_validator
from typing_extensions import Self

from draftfeed.schemas.messages.common import (
    DEFAULT_SUPERVISION,
    TASK_FORMS,
    DataPlaneOffer,
    Generation,
    Liveness,
    LogitTransform,
    MappingDigest,
    Name,
    PublicKey,
    Strict,
    SupervisionForm,
    TargetVersion,
    TaskName,
    TensorSpec,
)
from draftfeed.schemas.messages.ranks import Hello, Submit
from draftfeed.schemas.messages.target_info import TargetInfo
from draftfeed.schemas.protocol import MAX_NOTICES, PAIRS_PER_BEAT


class Register(Strict):
    type: Literal["register"] = "register"
    worker: Name
    service: Name
    task: TaskName
    engine: Name
    info: TargetInfo
    supervision: SupervisionForm = DEFAULT_SUPERVISION
    logit_transform: LogitTransform = Field(default_factory=LogitTransform)
    capacity: Annotated[int, Field(ge=1, le=64)]
    host: Name
    pid: Annotated[int, Field(ge=0)]
    # The longest row this worker takes (its target's max_position_embeddings, or less); None: no limit known.
    max_positions: Annotated[int, Field(gt=0)] | None = None
    # One worker is one replica of the target, spread over this many devices (one process each; docs/engines.md).
    tensor_parallel: Annotated[int, Field(ge=1, le=4096)] = 1
    devices: Annotated[list[Name], Field(max_length=4096)] = []
    # The version of the target's weights it serves (--target-version), and where they came from (the checkpoint).
    target_version: TargetVersion = 0
    checkpoint: Annotated[str, Field(max_length=4096)] | None = None

    @model_validator(mode="after")
    def _one_task(self) -> Self:
        if self.info.task != self.task:
            raise ValueError(f"the registration is for task {self.task} but its target info is {self.info.task}'s")
        if self.supervision not in TASK_FORMS[self.task]:
            raise ValueError(f"task {self.task} is sent as {', '.join(TASK_FORMS[self.task])}, not {self.supervision}")
        return self


# How a worker is finished with a ticket (Done.outcome). The rank has been answered: served (its result), failed
# (a failure that says why: its request's own fault, or the engine's error on it), undelivered (neither reached it:
# it is gone or unreachable). The rank has been told nothing and the request goes back to the queue: retry
# (the engine could not run it here, e.g. out of memory; it counts against the request, another worker may succeed),
# draining (the worker is stopping: no fault of the request), missing_mapping (the worker lacks the vocab mapping the
# request names: the broker sends it the mapping first next time), stalled (the rank took nothing of its answer for
# --send-timeout, before or partway through it: sent again once, then the rank is told it failed), version_changed (the
# worker's target version no longer fits the request: it changed since the broker dispatched it; no fault of the request),
# updating (the worker is about to load new weights: what waits in its queue goes to the service's other workers).
DoneOutcome = Literal["served", "failed", "undelivered", "retry", "draining", "missing_mapping", "stalled", "version_changed", "updating"]


class Done(Strict):
    """The worker is finished with this ticket and has room for another. ``next_ticket``: the one it computes next
    (the head of its queue), which the broker charges if the worker dies now; None when its queue is empty."""

    type: Literal["done"] = "done"
    ticket: Annotated[int, Field(ge=0)]
    outcome: DoneOutcome
    next_ticket: Annotated[int, Field(ge=0)] | None = None
    message: str | None = None
    rank_unreachable: bool = False  # undelivered: the rank's data socket never answered (a wrong data endpoint)
    missing_mapping: MappingDigest | None = None  # missing_mapping: which one

    @property
    def hands_back(self) -> bool:
        return self.outcome in ("retry", "draining", "missing_mapping", "stalled", "version_changed", "updating")


class PairStatus(Strict):
    """One (worker, rank) pair's data plane, as the worker reports it for ``draftfeed status``."""

    rank: Name
    plane: Literal["frames", "nccl", "gloo", "nixl"]
    state: Literal["frames", "opening", "ready", "down"]
    reason: Annotated[str, Field(max_length=512)]
    generation: Generation | None = None
    sent_over_pair: Annotated[int, Field(ge=0)] = 0
    fallbacks: Annotated[int, Field(ge=0)] = 0


class WorkerHeartbeat(Strict):
    """Liveness and state, once per heartbeat interval and never more often. Its size does not grow with the
    cluster: ``pairs`` holds the pairs whose status changed since the last heartbeat (at most ``PAIRS_PER_BEAT``,
    the rest in the next ones) and a few unchanged ones in turn, so a lost heartbeat heals; ``pair_count`` says how
    many pairs the worker has."""

    type: Literal["heartbeat"] = "heartbeat"
    rank_links: Annotated[int, Field(ge=0)] = 0
    mappings: Annotated[int, Field(ge=0)] = 0
    pair_count: Annotated[int, Field(ge=0)] = 0
    pairs: list[PairStatus] = Field(default_factory=list, max_length=PAIRS_PER_BEAT)


class Computing(Strict):
    """The ticket the worker starts computing, sent only when its last ``done`` did not name it as next (the worker
    was idle): if the worker dies while computing, only that request is charged with its death."""

    type: Literal["computing"] = "computing"
    ticket: Annotated[int, Field(ge=0)]


class Draining(Strict):
    """The worker is stopping: send it no more work (its bye follows, and requeues whatever it still held)."""

    type: Literal["draining"] = "draining"


class UpdateWeights(Strict):
    """Load the weights at ``weights`` in place, all or nothing, between two requests, and serve them as
    ``target_version`` (broker -> worker, from an ``update_target``)."""

    type: Literal["update_weights"] = "update_weights"
    update: Annotated[int, Field(ge=0)]
    weights: Annotated[str, Field(min_length=1, max_length=4096)] | None = None  # a path on the worker's filesystem
    source: Name | None = None  # or a publisher's endpoint to pull them from (dataplane/weights/)
    source_key: PublicKey | None = None  # the publisher's CURVE public key: pull encrypted, proving the worker's own
    target_version: TargetVersion


class WeightsUpdated(Strict):
    """How an ``update_weights`` went: ``ok`` and the version now served, or the old version kept and why not."""

    type: Literal["weights_updated"] = "weights_updated"
    update: Annotated[int, Field(ge=0)]
    ok: bool
    target_version: TargetVersion
    checkpoint: Annotated[str, Field(max_length=4096)] | None = None
    message: Annotated[str, Field(max_length=4096)] | None = None


class Registered(Strict):
    type: Literal["registered"] = "registered"
    broker: Name
    instance: Name
    liveness: Liveness


class RankAddress(Strict):
    rank: Name
    data_endpoint: Name


class ForgetRanks(Strict):
    """Ranks that are gone: drop their queued work and close the links to them. The broker gathers the ranks one
    worker is to forget and says them in one message (at most ``MAX_NOTICES``)."""

    type: Literal["forget_ranks"] = "forget_ranks"
    ranks: list[RankAddress] = Field(min_length=1, max_length=MAX_NOTICES)


class Dispatch(Strict):
    """A rank's request handed to a worker, with where to send the answer."""

    type: Literal["dispatch"] = "dispatch"
    ticket: Annotated[int, Field(ge=0)]
    rank: Name
    data_endpoint: Name
    service: Name
    data_plane: DataPlaneOffer | None = None  # the rank's, from its hello
    reply_key: PublicKey | None = None  # on a secure broker: the rank's public key, which its data socket proves
    max_result_bytes: Annotated[int, Field(gt=0)] | None = None  # the rank's, from its hello
    request: Submit


def dispatch_rank_fields(hello: Hello, reply_key: str | None) -> bytes:
    """The part of every ``dispatch`` header that comes from its rank (encoded once per rank): the broker's hot
    path writes dispatch headers directly, without building a Dispatch (tests hold it to the model)."""
    fields: dict = {"rank": hello.rank, "data_endpoint": hello.data_endpoint, "service": hello.service}
    if hello.data_plane is not None:
        fields["data_plane"] = hello.data_plane.model_dump(mode="json")
    if reply_key is not None:
        fields["reply_key"] = reply_key
    if hello.max_result_bytes is not None:
        fields["max_result_bytes"] = hello.max_result_bytes
    return json.dumps(fields, separators=(",", ":"))[1:-1].encode()


def dispatch_header(ticket: int, rank_fields: bytes, request_json: bytes) -> bytes:
    """A ``dispatch`` header (the Dispatch model's JSON) from its ticket, its rank's fields and its request's JSON."""
    return b'{"type":"dispatch","ticket":%d,%s,"request":%s}' % (ticket, rank_fields, request_json)


class VocabMapping(Strict):
    """A draft-vocab mapping, sent to a worker before the first request that names it (again after the worker says
    it lacks it)."""

    type: Literal["vocab_mapping"] = "vocab_mapping"
    digest: MappingDigest
    tensors: list[TensorSpec] = Field(max_length=2)


class ForgetMapping(Strict):
    """No rank uses this mapping and no live request names it; the worker frees it (and the broker forgets that the
    worker holds it)."""

    type: Literal["forget_mapping"] = "forget_mapping"
    digest: MappingDigest
