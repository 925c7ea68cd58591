"""EAGLE-1 / EAGLE-2 supervision from one forward pass, as docs/contract.md defines it: the final norm's output and
the lm_head's logits on it, shifted left by one.

The logits are lm_head applied to the last hidden state and nothing else, as NeMo AutoModel's EAGLE-1/2 wrapper
computes them: a target that scales or soft-caps its own logits (Gemma) is not scaled here either, so the draft
learns what it would learn colocated.
"""

from __future__ import annotations

import torch

from draftfeed.consumers.engines.base import Capture, Engine
from draftfeed.consumers.tasks.base import Task, TaskBatch
from draftfeed.contract.compact import logit_transform_of, task_logits
from draftfeed.schemas.messages import EagleTargetInfo, SupervisionForm, default_supervision


class LastHiddenLogits:
    """The raw lm_head logits on the final norm's output, shifted, unless the form is compact: what EAGLE-1/2 and
    ViSpec share. The math is contract/compact.py's ``task_logits``, which ranks run to rebuild the compact form."""

    def __init__(self, task: str, engine: Engine, supervision: SupervisionForm) -> None:
        self.task = task
        self.engine = engine
        self.supervision = supervision
        self.logit_transform = logit_transform_of(task, engine.logit_transform)  # none: lm_head as it is
        self._weight: torch.Tensor | None = None

    def with_logits(self, result: dict[str, torch.Tensor], final_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """``result`` and, unless compact, target_logits [B, S, V] in the model's dtype, shifted left."""
        if self.supervision == "logits":
            if self._weight is None:
                self._weight = self.engine.output_embeddings()
            result["target_logits"] = task_logits(self.task, final_hidden, self._weight, self.logit_transform)
        return result


class EagleTask(Task):
    """EAGLE-1/2 supervision on top of any engine: the logits as they are ("logits"), or only the last hidden state,
    from which ranks rebuild them with the lm_head fetched once ("hidden", compact)."""

    name = "eagle"
    INFO = EagleTargetInfo

    def __init__(self, engine: Engine, supervision: SupervisionForm | None = None) -> None:
        super().__init__(engine)
        self.supervision: SupervisionForm = supervision or default_supervision("eagle")
        self._head = LastHiddenLogits(self.name, engine, self.supervision)
        self.logit_transform = self._head.logit_transform
        self.capture = Capture(final_hidden=True)
        engine.prepare([self.capture])

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """input_hidden_states [B, S, H] not shifted, and unless compact target_logits [B, S, V] shifted left. The rank
        shifts its own input_ids and loss_mask and the hidden states for target_hidden_states; the vocab is not used."""
        out = self.forward(batch)
        assert out.final_hidden is not None
        return self._head.with_logits({"input_hidden_states": out.final_hidden}, out.final_hidden)
