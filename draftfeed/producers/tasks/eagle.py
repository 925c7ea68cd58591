"""EAGLE-1/2's client on the rank: the post-norm last hidden state, as is and shifted left, and lm_head's logits of
it, shifted left; input_ids and loss_mask shifted left here, from the rank's own."""

from __future__ import annotations

import torch

from draftfeed.contract.ops import shift_left
from draftfeed.contract.supervision import EagleSupervision
from draftfeed.producers.tasks.with_logits import WithLogits
from draftfeed.schemas.messages import EagleTargetInfo


class RemoteEagleTarget(WithLogits[EagleSupervision, EagleTargetInfo]):
    """EAGLE-1 / EAGLE-2 supervision: the post-norm last hidden state, as is and shifted left, and lm_head's logits
    of it, shifted left; input_ids and loss_mask shifted left, the packing fields as given."""

    TASK = "eagle"
    SUPERVISION = EagleSupervision
    INFO = EagleTargetInfo
    LOGITS = "target_logits"
    COMPACT_HIDDEN = "input_hidden_states"

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = received["input_hidden_states"]
        return {
            "input_hidden_states": hidden,
            "target_hidden_states": shift_left(hidden),
            "target_logits": self._logits(received),
            "input_ids": shift_left(own["input_ids"]),
            "loss_mask": shift_left(own["loss_mask"]),
        }
