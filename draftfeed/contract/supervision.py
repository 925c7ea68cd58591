"""What a training rank receives: the supervision of one batch, as plain tensors."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

import torch

BATCH_KEYS = ("input_ids", "attention_mask", "loss_mask")  # every batch; packed ones add contract/packing.py's keys
S = TypeVar("S", bound="Supervision")


class Supervision:
    """Common helpers of the supervision dataclasses."""

    # Tensors the worker computes and sends; the others are the rank's own copies of what it sent.
    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ()

    def to(self: S, device: torch.device | str, non_blocking: bool = False) -> S:
        return type(self)(**{name: t.to(device, non_blocking=non_blocking) for name, t in self.as_dict().items()})

    def as_dict(self) -> dict[str, torch.Tensor]:
        """Its tensors by name; the packing fields only for a packed batch."""
        return {f.name: value for f in fields(self) if (value := getattr(self, f.name)) is not None}  # type: ignore[arg-type]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.as_dict().values())


@dataclass
class Eagle3Supervision(Supervision):
    """EAGLE-3 supervision of one batch (shapes for B rows of S tokens, H hidden, Vd draft vocab).

    aux_hidden_states [B, S, 3H] model dtype, the 3 aux layers' outputs concatenated, not shifted;
    target_probs [B, S, Vd] float32; position_mask [B, S, 1] bool; input_ids and loss_mask [B, S] int64,
    shifted left by one with a zero at the end; attention_mask [B, S] as sent, not shifted. For a packed batch
    position_ids [B, S], seq_lens [B, D] and doc_remaining [B, S] as the rank gave them, not shifted (None otherwise).
    """

    aux_hidden_states: torch.Tensor
    target_probs: torch.Tensor
    position_mask: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    doc_remaining: torch.Tensor | None = None

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ("aux_hidden_states", "target_probs", "position_mask", "input_ids", "loss_mask")


@dataclass
class DSparkSupervision(Supervision):
    """DSpark supervision of one batch: target_hidden_states [B, S, len(ids) * H] (the captured layers in id
    order) and target_last_hidden_states [B, S, H] (post-norm), model dtype; input_ids, loss_mask and
    attention_mask [B, S] as sent (DSpark shifts nothing); position_ids, seq_lens and doc_remaining as given for a
    packed batch (None otherwise)."""

    target_hidden_states: torch.Tensor
    target_last_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    doc_remaining: torch.Tensor | None = None

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ("target_hidden_states", "target_last_hidden_states")
