"""What a task is to the worker: it builds one kind of supervision from its engine's forward."""

from __future__ import annotations

from typing import Protocol

import torch

from draftfeed.consumers.engines.base import Engine, TargetShape
from draftfeed.contract.packing import Documents
from draftfeed.contract.vocab import VocabMap
from draftfeed.schemas.messages import AnyTargetInfo, LogitTransform, SupervisionForm, TaskName


class Task(Protocol):
    name: TaskName
    engine: Engine
    supervision: SupervisionForm  # the form it sends (DSpark has one: "probs")
    logit_transform: LogitTransform  # what ranks apply when they rebuild logits (the compact form)

    @property
    def shape(self) -> TargetShape: ...

    def info(self) -> AnyTargetInfo:
        """The target info the worker registers, which ranks check."""
        ...

    def compute(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor,
        vocab: VocabMap | None,
        documents: Documents | None = None,
        images: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The supervision tensors of one validated batch (its documents when it is packed, its image inputs when it
        has any), on the engine's device."""
        ...
