"""What a training rank receives: the supervision of one batch, as plain tensors."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")


@dataclass
class Eagle3Supervision:
    """EAGLE-3 supervision of one batch (shapes for B rows of S tokens, H hidden, Vd draft vocab).

    aux_hidden_states [B, S, 3H] model dtype, the 3 aux layers' outputs concatenated, not shifted;
    target_probs [B, S, Vd] float32; position_mask [B, S, 1] bool; input_ids and loss_mask [B, S] int64,
    shifted left by one with a zero at the end; attention_mask [B, S] as sent, not shifted.
    """

    aux_hidden_states: torch.Tensor
    target_probs: torch.Tensor
    position_mask: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor

    # Tensors the worker computes and sends; attention_mask is the rank's own copy.
    WIRE_FIELDS = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Eagle3Supervision":
        return Eagle3Supervision(
            **{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.as_dict().values())
