"""Checks on what a worker receives, before any of it reaches the target. Errors say what to change."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from draftfeed.contract.images import PACKED_WITH_IMAGES, check_images
from draftfeed.contract.packing import SENT_KEYS, Documents, check_packing
from draftfeed.contract.supervision import BATCH_KEYS
from draftfeed.schemas.errors import BadRequest


def image_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of a request that are neither the token batch nor its packing: the image inputs, by name."""
    return {name: tensor for name, tensor in tensors.items() if name not in BATCH_KEYS and name not in SENT_KEYS}


def validate_batch(
    tensors: Mapping[str, torch.Tensor],
    vocab_size: int,
    max_seq_len: int | None = None,
    image_inputs: Collection[str] = (),
    images_refusal: str | None = None,
) -> Documents | None:
    """input_ids, attention_mask and loss_mask: [B, S] each, int64 (attention_mask may be bool), ids in vocab, S at most
    ``max_seq_len``; a packed batch also carries seq_lens (and position_ids), checked by the contract. Any other tensor
    is an image input, which must be one of ``image_inputs`` (the target's; ``images_refusal`` says why there are
    none) and fit it (contract/images.py), in an unpacked batch. Returns the packed batch's documents, None for a batch
    that is not packed."""
    names = set(tensors)
    if not set(BATCH_KEYS) <= names:
        missing = sorted(set(BATCH_KEYS) - names)
        raise BadRequest(f"a batch carries {', '.join(BATCH_KEYS)} (and {', '.join(SENT_KEYS)} when packed); missing {missing}")
    input_ids = tensors["input_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise BadRequest(f"input_ids must be [batch, sequence] with both at least 1; got shape {list(input_ids.shape)}")
    if max_seq_len is not None and input_ids.shape[1] > max_seq_len:
        raise BadRequest(
            f"rows of {input_ids.shape[1]} positions are over this worker's limit of {max_seq_len} (--max-seq-len, by default the "
            f"target's max_position_embeddings): send rows of {max_seq_len} tokens or less"
        )
    for name in BATCH_KEYS:
        tensor = tensors[name]
        if tensor.shape != input_ids.shape:
            raise BadRequest(f"{name} has shape {list(tensor.shape)} but input_ids has {list(input_ids.shape)}; all three must match")
        allowed = (torch.int64, torch.bool) if name == "attention_mask" else (torch.int64,)
        if tensor.dtype not in allowed:
            raise BadRequest(f"{name} must be int64{' or bool' if len(allowed) > 1 else ''}, got {tensor.dtype}: convert it with .long()")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = high if high >= vocab_size else low
        raise BadRequest(f"input_ids holds token id {bad}, outside the target's vocabulary [0, {vocab_size})")
    for name in ("attention_mask", "loss_mask"):
        tensor = tensors[name]
        if tensor.dtype != torch.bool and not bool(((tensor == 0) | (tensor == 1)).all()):
            raise BadRequest(f"{name} must hold only 0 and 1")
    documents = check_packing(tensors["attention_mask"], tensors.get("position_ids"), tensors.get("seq_lens"))
    images = image_tensors(tensors)
    if images:
        check_images(images, input_ids, image_inputs, images_refusal)
        if documents is not None:
            raise BadRequest(PACKED_WITH_IMAGES)
    return documents
