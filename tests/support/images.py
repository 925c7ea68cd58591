"""Image-text batches as the processors of the tiny image-text targets (draftfeed.tiny) lay them out: Qwen2.5-VL's,
Gemma 3's and Llama 4's, rows of text and images, right-padded; and Llama 4's image-text model in-process."""

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


def llama4_batch(config, tiles_per_row: list[int], seed: int, pad: int = 2) -> dict[str, torch.Tensor]:
    """Llama 4's layout: <image> x tokens-per-tile for each tile of a row's images (the boi, eoi and tile separators
    are plain text, left out here); pixel_values [tiles, 3, size, size] over the batch's tiles in row order."""
    vision, generator = config.vision_config, torch.Generator().manual_seed(seed)
    per_tile = int((vision.image_size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)
    texts = [text(generator, 4) + [START] + [IMAGE] * per_tile * tiles + [END] + text(generator, 3) for tiles in tiles_per_row]
    input_ids, attention_mask = rows_of(texts, max(len(t) for t in texts) + pad)
    loss_mask = attention_mask.clone()
    loss_mask[:, :3] = 0
    pixels = torch.randn(sum(tiles_per_row), 3, vision.image_size, vision.image_size, generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, "pixel_values": pixels}


class Llama4InProcess(torch.nn.Module):
    """Llama 4's image-text model in-process, as its forward computes it up to the line where transformers 5.24's
    fails (its return): the image features put in at the image tokens of the input embeddings, then its language
    model (research notes of issue 28; the same decoder layers, found by tests/reference.py at language_model)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner, self.language_model = model, model.language_model

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inner.get_input_embeddings()

    def forward(self, input_ids, attention_mask, pixel_values, **kwargs):
        inner = self.inner
        embeds = inner.get_input_embeddings()(input_ids)
        features = inner.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
        flat = inner.multi_modal_projector(features.view(-1, features.size(-1)))
        embeds = embeds.masked_scatter((input_ids == inner.config.image_token_id).unsqueeze(-1).expand_as(embeds), flat)
        return self.language_model(inputs_embeds=embeds, attention_mask=attention_mask, **kwargs)
