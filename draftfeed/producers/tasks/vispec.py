"""ViSpec's client on the rank, for an image-text target: the embedding output with the vision features merged in,
the post-norm last hidden state and lm_head's logits of it; the image mask is made here from the rank's own
input_ids and the service's image token."""

from __future__ import annotations

import torch

from draftfeed.contract.images import shifted_image_mask
from draftfeed.contract.ops import shift_left
from draftfeed.contract.supervision import VispecSupervision
from draftfeed.producers.tasks.with_logits import WithLogits
from draftfeed.schemas.messages import VispecTargetInfo


class RemoteVispecTarget(WithLogits[VispecSupervision, VispecTargetInfo]):
    """ViSpec supervision of an image-text target: the embedding output with the vision features merged in (shifted
    left), the post-norm last hidden state, lm_head's logits of it (shifted left), and the image mask (shifted left).
    Packed rows are refused: NeMo's ViSpec wrapper runs one sequence a row."""

    TASK = "vispec"
    SUPERVISION = VispecSupervision
    INFO = VispecTargetInfo
    LOGITS = "target_logits"
    COMPACT_HIDDEN = "input_hidden_states"
    PACKED_REFUSAL = "ViSpec takes no packed rows (seq_lens): NeMo's ViSpec wrapper runs one sequence a row; send the batch unpacked"

    @property
    def image_token_id(self) -> int:
        """The target's image placeholder token (image_mask is True where input_ids hold it, shifted left)."""
        return self.model_info().image_token_id

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "inputs_embeds": received["inputs_embeds"],
            "input_hidden_states": received["input_hidden_states"],
            "target_logits": self._logits(received),
            "loss_mask": shift_left(own["loss_mask"]),
            "image_mask": shifted_image_mask(own["input_ids"], self.image_token_id),
        }
