"""Which image inputs a transformers target takes, those inputs made ready for its forward, and the forward itself.

The accepted names are the target forward's named parameters (never what ``**kwargs`` might swallow) among the
contract's image inputs (contract/images.py). Each row's image tokens are checked to be its own images'. Llama 4's
image-text forward fails at its return in transformers 5.24 (``'MoeCausalLMOutputWithPast' object has no attribute
'image_outputs'``), after everything has run: its image batches run the model's own merge (image features put in at
the image tokens of the input embeddings) and then its nested causal LM, the same computation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from draftfeed.contract.images import IMAGE_INPUTS
from draftfeed.schemas.errors import BadRequest


def accepted_image_inputs(model: nn.Module) -> tuple[frozenset[str], str | None]:
    """The image inputs ``model`` takes by name, and, when it takes none, why (for the refusal)."""
    kind = type(model).__name__
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    accepted = frozenset(named & set(IMAGE_INPUTS))
    return accepted, None if accepted else f"{kind} takes no image inputs (a text-only target): send batches without them"


def image_forward(model: nn.Module) -> Callable[..., Any]:
    """What runs a batch with images: the model's own forward, but Llama 4's merge and nested causal LM (above)."""
    if type(model).__name__ == "Llama4ForConditionalGeneration":
        return lambda **inputs: _llama4_forward(model, **inputs)
    return model


def _llama4_forward(model: Any, input_ids: torch.Tensor, pixel_values: torch.Tensor, **kwargs: Any) -> Any:
    embeddings = model.get_input_embeddings()(input_ids)
    features = model.get_image_features(pixel_values=pixel_values, return_dict=True).last_hidden_state
    features = model.multi_modal_projector(features.view(-1, features.size(-1))).to(embeddings.device, embeddings.dtype)
    mask = model.get_placeholder_mask(input_ids, inputs_embeds=embeddings, image_features=features)  # checks the total
    return model.language_model(inputs_embeds=embeddings.masked_scatter(mask, features), **kwargs)


PIXELS = ("pixel_values", "pixel_values_videos")


def forward_images(images: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The image inputs on ``device``, pixels in the model's dtype (the processor makes float32), the rest as sent
    (``second_per_grid_ts`` stays in its own precision: it scales positions)."""
    return {name: tensor.to(device, dtype) if name in PIXELS else tensor.to(device) for name, tensor in images.items()}


# (token id attribute of the config, grid, pixels): the kinds of visual input whose tokens stand for whole images.
VISUAL_KINDS = (("image_token_id", "image_grid_thw", "pixel_values"), ("video_token_id", "video_grid_thw", "pixel_values_videos"))


def check_image_rows(config: object, input_ids: torch.Tensor, images: Mapping[str, torch.Tensor]) -> None:
    """BadRequest unless each row's image tokens are exactly its own images' (the batch's images taken in row order).

    Targets check only the batch's total (features are scattered over the image tokens of the whole batch), so a
    row with an image token too many beside one with one too few would get another row's image features, silently.
    Checked where the tokens an image takes are known: Qwen-VL's grids (t x h x w / merge^2), Gemma 3's fixed
    ``mm_tokens_per_image``, and Llama 4's tiles ((size / patch)^2 x pixel_shuffle_ratio^2 each)."""
    for token_attr, grid_name, pixels_name in VISUAL_KINDS:
        token_id = getattr(config, token_attr, None)
        if token_id is None or pixels_name not in images:
            continue
        per_image = _tokens_per_image(config, images, grid_name, pixels_name)
        if per_image is None:
            continue
        rows = (input_ids == token_id).sum(dim=1).tolist()
        if sum(rows) != sum(per_image):
            raise BadRequest(
                f"the batch holds {sum(rows)} {pixels_name} tokens (id {token_id}) but its {len(per_image)} images take {sum(per_image)}: "
                "each image needs as many tokens as its features"
            )
        taken = 0
        for row, count in enumerate(rows):
            need = 0
            while need < count:
                need += per_image[taken]
                taken += 1
            if need != count:
                raise BadRequest(
                    f"row {row} holds {count} {pixels_name} tokens, which do not end where an image ends (the batch's images, in row "
                    f"order, take {per_image}): give each row the tokens of its own images"
                )


def _tokens_per_image(config: object, images: Mapping[str, torch.Tensor], grid_name: str, pixels_name: str) -> list[int] | None:
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    if grid_name in images and merge:
        return (images[grid_name].long().prod(-1) // merge**2).tolist()
    shuffle = getattr(vision, "pixel_shuffle_ratio", None)
    if shuffle and images[pixels_name].dim() == 4:  # Llama 4: [tiles, 3, size, size], each tile whole
        per_tile = int((vision.image_size // vision.patch_size) ** 2 * shuffle**2)  # type: ignore[union-attr]
        return [per_tile] * images[pixels_name].shape[0]
    per_image = getattr(config, "mm_tokens_per_image", None)
    if per_image and grid_name not in images and images[pixels_name].dim() == 4:  # Gemma 3: [images, 3, size, size]
        return [int(per_image)] * images[pixels_name].shape[0]
    return None
