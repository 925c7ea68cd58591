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
    # The version of the target's weights that computed it (docs/versions.md); None where nothing said (a store).
    # Not a tensor field: set on the instance when it is made.
    target_version: int | None = None

    def to(self: S, device: torch.device | str, non_blocking: bool = False) -> S:
        moved = type(self)(**{name: t.to(device, non_blocking=non_blocking) for name, t in self.as_dict().items()})
        moved.target_version = self.target_version
        return moved

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


@dataclass
class DFlashSupervision(Supervision):
    """DFlash (DFlash2, Domino; JetSpec with logits) supervision of one batch, the fields of NeMo AutoModel's
    ``DFlashTargetBatch``: hidden_states [B, S, len(ids) * H] model dtype, the outputs of the target layers (decoder
    layers, pre-norm) concatenated in id order, not shifted; input_ids, attention_mask and loss_mask [B, S] as sent
    (DFlash shifts nothing); logits [B, S, V] model dtype, the target's own full-vocab logits, not shifted, when the
    service captures them (None otherwise); position_ids, seq_lens and doc_remaining as given for a packed batch."""

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    doc_remaining: torch.Tensor | None = None

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ("hidden_states",)  # and logits, or final_hidden_states (compact)


@dataclass
class EagleSupervision(Supervision):
    """EAGLE-1 / EAGLE-2 supervision of one batch, the fields of NeMo AutoModel's ``EagleTargetBatch``:
    input_hidden_states [B, S, H] model dtype, the post-norm last hidden state, not shifted; target_hidden_states the
    same shifted left by one (zero at the end); target_logits [B, S, V] model dtype, lm_head applied to the last
    hidden state, shifted left; input_ids and loss_mask [B, S] shifted left; attention_mask as sent; position_ids,
    seq_lens and doc_remaining as given for a packed batch, not shifted."""

    input_hidden_states: torch.Tensor
    target_hidden_states: torch.Tensor
    target_logits: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    doc_remaining: torch.Tensor | None = None

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ("input_hidden_states",)  # and target_logits, unless compact


@dataclass
class VispecSupervision(Supervision):
    """ViSpec supervision of one batch of an image-text target, the fields of NeMo AutoModel's ``VispecTargetBatch``:
    inputs_embeds [B, S, H] model dtype, the embedding output with the vision features merged in, shifted left;
    input_hidden_states [B, S, H] the post-norm last hidden state, not shifted; target_logits [B, S, V] lm_head applied
    to it, shifted left; attention_mask as sent; loss_mask shifted left; image_mask [B, S] bool, where input_ids holds
    the target's image token, shifted left."""

    inputs_embeds: torch.Tensor
    input_hidden_states: torch.Tensor
    target_logits: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    image_mask: torch.Tensor

    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ("inputs_embeds", "input_hidden_states")  # and target_logits, unless compact
