"""What every task on the worker shares: one supervision built from its engine's forward.

A task (one module a task beside this one) names its target info and its extra fields, says what its forward
captures (``capture``, prepared on the engine when it is made) and makes its supervision from the forward's output
(``supervise``). The batch, the forward with its padded positions zeroed, the target's shape and the info the worker
registers are here, once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from draftfeed.consumers.engines.base import Capture, Engine, ForwardOutput, TargetShape, fill_padding, forward_batch
from draftfeed.contract.packing import Documents
from draftfeed.contract.vocab import VocabMap
from draftfeed.schemas.messages import AnyTargetInfo, LogitTransform, SupervisionForm, TaskName


@dataclass(frozen=True)
class TaskBatch:
    """One validated batch as a task computes it: its documents when it is packed, its image inputs when it has any,
    and the rank's draft vocabulary (None: the identity; only EAGLE-3 reads it)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    vocab: VocabMap | None = None
    documents: Documents | None = None
    images: dict[str, torch.Tensor] | None = None


class Task:
    """One kind of supervision on top of any engine."""

    name: ClassVar[TaskName]
    INFO: ClassVar[type[AnyTargetInfo]]  # the target info it registers
    supervision: SupervisionForm  # the form it sends (DSpark has one: "probs")
    logit_transform: LogitTransform  # what ranks apply when they rebuild logits (the compact form)
    capture: Capture  # what its forward returns

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def shape(self) -> TargetShape:
        return self.engine.shape

    def info(self) -> AnyTargetInfo:
        """The target info the worker registers, which ranks check."""
        shape = self.shape
        return self.INFO(num_hidden_layers=shape.num_hidden_layers, hidden_size=shape.hidden_size, vocab_size=shape.vocab_size, **self.info_fields())

    def info_fields(self) -> dict[str, Any]:
        """The task's own fields of its target info (its layer ids, its image token)."""
        return {}

    def layer_fields(self) -> dict[str, list[int]]:
        """Its fields that concatenate layers along the last dimension (each hidden_size wide), with their layer ids:
        a finding in one names its layer (contract/finite.py)."""
        return {}

    @torch.inference_mode()
    def compute(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        vocab: VocabMap | None = None,
        documents: Documents | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The supervision tensors of one validated batch, on the engine's device."""
        return self.supervise(TaskBatch(input_ids, attention_mask, loss_mask, vocab, documents, images))

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """The task's tensors of ``batch`` (the wire fields of its supervision)."""
        raise NotImplementedError

    def forward(self, batch: TaskBatch, capture: Capture | None = None) -> ForwardOutput:
        """The engine's forward of ``batch`` (capturing ``capture``, by default the task's), padded positions zero."""
        out = forward_batch(self.engine, batch.input_ids, batch.attention_mask, capture or self.capture, batch.documents, batch.images)
        return fill_padding(out, batch.attention_mask)


def chosen_layer_ids(given: list[int] | None, num_hidden_layers: int, default: Callable[[], list[int]], check: Callable[..., list[int]]) -> list[int]:
    """The layer ids given, else the task's default, each checked by ``check`` (whose message says which it was)."""
    if given is None:
        return check(default(), num_hidden_layers, default=True)
    return check(list(given), num_hidden_layers, default=False)
