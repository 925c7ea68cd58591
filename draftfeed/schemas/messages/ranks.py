"""The messages between a rank and the broker's frontend: hello, submit, vocab mapping, model info and status queries
one way; welcome, acknowledgements, replies and notices the other.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator
from typing_extensions import Self

from draftfeed.schemas.messages.common import (
    DataPlaneOffer,
    Liveness,
    LogitTransform,
    MappingDigest,
    Name,
    PublicKey,
    RequestId,
    Strict,
    SubmitKind,
    SupervisionForm,
    TargetVersion,
    TaskName,
    TensorSpec,
    Token,
)
from draftfeed.schemas.messages.target_info import TargetInfo
from draftfeed.schemas.protocol import MAX_NOTICES, MAX_WHERE


class Hello(Strict):
    """A training rank announces itself: where its data socket listens and how many batches it keeps in flight."""

    type: Literal["hello"] = "hello"
    rank: Name
    service: Name
    data_endpoint: Name
    window: Annotated[int, Field(ge=1, le=1024)]
    host: Name
    pid: Annotated[int, Field(ge=0)]
    task: TaskName = "eagle3"
    # The target this rank checked (model_info / check_target_info): the broker pins the service to it and
    # refuses workers that differ, also after a broker restart.
    expect: TargetInfo | None = None
    data_plane: DataPlaneOffer | None = None  # None: frames only
    # The largest answer this rank takes (all tensors of one result); a worker answers a bigger one with a failure.
    max_result_bytes: Annotated[int, Field(gt=0)] | None = None


# Which target versions a request takes (docs/versions.md): at-least (any worker at ``minimum`` or newer), exact (only
# ``minimum``), latest (the newest among the service's live workers when it is dispatched, and never below ``minimum``).
VersionPolicy = Literal["at-least", "exact", "latest"]


class VersionWanted(Strict):
    minimum: TargetVersion = 0
    policy: VersionPolicy = "at-least"

    def accepts(self, version: int, newest: int | None = None) -> bool:
        """Whether supervision computed at ``version`` fits; ``newest``: the newest version among the service's live
        workers (the broker knows it; a worker that does not passes None, and takes ``latest`` as ``at-least``)."""
        if self.policy == "exact":
            return version == self.minimum
        if self.policy == "latest" and newest is not None:
            return version >= max(self.minimum, newest)
        return version >= self.minimum

    def describe(self) -> str:
        return {"at-least": f"version {self.minimum} or newer", "exact": f"version {self.minimum} exactly", "latest": "the newest version"}[
            self.policy
        ] + (f" (at least {self.minimum})" if self.policy == "latest" and self.minimum else "")


class Submit(Strict):
    """One request: a batch to supervise (kind eagle3) or a one-off fetch (input_embeddings)."""

    type: Literal["submit"] = "submit"
    request_id: RequestId
    kind: SubmitKind
    # A random number the rank checks on the answer: a result that does not echo it is not for this request.
    token: Token = 0
    # The vocab mapping this batch is computed with (an EAGLE-3 rank that set one); None: the identity. A broker
    # or worker that does not hold it never computes the batch without it (docs/protocol.md, "Vocab mappings").
    mapping_digest: MappingDigest | None = None
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=8)
    # The target versions it takes; None: any (a service whose workers never change version).
    target_version: VersionWanted | None = None


class SetVocabMapping(Strict):
    """The rank's draft vocabulary: tensors selected_token_ids [Vd] int64 and selected_token_mask [V] bool."""

    type: Literal["set_vocab_mapping"] = "set_vocab_mapping"
    request_id: RequestId
    digest: MappingDigest
    tensors: list[TensorSpec] = Field(max_length=2)


class ModelInfoQuery(Strict):
    type: Literal["model_info"] = "model_info"
    request_id: RequestId


class UpdateTarget(Strict):
    """Every worker of ``service`` is to load new weights in place and serve them as ``target_version``: from
    ``weights`` (a safetensors file, or a folder of them, on the workers' filesystem), or pulled from ``source`` (a
    publisher's socket: ``publish_weights``); any subset of the target's tensors. The broker answers with an
    ``update_report`` once every worker it told has answered or left."""

    type: Literal["update_target"] = "update_target"
    request_id: RequestId
    service: Name
    weights: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    source: Name | None = None
    # On a secure deployment, the publisher's CURVE public key: each worker told pulls encrypted, proving its own key,
    # and the broker sends the requester the told workers' keys (``worker_keys``), the publisher's allow-list.
    source_key: PublicKey | None = None
    target_version: TargetVersion
    # How many of the service's workers load at a time, the others serving meanwhile (a rank that takes the latest
    # version then never waits for the update); None: all at once (the soonest every worker serves the new version).
    at_once: Annotated[int, Field(ge=1, le=1 << 16)] | None = None

    @model_validator(mode="after")
    def _one_origin(self) -> Self:
        if (self.weights is None) == (self.source is None):
            raise ValueError("an update names its weights (a path) or its source (a publisher's endpoint), one of the two")
        return self

    @property
    def origin(self) -> str:
        return self.weights if self.weights is not None else f"publisher {self.source}"


class WorkerUpdate(Strict):
    worker: Name
    ok: bool
    target_version: TargetVersion  # what it serves now: the new version, or its old one when it refused
    message: Annotated[str, Field(max_length=4096)] | None = None


class UpdateReport(Strict):
    type: Literal["update_report"] = "update_report"
    request_id: RequestId
    workers: list[WorkerUpdate] = Field(max_length=MAX_NOTICES)


class StatusQuery(Strict):
    """One page of the broker's status document: its totals and services always; its workers from ``workers_from``
    and its ranks from ``ranks_from``, as many as fit one reply (``status["page"]`` says where the next page starts);
    each worker's pairs when ``pairs``. ``summary``: the totals and services only. The cursors are join numbers (the
    peers are listed in the order they joined); None lists none of them (a later page, when that list is done)."""

    type: Literal["status"] = "status"
    request_id: RequestId
    workers_from: Annotated[int, Field(ge=0)] | None = 0
    ranks_from: Annotated[int, Field(ge=0)] | None = 0
    pairs: bool = False
    summary: bool = False


class Where(Strict):
    """The rank asks where its requests are: each was sent (or last moved) more than a liveness period ago and no
    piece of its answer has come since. The broker answers ``whereabouts``; a request it does not hold is sent again."""

    type: Literal["where"] = "where"
    request_ids: list[RequestId] = Field(min_length=1, max_length=MAX_WHERE)


# Where the broker has a rank's request: queued for its service, parked beyond the rank's window, at a worker
# (dispatched, waiting in that worker's queue) or computing there; done (it left the broker's care: its answer, a
# failure, or nothing if undelivered, went to the rank), or unknown (the broker never had it, or forgot it).
PlaceName = Literal["queued", "parked", "at_worker", "computing", "done", "unknown"]


class Place(Strict):
    """Where one request is, as the broker sees it, and for how long it has been there."""

    request_id: RequestId
    place: PlaceName
    age_s: Annotated[float, Field(ge=0)] = 0.0  # seconds in that place (done: since it left the broker's care)
    worker: Name | None = None  # at_worker, computing: the worker that holds it; done: the worker that reported it
    outcome: Name | None = None  # done: how its worker said it went (served, failed, undelivered)
    note: Annotated[str, Field(max_length=1024)] | None = None  # queued: why it waits, when the broker knows (versions.py)


class Whereabouts(Strict):
    """The broker's answer to ``where``: each request asked about, in the order asked."""

    type: Literal["whereabouts"] = "whereabouts"
    places: list[Place] = Field(max_length=MAX_WHERE)


class Welcome(Strict):
    type: Literal["welcome"] = "welcome"
    broker: Name
    instance: Name
    # True: this broker instance already held this rank (its requests, its mapping) and keeps it. False: it holds
    # nothing of this rank (new, restarted, or it forgot the rank): the rank sends its mappings, then every
    # unanswered request, again.
    resumed: bool = False
    services: dict[Name, Annotated[int, Field(ge=0)]]  # every service it knows, with its ready workers
    liveness: Liveness
    # On a secure broker: the public keys of the workers of the rank's service, which the rank's data socket admits.
    worker_keys: list[PublicKey] = Field(default_factory=list, max_length=4096)


class ServiceWorkers(Strict):
    """The number of ready workers of this rank's service changed (a worker registered, left, died or drains)."""

    type: Literal["service_workers"] = "service_workers"
    service: Name
    workers: Annotated[int, Field(ge=0)]


class WorkerKeys(Strict):
    """On a secure broker: the public keys of the workers of this rank's service, after each change; to the requester
    of an encrypted ``update_target`` from a publisher, the keys of the workers told to pull from it so far."""

    type: Literal["worker_keys"] = "worker_keys"
    keys: list[PublicKey] = Field(max_length=4096)


class Ack(Strict):
    type: Literal["ack"] = "ack"
    request_id: RequestId


class ModelInfoReply(Strict):
    type: Literal["model_info_reply"] = "model_info_reply"
    request_id: RequestId
    info: TargetInfo
    workers: list[str] = Field(default_factory=list)
    supervision: list[SupervisionForm] = Field(default_factory=list)  # the forms the service's workers send
    logit_transform: LogitTransform | None = None
    max_positions: Annotated[int, Field(gt=0)] | None = None  # the longest row the service's workers take
    target_versions: list[TargetVersion] = Field(default_factory=list)  # each worker's, in the order of ``workers``


class StatusReply(Strict):
    type: Literal["status_reply"] = "status_reply"
    request_id: RequestId
    status: dict


class WorkersGone(Strict):
    """Workers that served this rank left or were found dead: the rank releases its pair groups with them. The
    broker gathers what it has to say to one rank and says it in one message (at most ``MAX_NOTICES`` names)."""

    type: Literal["workers_gone"] = "workers_gone"
    workers: list[Name] = Field(min_length=1, max_length=MAX_NOTICES)
