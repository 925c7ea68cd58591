"""Which image inputs a transformers target takes, and those inputs made ready for its forward.

The accepted names are the target forward's named parameters (never what ``**kwargs`` might swallow) among the
contract's image inputs (contract/images.py). Llama 4's image-text forward fails at its return in transformers 5.24,
so images are refused for it, with that reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from draftfeed.contract.images import IMAGE_INPUTS

BROKEN_FORWARDS = {
    "Llama4ForConditionalGeneration": (
        "Llama4ForConditionalGeneration's forward fails at its return in this transformers (5.24: 'MoeCausalLMOutputWithPast' has no "
        "image_outputs), so this worker serves it text-only batches: send batches without image inputs"
    ),
}


def accepted_image_inputs(model: nn.Module) -> tuple[frozenset[str], str | None]:
    """The image inputs ``model`` takes by name, and, when it takes none, why (for the refusal)."""
    kind = type(model).__name__
    if kind in BROKEN_FORWARDS:
        return frozenset(), BROKEN_FORWARDS[kind]
    parameters = inspect.signature(model.forward).parameters.values()
    named = {p.name for p in parameters if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}
    accepted = frozenset(named & set(IMAGE_INPUTS))
    return accepted, None if accepted else f"{kind} takes no image inputs (a text-only target): send batches without them"


def forward_images(images: Mapping[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The image inputs on ``device``, pixels in the model's dtype (the processor makes float32), the rest as sent."""
    return {name: tensor.to(device, dtype) if tensor.is_floating_point() else tensor.to(device) for name, tensor in images.items()}
