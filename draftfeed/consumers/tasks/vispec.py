"""ViSpec supervision from one forward pass of an image-text target, as docs/contract.md defines it: the embedding
output with the vision features merged in (shifted left), the final norm's output and the raw lm_head logits on it
(shifted left), as NeMo AutoModel's ViSpec wrapper hands them to the draft.

The image mask is not sent: ranks build it from their own input_ids and the ``image_token_id`` the worker reports.
"""

from __future__ import annotations

import torch

from draftfeed.consumers.engines.base import Capture, Engine
from draftfeed.consumers.tasks.base import Task, TaskBatch
from draftfeed.consumers.tasks.eagle import LastHiddenLogits
from draftfeed.contract.ops import shift_left
from draftfeed.schemas.errors import BadRequest
from draftfeed.schemas.messages import SupervisionForm, VispecTargetInfo, default_supervision

# The config fields that name an image-text model's image placeholder token, in the order they are read.
IMAGE_TOKEN_FIELDS = ("image_token_id", "image_token_index")


def image_token_id(config: object) -> int:
    """The image placeholder token of a transformers config; a ValueError in one line for a target without one."""
    for name in IMAGE_TOKEN_FIELDS:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    model_type = getattr(config, "model_type", "?")
    raise ValueError(
        f"--task vispec needs an image-text target: this {model_type} config has no {' or '.join(IMAGE_TOKEN_FIELDS)}; "
        "serve a vision-language model, or use --task eagle for a text-only one"
    )


class VispecTask(Task):
    """ViSpec supervision on top of any engine that takes images (hf); others serve its text-only batches."""

    name = "vispec"
    INFO = VispecTargetInfo

    def __init__(self, engine: Engine, image_token_id: int, supervision: SupervisionForm | None = None) -> None:
        super().__init__(engine)
        self.image_token_id = image_token_id
        self.supervision: SupervisionForm = supervision or default_supervision("vispec")
        self._head = LastHiddenLogits(self.name, engine, self.supervision)
        self.logit_transform = self._head.logit_transform
        self.capture = Capture(embeddings=True, final_hidden=True)
        engine.prepare([self.capture])

    def info_fields(self) -> dict[str, object]:
        return {"image_token_id": self.image_token_id}

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """inputs_embeds [B, S, H] shifted left, input_hidden_states [B, S, H] not shifted and, unless compact,
        target_logits [B, S, V] shifted left. Packed rows are refused: ViSpec's draft takes none."""
        if batch.documents is not None:
            raise BadRequest("ViSpec takes no packed rows (seq_lens): send one sequence a row")
        out = self.forward(batch)
        assert out.embeddings is not None and out.final_hidden is not None
        result = {"inputs_embeds": shift_left(out.embeddings), "input_hidden_states": out.final_hidden}
        return self._head.with_logits(result, out.final_hidden)
