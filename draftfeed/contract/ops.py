"""Tensor operations of the supervision contract that both sides apply."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftfeed.schemas.messages import LogitTransform


def shift_left(tensor: torch.Tensor) -> torch.Tensor:
    """Shift along the sequence (dim 1) by one, zero-filling the last position."""
    shifted = torch.zeros_like(tensor)
    shifted[:, :-1] = tensor[:, 1:]
    return shifted


def transform_logits(logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """Apply a target's logit scaling and soft-capping to lm_head's output: multiply, divide, soft-cap, in that order."""
    if transform.multiply is not None:
        logits = logits * transform.multiply
    if transform.divide is not None:
        logits = logits / transform.divide
    if transform.softcap is not None:
        logits = torch.tanh(logits / transform.softcap) * transform.softcap
    return logits


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """``hidden @ weight.T`` transformed as a target transforms its logits (multiply, divide, soft-cap, in that order)."""
    return transform_logits(F.linear(hidden, weight.to(hidden.dtype)), transform)


def zero_padding_(tensor: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Zero ``tensor`` [B, S, ...] in place where ``attention_mask`` [B, S] is 0: the contract's padded positions."""
    padding = (attention_mask == 0).to(tensor.device)
    return tensor.masked_fill_(padding.view(*padding.shape, *([1] * (tensor.dim() - 2))), 0)
