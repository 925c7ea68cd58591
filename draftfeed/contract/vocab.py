"""Vocab mappings: the draft vocabulary as target ids and a mask, their checks and their name on the wire."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from draftfeed.schemas.errors import BadRequest


@dataclass(frozen=True)
class VocabMap:
    selected_token_ids: torch.Tensor  # int64 [Vd], draft id -> target id
    selected_token_mask: torch.Tensor  # bool [V], True at the draft vocab's target ids

    @staticmethod
    def identity(vocab_size: int, device: torch.device) -> VocabMap:
        return VocabMap(
            torch.arange(vocab_size, dtype=torch.int64, device=device),
            torch.ones(vocab_size, dtype=torch.bool, device=device),
        )


def validate_vocab_mapping(selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor, vocab_size: int) -> None:
    """selected_token_ids int64 [Vd] of distinct ids in [0, V); selected_token_mask bool [V], True exactly at those ids.

    Raises BadRequest saying what is wrong."""
    if selected_token_ids.dtype != torch.int64 or selected_token_ids.dim() != 1 or selected_token_ids.numel() == 0:
        raise BadRequest(f"selected_token_ids must be a non-empty 1-D int64 tensor; got {selected_token_ids.dtype} {list(selected_token_ids.shape)}")
    if selected_token_mask.dtype != torch.bool or list(selected_token_mask.shape) != [vocab_size]:
        raise BadRequest(
            f"selected_token_mask must be bool [{vocab_size}] (the target's vocab size); "
            f"got {selected_token_mask.dtype} {list(selected_token_mask.shape)}"
        )
    low, high = int(selected_token_ids.min()), int(selected_token_ids.max())
    if low < 0 or high >= vocab_size:
        raise BadRequest(f"selected_token_ids holds {high if high >= vocab_size else low}, outside [0, {vocab_size})")
    if torch.unique(selected_token_ids).numel() != selected_token_ids.numel():
        raise BadRequest("selected_token_ids holds an id more than once; each target id may appear once")
    if int(selected_token_mask.sum()) != selected_token_ids.numel() or not bool(selected_token_mask[selected_token_ids].all()):
        raise BadRequest("selected_token_mask must be True exactly at the ids in selected_token_ids")


def mapping_digest(selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> str:
    """The mapping's name on the wire: blake2b-128 of both tensors' bytes (CPU, int64 and bool), in hex."""
    ids = selected_token_ids.detach().to("cpu", torch.int64).contiguous()
    mask = selected_token_mask.detach().to("cpu", torch.bool).contiguous()
    return hashlib.blake2b(ids.numpy().tobytes() + mask.numpy().tobytes(), digest_size=16).hexdigest()
