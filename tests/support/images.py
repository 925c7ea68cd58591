"""Image-text batches as the processors of the tiny image-text targets (draftfeed.tiny) lay them out: Qwen2.5-VL's and
Gemma 3's, rows of text and images, right-padded."""

from __future__ import annotations

import torch

IMAGE, VIDEO, START, END = 997, 998, 995, 996  # draftfeed.tiny's image, video, vision start (boi) and end (eoi) ids


def rows_of(texts: list[list[int]], pad_to: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(texts), pad_to, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(texts):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    return ids, mask


def text(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 990, (n,), generator=generator).tolist()


def qwen_batch(config, images_per_row: list[list[tuple[int, int, int]]], seed: int, pad: int = 3) -> dict[str, torch.Tensor]:
    """Rows of text and images as Qwen2.5-VL's processor lays them out: <start> <image>*(t*h*w/merge^2) <end> per image;
    pixel_values [sum t*h*w, C*temporal*patch^2] over the batch's images in row order, image_grid_thw [images, 3]."""
    vision, generator = config.vision_config, torch.Generator().manual_seed(seed)
    merge = vision.spatial_merge_size
    texts, grids = [], []
    for images in images_per_row:
        tokens = text(generator, 4)
        for grid in images:
            tokens += [START] + [IMAGE] * (grid[0] * grid[1] * grid[2] // merge**2) + [END] + text(generator, 3)
            grids.append(grid)
        texts.append(tokens)
    input_ids, attention_mask = rows_of(texts, max(len(t) for t in texts) + pad)
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), width, generator=generator)
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    mm_token_type_ids = (input_ids == IMAGE).long() + 2 * (input_ids == VIDEO).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "pixel_values": pixel_values,
        "image_grid_thw": grid_thw,
        "mm_token_type_ids": mm_token_type_ids,
    }


def gemma_batch(config, images_per_row: list[int], seed: int, pad: int = 2) -> dict[str, torch.Tensor]:
    """Gemma 3's layout: <boi> <image>*mm_tokens_per_image <eoi> per image; pixel_values [images, 3, S, S];
    token_type_ids 1 at image tokens (bidirectional attention within each image)."""
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for count in images_per_row:
        tokens = text(generator, 4)
        for _ in range(count):
            tokens += [START] + [IMAGE] * config.mm_tokens_per_image + [END] + text(generator, 3)
        texts.append(tokens)
    input_ids, attention_mask = rows_of(texts, max(len(t) for t in texts) + pad)
    size = config.vision_config.image_size
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "pixel_values": torch.randn(sum(images_per_row), 3, size, size, generator=generator),
        "token_type_ids": (input_ids == IMAGE).long(),
    }
