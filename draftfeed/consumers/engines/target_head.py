"""The ends of a target without its decoder layers: input embeddings, final norm and lm_head.

Engines that return hidden states but no logits (vLLM) rebuild the rest with the target's own modules,
loaded by transformers from the target's checkpoint with the decoder depth set to zero, so that the
weights, the norm's arithmetic (Gemma's ``1 + w``) and the key names are transformers' own and the
decoder layers are never read.
"""

from __future__ import annotations

import torch
from torch import nn

from draftfeed.consumers.engines.base import TargetShape
from draftfeed.consumers.engines.loading import load_target, text_decoder, transformers_config
from draftfeed.contract.ops import transform_logits
from draftfeed.schemas.messages import LogitTransform


class TargetHead:
    """``embed_tokens``, the final norm and ``lm_head`` of a target (a causal LM or an image-text model), frozen, on one device."""

    def __init__(self, target: str, device: torch.device, dtype: torch.dtype) -> None:
        from transformers.utils import logging as hf_logging

        config = transformers_config(target)
        text_config = config.get_text_config()
        self.shape = TargetShape.from_text_config(text_config)
        self.logit_transform = LogitTransform.from_text_config(text_config)
        text_config.num_hidden_layers = 0
        if getattr(text_config, "layer_types", None) is not None:
            text_config.layer_types = []
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the decoder layers' weights are skipped on purpose: no load report
        try:
            model = load_target(target, config=config, dtype=dtype, device_map={"": device})  # straight onto the device
        finally:
            hf_logging.set_verbosity(verbosity)
        model = model.eval().requires_grad_(False)
        decoder = text_decoder(model)
        norm = getattr(decoder, "norm", None)
        if not isinstance(norm, nn.Module):
            raise ValueError(f"{type(model).__name__} has no final norm module (decoder.norm); this engine rebuilds logits with it")
        self.norm: nn.Module = norm
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self._model = model

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Its tensors by their state-dict names, the checkpoint's (a weight update copies into them)."""
        return dict(self._model.state_dict())

    @torch.inference_mode()
    def final_hidden(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """The final norm's output from its input (the last decoder layer's output)."""
        return self.norm(pre_norm)

    @torch.inference_mode()
    def logits(self, final_hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits: ``lm_head`` of the post-norm hidden state, then its scaling or soft-capping."""
        return transform_logits(self.lm_head(final_hidden), self.logit_transform)
