"""What every message shares: the field types, the strict base model, tensor specs, supervision forms and logit
transforms, the data-plane offer, and the messages both the rank's and the worker's sockets carry (heartbeat, bye,
liveness, error, goodbye).
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Name = Annotated[str, Field(min_length=1, max_length=256)]


RequestId = Annotated[int, Field(ge=0, lt=2**63)]


# The supervision tasks (docs/contract.md has a section on each) and, as requests, the weights a rank may fetch.
TaskName = Literal["eagle3", "dspark", "dflash", "eagle", "vispec"]

TASKS: tuple[TaskName, ...] = get_args(TaskName)
# Each task's client on the rank (draftfeed.<name>; producers/tasks/), as messages name it to a rank that used another.
CLIENTS: dict[TaskName, str] = {
    "eagle3": "RemoteEagle3Target",
    "dspark": "RemoteDSparkTarget",
    "dflash": "RemoteDFlashTarget",
    "eagle": "RemoteEagleTarget",
    "vispec": "RemoteVispecTarget",
}


SubmitKind = Literal[TaskName, "input_embeddings", "output_embeddings"]


Token = Annotated[int, Field(ge=0, lt=2**63)]
# The version of a target's weights a worker serves: an integer that only grows (an RL step), 0 for the checkpoint it
# started from unless told otherwise (docs/versions.md).
TargetVersion = Annotated[int, Field(ge=0, lt=2**63)]


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


class Bye(Strict):
    type: Literal["bye"] = "bye"


class Heartbeat(Strict):
    """Liveness, in every direction. From the broker it carries the broker's instance id, so a peer sees a restart."""

    type: Literal["heartbeat"] = "heartbeat"
    instance: str | None = None


class Liveness(Strict):
    """The broker's heartbeat settings, which its peers adopt: silent for interval x liveness seconds is dead."""

    heartbeat_interval_s: Seconds
    liveness: Annotated[int, Field(ge=1, le=100)]

    @property
    def period_s(self) -> float:
        """Silent this long is dead."""
        return self.heartbeat_interval_s * self.liveness


PublicKey = Annotated[str, Field(min_length=40, max_length=40)]  # a CURVE public key, Z85


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


class Goodbye(Strict):
    """The broker is shutting down; peers reconnect to whichever broker comes up on the same address."""

    type: Literal["goodbye"] = "goodbye"
    instance: Name
