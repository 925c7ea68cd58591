"""Rebuilding supervision on the rank from the compact ("hidden") form: the worker sends the post-norm final hidden
state instead of something vocab-sized, and the rank applies the target's lm_head (fetched once) itself.

EAGLE-3 (``CompactEagle3``): the worker sends the final hidden state [B, S, H] and the full-vocab argmax [B, S]
instead of probabilities [B, S, Vd] (for an 8B target about 1/15 of the bytes); the rank applies the draft-vocab rows
of the lm_head, the target's own logit transform, then the contract's shift and softmax. With the identity mapping
these are the worker's own operations in the same order, so the result is bit-identical; with a draft subset the
matmul runs over fewer rows and may differ in the last bits (docs/performance.md gives the measured difference).

DFlash with logits, EAGLE-1/2 and ViSpec (``CompactLogits``): the worker sends the final hidden state [B, S, H]
instead of full-vocab logits [B, S, V]; both sides make the logits with ``task_logits`` (the same operations in the
same order: the "logits" form is this function run on the worker).
"""

from __future__ import annotations

import torch

from draftfeed.contract.ops import lm_head_logits, shift_left
from draftfeed.schemas.messages import LogitTransform

# EAGLE-1/2 and ViSpec take lm_head's output as it is (NeMo's wrappers call lm_head on the last hidden state): no
# soft-capping or scaling, whatever the target does to its own logits.
RAW = LogitTransform()
# Tasks whose logits are shifted left by one (position t holds the logits of the token at t + 1); DFlash's are not.
SHIFTED_LOGITS = frozenset({"eagle", "vispec"})


def logit_transform_of(task: str, target_transform: LogitTransform | None) -> LogitTransform:
    """The transform a task's logits carry: the target's own for DFlash (its model's logits), none for EAGLE-1/2 and
    ViSpec (lm_head applied raw)."""
    if task == "dflash":
        return target_transform or RAW
    return RAW


def task_logits(task: str, final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, target_transform: LogitTransform | None) -> torch.Tensor:
    """A task's full-vocab logits [B, S, V] from the post-norm final hidden state [B, S, H] (padded positions already
    zero) and the lm_head weight [V, H]: transformed as ``logit_transform_of`` says, shifted for EAGLE-1/2 and ViSpec."""
    logits = lm_head_logits(final_hidden, lm_head_weight, logit_transform_of(task, target_transform))
    return shift_left(logits) if task in SHIFTED_LOGITS else logits


class CompactLogits:
    """Turns a compact DFlash, EAGLE-1/2 or ViSpec result's final hidden state into the task's logits."""

    def __init__(self, task: str, lm_head_weight: torch.Tensor, target_transform: LogitTransform | None) -> None:
        self.task = task
        self.lm_head_weight = lm_head_weight  # [V, H]
        self.target_transform = target_transform

    @torch.no_grad()
    def rebuild(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return task_logits(self.task, final_hidden, self.lm_head_weight, self.target_transform)


class CompactEagle3:
    """Turns a compact EAGLE-3 result into the contract's target_probs and position_mask."""

    def __init__(self, lm_head_rows: torch.Tensor, selected_token_mask: torch.Tensor, transform: LogitTransform | None) -> None:
        self.lm_head_rows = lm_head_rows  # [Vd, H], in draft-id order
        self.selected_token_mask = selected_token_mask  # bool [V]
        self.transform = transform or LogitTransform()

    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [B, S, Vd], transformed as the target transforms its own."""
        return lm_head_logits(final_hidden, self.lm_head_rows, self.transform)

    @torch.no_grad()
    def rebuild(self, final_hidden: torch.Tensor, target_argmax: torch.Tensor, shifted_loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        target_probs = torch.softmax(shift_left(self.logits(final_hidden)).float(), dim=-1)
        position_mask = (self.selected_token_mask[shift_left(target_argmax)] & shifted_loss_mask.bool()).unsqueeze(-1)
        return {"target_probs": target_probs, "position_mask": position_mask}
