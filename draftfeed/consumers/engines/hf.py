"""The reference engine: the target under transformers, decoder layer outputs caught by forward hooks."""

from __future__ import annotations

import torch
from torch import nn

from draftfeed.consumers.engines.base import ForwardOutput, TargetShape


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU and bfloat16 on accelerators, as the supervision contract says."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"--dtype {dtype!r} is not supported; choose auto, {', '.join(choices)}")
    return choices[dtype]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer stack of a causal LM (text model of a multimodal one included)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for candidate in (decoder, getattr(decoder, "language_model", None), getattr(decoder, "text_model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}; the hf engine expects model.layers")


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
        self.shape = TargetShape(
            num_hidden_layers=text_config.num_hidden_layers,
            hidden_size=text_config.hidden_size,
            vocab_size=text_config.vocab_size,
        )
        self.layers = decoder_layers(self.model)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]) -> ForwardOutput:
        captured: dict[int, torch.Tensor] = {}
        handles = [self.layers[i].register_forward_hook(self._catch(i, captured)) for i in layer_ids]
        try:
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                use_cache=False,
            )
        finally:
            for handle in handles:
                handle.remove()
        return ForwardOutput(layer_outputs=captured, logits=out.logits)

    @staticmethod
    def _catch(layer_id: int, captured: dict[int, torch.Tensor]):
        def hook(_module: nn.Module, _inputs: object, output: object) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def input_embeddings(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight.detach()
