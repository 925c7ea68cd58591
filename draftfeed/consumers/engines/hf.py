"""The reference engine: the target under transformers, intermediate tensors caught by forward hooks."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import nn

from draftfeed.consumers.config import DTYPES
from draftfeed.consumers.engines.base import Capture, ForwardOutput, TargetShape
from draftfeed.schemas.messages import LogitTransform


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on accelerators, as the supervision contract says."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose {', '.join(DTYPES)}")
    return choices[dtype]


def text_decoder(model: nn.Module) -> nn.Module:
    """The text decoder of a causal LM (the language model of a multimodal one): the module with ``layers``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for candidate in (decoder, getattr(decoder, "language_model", None), getattr(decoder, "text_model", None)):
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; the hf engine expects a decoder with .layers")


class HFEngine:
    """Loads a causal LM with ``AutoModelForCausalLM`` once, frozen and in eval mode."""

    name = "hf"

    def __init__(self, target: str, device: str = "cpu", dtype: str = "auto") -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        text_config = model.config.get_text_config()
        self.shape = TargetShape.from_text_config(text_config)
        self.logit_transform = LogitTransform.from_text_config(text_config)
        decoder = text_decoder(self.model)
        self.layers: nn.ModuleList = decoder.layers
        self.final_norm: nn.Module | None = getattr(decoder, "norm", None)

    def prepare(self, captures: Sequence[Capture]) -> None:
        """Nothing to do: hooks are placed per forward, and every layer can be caught."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture) -> ForwardOutput:
        out = ForwardOutput()
        with ExitStack() as hooks:
            for layer_id in capture.layer_ids:
                hooks.callback(self.layers[layer_id].register_forward_hook(self._store_layer(out, layer_id)).remove)
            if capture.embeddings:
                hooks.callback(self.layers[0].register_forward_pre_hook(self._store_embeddings(out), with_kwargs=True).remove)
            if capture.final_hidden:
                if self.final_norm is None:
                    raise ValueError(f"{type(self.model).__name__} has no final norm module (decoder.norm) to capture")
                hooks.callback(self.final_norm.register_forward_hook(self._store_final(out)).remove)
            result = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                use_cache=False,
                # Without logits wanted, compute them for one position only (the lm_head over all is wasted work).
                logits_to_keep=0 if capture.logits else 1,
            )
        if capture.logits:
            out.logits = result.logits
        return out

    @staticmethod
    def _store_layer(out: ForwardOutput, layer_id: int):
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            out.layer_outputs[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @staticmethod
    def _store_embeddings(out: ForwardOutput):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            out.embeddings = args[0] if args else kwargs["hidden_states"]

        return hook

    @staticmethod
    def _store_final(out: ForwardOutput):
        def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> None:
            out.final_hidden = output

        return hook

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()

    def output_embeddings(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()
