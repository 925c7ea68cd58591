"""The EAGLE-3 supervision step over the vocabulary, a chunk of positions at a time.

Full-vocab logits for every position are B x S x V: at S = 65,536 and V = 128k that is 32 GB of float32, beyond
one GPU beside its target. Here the final norm's output is turned into logits (lm_head and the target's logit
transform) ``chunk_tokens`` positions at a time, and each chunk leaves only what the supervision keeps: its
draft-vocab probabilities and its full-vocab argmax. Peak memory is chunk_tokens x V, whatever S is.

The results are those of ``eagle3.eagle3_from_forward`` on the whole batch's logits, position by position (the
shift, the last position's softmax of zeros, the position mask); they differ from it only by what lm_head's
matmul over a chunk rounds differently from the same matmul over all positions (docs/contract.md states the
measured difference).
"""

from __future__ import annotations

import torch

from draftfeed.contract.ops import lm_head_logits, shift_left
from draftfeed.contract.vocab import VocabMap
from draftfeed.schemas.messages import LogitTransform


def argmax_in_chunks(final_hidden: torch.Tensor, weight: torch.Tensor, transform: LogitTransform, chunk_tokens: int) -> torch.Tensor:
    """[B, S] int64: each position's full-vocab argmax, not shifted."""
    batch, seq, hidden = final_hidden.shape
    flat = final_hidden.reshape(batch * seq, hidden)
    argmax = torch.empty(batch * seq, dtype=torch.int64, device=final_hidden.device)
    for start in range(0, batch * seq, chunk_tokens):
        argmax[start : start + chunk_tokens] = lm_head_logits(flat[start : start + chunk_tokens], weight, transform).argmax(-1)
    return argmax.view(batch, seq)


def probs_in_chunks(
    final_hidden: torch.Tensor, weight: torch.Tensor, transform: LogitTransform, vocab: VocabMap, loss_mask: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``target_probs`` [B, S, Vd] float32 and ``position_mask`` [B, S, 1] bool, shifted left by one as the contract says."""
    batch, seq, hidden = final_hidden.shape
    draft = vocab.selected_token_ids
    flat = final_hidden.reshape(batch * seq, hidden)
    probs = torch.empty(batch, seq, len(draft), dtype=torch.float32, device=final_hidden.device)
    # The last position has no next token: the whole-batch computation takes the softmax of its zero-filled logits.
    probs[:, -1] = torch.softmax(torch.zeros(len(draft), dtype=final_hidden.dtype, device=final_hidden.device).float(), dim=-1)
    shifted = probs.view(batch * seq, len(draft))
    argmax = torch.empty(batch * seq, dtype=torch.int64, device=final_hidden.device)
    for start in range(0, batch * seq, chunk_tokens):
        logits = lm_head_logits(flat[start : start + chunk_tokens], weight, transform)
        argmax[start : start + len(logits)] = logits.argmax(-1)
        flat_positions = torch.arange(start, start + len(logits), device=final_hidden.device)
        has_previous = flat_positions % seq != 0  # position s feeds row position s - 1, which exists for s >= 1
        chunk_probs = torch.softmax(logits.index_select(-1, draft).float(), dim=-1)
        shifted.index_copy_(0, flat_positions[has_previous] - 1, chunk_probs[has_previous])
        del logits, chunk_probs
    # The zero-filled last position's argmax is token 0, as argmax over zeros is.
    shifted_argmax = shift_left(argmax.view(batch, seq))
    position_mask = (vocab.selected_token_mask[shifted_argmax] & shift_left(loss_mask).bool()).unsqueeze(-1)
    return probs, position_mask
