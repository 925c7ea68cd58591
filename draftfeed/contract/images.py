"""Image and video inputs of an image-text target, as a rank sends them beside its token batch.

A batch may carry the tensors an image processor makes (docs/contract.md, "Image-text targets"), each named as the
target's forward names it. Per-token tensors are [B, S] like ``input_ids``; per-image tensors are concatenated over
the batch's images in row order (their first dimension is not the batch). One check for both sides' use: the rank
checks what it can before sending, the worker checks again against its target's forward before the forward runs.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from draftfeed.contract.ops import shift_left
from draftfeed.schemas.errors import BadRequest

# Every name a batch may carry for an image-text target; a target takes those of them its forward declares by name.
IMAGE_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "second_per_grid_ts",
    "mm_token_type_ids",
    "token_type_ids",
    "image_sizes",
)
PER_TOKEN = ("mm_token_type_ids", "token_type_ids")  # [B, S], like input_ids
FLOATING = ("pixel_values", "pixel_values_videos", "second_per_grid_ts")  # the others are integers
GRIDS = {"image_grid_thw": "pixel_values", "video_grid_thw": "pixel_values_videos"}  # a grid and the patches it counts
PACKED_WITH_IMAGES = (
    "packed rows (seq_lens) cannot carry images: an image-text target's positions (Qwen's M-RoPE, Gemma 3's image "
    "attention) are computed over whole rows, so per-document positions and masks would be wrong; send image batches unpacked"
)


def check_images(images: Mapping[str, torch.Tensor], input_ids: torch.Tensor, accepted: Collection[str], refusal: str | None = None) -> None:
    """BadRequest, in one line naming the tensor and what to change, unless every tensor of ``images`` is one the
    target takes (``accepted``; ``refusal`` says why a target takes none) with a dtype and shape that fit."""
    for name, tensor in images.items():
        if name not in accepted:
            if not accepted:
                raise BadRequest(f"the batch carries {name!r} but {refusal or 'this target takes no image inputs'}")
            raise BadRequest(f"the batch carries {name!r}, which this target's forward does not take; it takes {', '.join(sorted(accepted))}")
        if name in FLOATING:
            if not tensor.is_floating_point():
                raise BadRequest(f"{name} must be a floating-point tensor, got {tensor.dtype}")
        elif tensor.is_floating_point() or tensor.dtype == torch.bool:
            raise BadRequest(f"{name} must be an integer tensor, got {tensor.dtype}: convert it with .long()")
        if name in PER_TOKEN:
            if tensor.shape != input_ids.shape:
                raise BadRequest(f"{name} has shape {list(tensor.shape)} but input_ids has {list(input_ids.shape)}; a per-token tensor must match it")
        elif tensor.dim() < 1 or tensor.shape[0] < 1:
            raise BadRequest(f"{name} must hold at least one image (its first dimension); got shape {list(tensor.shape)}")
    for grid, pixels in GRIDS.items():
        if grid not in images:
            continue
        thw = images[grid]
        if thw.dim() != 2 or thw.shape[1] != 3:
            raise BadRequest(f"{grid} must be [images, 3] (t, h, w in patches); got shape {list(thw.shape)}")
        if bool((thw < 1).any()):
            raise BadRequest(f"{grid} holds a size under 1: every t, h and w is at least 1")
        if pixels in images:
            patches = int(thw.long().prod(-1).sum())
            if images[pixels].shape[0] != patches:
                raise BadRequest(f"{pixels} has {images[pixels].shape[0]} rows but {grid} counts {patches} patches; they must be equal")


def shifted_image_mask(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """ViSpec's image_mask [B, S] bool: True where ``input_ids`` holds the target's image token, shifted left by one
    (False at the last position), so that it lines up with the shifted embeddings."""
    return shift_left((input_ids == image_token_id).long()).bool()
