"""Pydantic models of every message header. The frame layout around them is in protocol.py.

Each header has a literal ``type``; the unions at the bottom say which messages each socket accepts,
so a peer that sends a worker message to the rank port gets a validation error, not a crash.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from typing_extensions import Self

from draftfeed.schemas.protocol import MAX_NOTICES, PAIRS_PER_BEAT

Name = Annotated[str, Field(min_length=1, max_length=256)]
RequestId = Annotated[int, Field(ge=0, lt=2**63)]
# The supervision tasks (docs/contract.md has a section on each) and, as requests, the weights a rank may fetch.
TaskName = Literal["eagle3", "dspark", "dflash", "eagle", "vispec"]
TASKS: tuple[TaskName, ...] = get_args(TaskName)
SubmitKind = Literal[TaskName, "input_embeddings", "output_embeddings"]
Token = Annotated[int, Field(ge=0, lt=2**63)]
Seconds = Annotated[float, Field(gt=0, le=3600)]
ErrorCode = Literal[
    "refused", "unknown_peer", "forgotten", "unknown_mapping", "busy", "failed", "unreachable", "mismatch", "over_limit", "wrong_port"
]
# A vocab mapping's name: a digest of its tensors, which every request computed with it names.
MappingDigest = Annotated[str, Field(min_length=8, max_length=128)]
# How supervision travels from a worker to a rank (docs/data-planes.md): auto picks nccl between CUDA
# processes on one host, nixl where both sides have NIXL, and frames otherwise; the others force a plane.
DataPlaneMode = Literal["auto", "frames", "nccl", "gloo", "nixl"]
PairBackend = Literal["nccl", "gloo"]
Generation = Annotated[int, Field(ge=0, lt=2**31)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TensorSpec(Strict):
    """Name, dtype and shape of one tensor frame."""

    name: Name
    dtype: Annotated[str, Field(max_length=32)]
    shape: Annotated[list[Annotated[int, Field(ge=0, lt=2**40)]], Field(max_length=8)]

    def numel(self) -> int:
        return math.prod(self.shape)


class _TargetInfo(Strict):
    """What a worker's target is; every worker of one service must report the same."""

    num_hidden_layers: Annotated[int, Field(ge=1)]
    hidden_size: Annotated[int, Field(ge=1)]
    vocab_size: Annotated[int, Field(ge=1)]

    def __getitem__(self, key: str) -> object:
        """Dict-style access (``info["hidden_size"]``), as ranks written for a dict of model info expect."""
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def mismatched_fields(self, other: _TargetInfo) -> list[str]:
        """Names of the fields whose values differ (the task included)."""
        names = dict.fromkeys([*type(self).model_fields, *type(other).model_fields])
        return [name for name in names if getattr(self, name, None) != getattr(other, name, None)]

    def describe_mismatch(self, other: _TargetInfo, mine: str = "expected", theirs: str = "served") -> str:
        return "; ".join(
            f"{name}: {mine} {getattr(self, name, None)!r}, {theirs} {getattr(other, name, None)!r}" for name in self.mismatched_fields(other)
        )

    LAYER_FIELD: ClassVar[str | None] = None  # the field naming the layers this task's draft reads (None: it reads none)

    @classmethod
    def from_text_config(cls, text_config: object, layer_ids: list[int] | None = None, **fields: object) -> Self:
        """From a transformers config (of a multimodal target, its text config is used), the layer ids the draft
        reads (the aux layers for EAGLE-3, the target layers for DSpark and DFlash; none for EAGLE-1/2 and ViSpec)
        and the task's other fields."""
        get_text_config = getattr(text_config, "get_text_config", None)
        config = get_text_config() if callable(get_text_config) else getattr(text_config, "text_config", None) or text_config
        if cls.LAYER_FIELD is not None:
            fields[cls.LAYER_FIELD] = list(layer_ids or [])
        return cls(num_hidden_layers=config.num_hidden_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size, **fields)


class Eagle3TargetInfo(_TargetInfo):
    LAYER_FIELD: ClassVar[str | None] = "aux_layer_ids"
    task: Literal["eagle3"] = "eagle3"
    aux_layer_ids: Annotated[list[int], Field(min_length=3, max_length=3)]


class DSparkTargetInfo(_TargetInfo):
    LAYER_FIELD: ClassVar[str | None] = "target_layer_ids"
    task: Literal["dspark"] = "dspark"
    target_layer_ids: Annotated[list[int], Field(min_length=1, max_length=256)]


class DFlashTargetInfo(_TargetInfo):
    """DFlash, DFlash2, Domino and JetSpec: the outputs of ``target_layer_ids`` (decoder layers 0..L-1, pre-norm),
    and with ``capture_logits`` the full-vocab logits too (JetSpec's distillation needs them)."""

    LAYER_FIELD: ClassVar[str | None] = "target_layer_ids"
    task: Literal["dflash"] = "dflash"
    target_layer_ids: Annotated[list[int], Field(min_length=1, max_length=256)]
    capture_logits: bool = False


class EagleTargetInfo(_TargetInfo):
    """EAGLE-1 and EAGLE-2: the post-norm last hidden state and lm_head's logits; no layer ids."""

    task: Literal["eagle"] = "eagle"


class VispecTargetInfo(_TargetInfo):
    """ViSpec on an image-text target: the embedding output (vision features merged in), the post-norm last hidden
    state and lm_head's logits. The rank builds the image mask from the batch's ids and ``image_token_id``."""

    task: Literal["vispec"] = "vispec"
    image_token_id: Annotated[int, Field(ge=0)]


TargetInfo = Annotated[Eagle3TargetInfo | DSparkTargetInfo | DFlashTargetInfo | EagleTargetInfo | VispecTargetInfo, Field(discriminator="task")]
AnyTargetInfo = Eagle3TargetInfo | DSparkTargetInfo | DFlashTargetInfo | EagleTargetInfo | VispecTargetInfo
# How a worker sends what its task computes. EAGLE-3: target_probs as float32 probabilities (the contract's form),
# as bfloat16 probabilities (lossy, half the bytes), or as the post-norm final hidden state plus the full-vocab
# argmax, from which the rank rebuilds probabilities and position mask with the lm_head's draft rows ("hidden",
# compact). DFlash with logits, EAGLE-1/2 and ViSpec: the full-vocab logits ("logits"), or the post-norm final hidden
# state from which the rank rebuilds them with the lm_head fetched once ("hidden", compact). DSpark, and DFlash
# without logits, have one form, their first.
SupervisionForm = Literal["probs", "probs-bf16", "hidden", "logits"]
TASK_FORMS: dict[TaskName, tuple[SupervisionForm, ...]] = {
    "eagle3": ("probs", "probs-bf16", "hidden"),
    "dspark": ("probs",),
    "dflash": ("logits", "hidden"),
    "eagle": ("logits", "hidden"),
    "vispec": ("logits", "hidden"),
}
DEFAULT_SUPERVISION: SupervisionForm = TASK_FORMS["eagle3"][0]  # what EAGLE-3 workers send unless told otherwise (--supervision)


def default_supervision(task: TaskName) -> SupervisionForm:
    """The form a worker of ``task`` sends unless told otherwise: the task's first."""
    return TASK_FORMS[task][0]


class LogitTransform(Strict):
    """What the target does to lm_head's output, in this order: x multiply, / divide, soft-cap (tanh)."""

    multiply: float | None = None  # e.g. Cohere's logit_scale
    divide: float | None = None  # e.g. Granite's logits_scaling
    softcap: float | None = None  # e.g. Gemma's final_logit_softcapping

    @classmethod
    def from_text_config(cls, config: object) -> LogitTransform:
        return cls(
            multiply=getattr(config, "logit_scale", None),
            divide=getattr(config, "logits_scaling", None),
            softcap=getattr(config, "final_logit_softcapping", None),
        )


class DataPlaneOffer(Strict):
    """What one side of a (worker, rank) pair can do for the data plane; both sides report one."""

    mode: DataPlaneMode = "auto"
    host_id: Name  # the kernel's boot id: equal for two processes on one machine, whatever their hostnames
    hostname: Name
    device: Annotated[str, Field(max_length=32)] = "cpu"  # where supervision is produced (worker) or wanted (rank)
    gpu_uuid: Annotated[str, Field(max_length=64)] | None = None  # of that device, when it is CUDA
    nccl: bool = False  # torch here has NCCL and a CUDA device
    nixl: bool = False  # the NIXL package is installed here
    network: Annotated[str, Field(max_length=64)] = ""  # this process's network namespace (one machine may hold several)
    encrypted: bool = False  # this side's data socket is CURVE (--secure): NIXL traffic would not be


# ---------------------------------------------------------------- rank -> broker (frontend)
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


class SetVocabMapping(Strict):
    """The rank's draft vocabulary: tensors selected_token_ids [Vd] int64 and selected_token_mask [V] bool."""

    type: Literal["set_vocab_mapping"] = "set_vocab_mapping"
    request_id: RequestId
    digest: MappingDigest
    tensors: list[TensorSpec] = Field(max_length=2)


class ModelInfoQuery(Strict):
    type: Literal["model_info"] = "model_info"
    request_id: RequestId


class StatusQuery(Strict):
    """One page of the broker's status document: its totals and services always; its workers from ``workers_from``
    and its ranks from ``ranks_from``, as many as fit one reply (``status["page"]`` says where the next page starts);
    each worker's pairs when ``pairs``. ``summary``: the totals and services only."""

    type: Literal["status"] = "status"
    request_id: RequestId
    workers_from: Annotated[int, Field(ge=0)] = 0
    ranks_from: Annotated[int, Field(ge=0)] = 0
    pairs: bool = False
    summary: bool = False


class Bye(Strict):
    type: Literal["bye"] = "bye"


class Heartbeat(Strict):
    """Liveness, in every direction. From the broker it carries the broker's instance id, so a peer sees a restart."""

    type: Literal["heartbeat"] = "heartbeat"
    instance: str | None = None


# ---------------------------------------------------------------- broker -> rank
class Liveness(Strict):
    """The broker's heartbeat settings, which its peers adopt: silent for interval x liveness seconds is dead."""

    heartbeat_interval_s: Seconds
    liveness: Annotated[int, Field(ge=1, le=100)]

    @property
    def period_s(self) -> float:
        """Silent this long is dead."""
        return self.heartbeat_interval_s * self.liveness


PublicKey = Annotated[str, Field(min_length=40, max_length=40)]  # a CURVE public key, Z85


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
    """On a secure broker: the public keys of the workers of this rank's service, after each change."""

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


class StatusReply(Strict):
    type: Literal["status_reply"] = "status_reply"
    request_id: RequestId
    status: dict


class ErrorReply(Strict):
    """A request (or, with request_id None, a message) the broker refused, and why."""

    type: Literal["error"] = "error"
    request_id: RequestId | None = None
    message: str
    # refused: final; unknown_peer: say hello / register again; forgotten: the same, from a broker that knew this
    # peer and dropped it (the message says why); unknown_mapping: the broker holds no vocab mapping of the
    # request's digest: send the mapping, then the request again; busy: the queue is full, send again later;
    # failed: the request failed on every worker it was tried on; unreachable: workers cannot reach the
    # rank's data socket, and the broker has dropped the rank; mismatch: the service serves another target
    # than the rank checked; over_limit: the rank asks for more than the broker allows one rank (final); wrong_port: a
    # rank at the workers' port or a worker at the ranks' port (final; the message says which port to use).
    code: ErrorCode = "refused"


class WorkersGone(Strict):
    """Workers that served this rank left or were found dead: the rank releases its pair groups with them. The
    broker gathers what it has to say to one rank and says it in one message (at most ``MAX_NOTICES`` names)."""

    type: Literal["workers_gone"] = "workers_gone"
    workers: list[Name] = Field(min_length=1, max_length=MAX_NOTICES)


class Goodbye(Strict):
    """The broker is shutting down; peers reconnect to whichever broker comes up on the same address."""

    type: Literal["goodbye"] = "goodbye"
    instance: Name


# ---------------------------------------------------------------- worker -> broker (backend)
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

    @model_validator(mode="after")
    def _one_task(self) -> Self:
        if self.info.task != self.task:
            raise ValueError(f"the registration is for task {self.task} but its target info is {self.info.task}'s")
        if self.supervision not in TASK_FORMS[self.task]:
            raise ValueError(f"task {self.task} is sent as {', '.join(TASK_FORMS[self.task])}, not {self.supervision}")
        return self


# How a worker is finished with a ticket (Done.outcome). The rank has been answered: served (its result), failed
# (a failure that says why: its request's own fault, or the engine's error on it), undelivered (neither reached it:
# it is gone, stalled or unreachable). The rank has been told nothing and the request goes back to the queue: retry
# (the engine could not run it here, e.g. out of memory; it counts against the request, another worker may succeed),
# draining (the worker is stopping: no fault of the request), missing_mapping (the worker lacks the vocab mapping the
# request names: the broker sends it the mapping first next time).
DoneOutcome = Literal["served", "failed", "undelivered", "retry", "draining", "missing_mapping"]


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
        return self.outcome in ("retry", "draining", "missing_mapping")


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


# ---------------------------------------------------------------- broker -> worker
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


# ---------------------------------------------------------------- worker -> rank (data socket)
class Result(Strict):
    """Supervision. On plane ``frames`` the tensors follow as frames; on ``pair`` this header carries no
    frames and the tensors follow on the pair group of ``generation``, in the order of ``tensors``; on
    ``nixl`` the tensors were written into the rank's receive slot ``slot`` (granted to ``generation``), laid
    out as dataplane/nixl/layout.py packed_layout says."""

    type: Literal["result"] = "result"
    request_id: RequestId
    token: Token = 0
    kind: SubmitKind
    worker: Name
    tensors: list[TensorSpec] = Field(max_length=16)
    plane: Literal["frames", "pair", "nixl"] = "frames"
    generation: Generation | None = None
    slot: Annotated[int, Field(ge=0, lt=2**31)] | None = None


class PairOpen(Strict):
    """The worker opens a pair group with this rank: join the store at store_host:store_port as rank 1."""

    type: Literal["pair_open"] = "pair_open"
    worker: Name
    generation: Generation
    backend: PairBackend
    store_host: Name
    store_port: Annotated[int, Field(gt=0, lt=65536)]
    nonce: Annotated[str, Field(min_length=32, max_length=64)]  # the group's namespace in the store
    timeout_s: Seconds
    reason: Annotated[str, Field(max_length=512)]


class PairClose(Strict):
    """Either side of a pair: the group of this generation is torn down; send nothing more on it."""

    type: Literal["pair_close"] = "pair_close"
    worker: Name
    generation: Generation
    reason: Annotated[str, Field(max_length=512)]


class NixlOpen(Strict):
    """The worker opens a nixl pair with this rank: answer with this rank's agent metadata (``nixl_ready``)."""

    type: Literal["nixl_open"] = "nixl_open"
    worker: Name
    generation: Generation
    agent: Name  # the worker's NIXL agent: notifications from it complete this pair's writes
    timeout_s: Seconds  # the worker gives up on a write after this long
    reason: Annotated[str, Field(max_length=512)]


class NixlReady(Strict):
    """The rank's side of a nixl pair is up: one frame follows, the rank's NIXL agent metadata."""

    type: Literal["nixl_ready"] = "nixl_ready"
    worker: Name
    generation: Generation
    agent: Name
    memory: Literal["DRAM", "VRAM"]


class NixlWant(Strict):
    """The worker has an answer of ``nbytes`` for this rank: grant it a receive slot."""

    type: Literal["nixl_want"] = "nixl_want"
    worker: Name
    generation: Generation
    want: Annotated[int, Field(ge=0, lt=2**62)]
    nbytes: Annotated[int, Field(ge=0, lt=2**40)]


class NixlGrant(Strict):
    """A receive slot for one want (or, with ``refused``, why there is none: that answer goes as frames). A slot
    registered since the worker last loaded the rank's metadata comes with one frame: that slot's metadata."""

    type: Literal["nixl_grant"] = "nixl_grant"
    generation: Generation
    want: Annotated[int, Field(ge=0, lt=2**62)]
    slot: Annotated[int, Field(ge=0, lt=2**31)] = 0
    address: Annotated[int, Field(ge=0, lt=2**64)] = 0
    nbytes: Annotated[int, Field(ge=0, lt=2**40)] = 0
    device: Annotated[int, Field(ge=0, lt=1024)] = 0
    refused: Annotated[str, Field(max_length=512)] | None = None


class Failure(Strict):
    """A request the worker could not serve, with the reason for the user."""

    type: Literal["failure"] = "failure"
    request_id: RequestId
    token: Token = 0
    worker: Name
    message: str


FrontendInbound = Annotated[Hello | Submit | SetVocabMapping | ModelInfoQuery | StatusQuery | Heartbeat | Bye, Field(discriminator="type")]
FrontendOutbound = Annotated[
    Welcome | Ack | ModelInfoReply | StatusReply | ErrorReply | Heartbeat | Goodbye | WorkersGone | WorkerKeys | ServiceWorkers,
    Field(discriminator="type"),
]
BackendInbound = Annotated[Register | Done | Computing | WorkerHeartbeat | Draining | Bye, Field(discriminator="type")]
BackendOutbound = Annotated[
    Registered | Dispatch | VocabMapping | ForgetMapping | ForgetRanks | ErrorReply | Heartbeat | Goodbye,
    Field(discriminator="type"),
]
DataInbound = Annotated[Result | Failure | PairOpen | PairClose | NixlOpen | NixlWant, Field(discriminator="type")]
# rank -> worker, back on the worker's connection to the rank's data socket
DataOutbound = Annotated[PairClose | NixlReady | NixlGrant, Field(discriminator="type")]


class Accepts:
    """The messages one socket accepts, validated from their JSON header.

    A header that begins ``{"type":"NAME"`` (as every draftfeed peer writes them) goes straight to that model's own
    validator, skipping the union's dispatch on ``type``; it checks exactly what the union checks for that type. Any
    other header, and any header that fails there, goes through the union, whose error is the one reported."""

    _PREFIX = b'{"type":"'

    def __init__(self, union: Any) -> None:
        self.adapter: TypeAdapter = TypeAdapter(union)
        members = get_args(union)[0] if get_origin(union) is Annotated else union
        models = get_args(members) or (members,)
        # Each model's own validator, called directly (``model_validate_json`` is a Python wrapper around it).
        self._by_type = {model.model_fields["type"].default.encode(): model.__pydantic_validator__ for model in models}
        self.types = frozenset(name.decode() for name in self._by_type)

    def validate_json(self, data: bytes) -> Any:
        if data.startswith(self._PREFIX):
            validator = self._by_type.get(data[9 : data.find(b'"', 9)])
            if validator is not None:
                try:
                    return validator.validate_json(data)
                except ValidationError:
                    pass  # the union's own validation says what is wrong
        return self.adapter.validate_json(data)


FRONTEND_INBOUND = Accepts(FrontendInbound)
FRONTEND_OUTBOUND = Accepts(FrontendOutbound)
BACKEND_INBOUND = Accepts(BackendInbound)
BACKEND_OUTBOUND = Accepts(BackendOutbound)
DATA_INBOUND = Accepts(DataInbound)
DATA_OUTBOUND = Accepts(DataOutbound)
