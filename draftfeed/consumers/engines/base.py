"""The engine interface: what a worker needs from whatever runs the frozen target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TargetShape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


@dataclass
class ForwardOutput:
    """One forward pass: the outputs of the requested decoder layers and the full-vocab logits [B, S, V]."""

    layer_outputs: dict[int, torch.Tensor]
    logits: torch.Tensor


class Engine(Protocol):
    """Runs the frozen target. The rest of the worker does not know which engine it talks to."""

    name: str
    shape: TargetShape
    device: torch.device
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]) -> ForwardOutput:
        """One forward with ``use_cache=False``; layer_outputs[i] is the output of decoder layer i."""
        ...

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding weight [V, H]."""
        ...
