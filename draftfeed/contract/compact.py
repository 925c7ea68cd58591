"""Rebuilding EAGLE-3 target_probs and position_mask on the rank from the compact ("hidden") form.

The worker sends the post-norm final hidden state [B, S, H] and the full-vocab argmax [B, S] instead of
probabilities [B, S, Vd]: for an 8B target about 1/15 of the bytes. The rank applies the draft-vocab
rows of the target's lm_head (fetched once), the target's own logit transform, then the contract's
shift and softmax. With the identity mapping these are the worker's own operations in the same order,
so the result is bit-identical; with a draft subset the matmul runs over fewer rows and may differ in
the last bits (docs/performance.md gives the measured difference).
"""

from __future__ import annotations

import torch

from draftfeed.contract.ops import lm_head_logits, shift_left
from draftfeed.schemas.messages import LogitTransform


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
