"""The engine interface: what a worker needs from whatever runs the frozen target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from draftfeed.schemas.messages import LogitTransform


@dataclass(frozen=True)
class TargetShape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int


@dataclass(frozen=True)
class Capture:
    """What one forward must return besides nothing at all.

    layer_ids: decoder layers whose output (what the layer returns, after its residual add) is wanted;
    embeddings: the input of decoder layer 0 (``output_hidden_states[0]`` in transformers);
    final_hidden: the final norm's output (post-norm last hidden state);
    logits: the full-vocab logits [B, S, V], with the target's own scaling or soft-capping.
    """

    layer_ids: tuple[int, ...] = ()
    embeddings: bool = False
    final_hidden: bool = False
    logits: bool = False


@dataclass
class ForwardOutput:
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    embeddings: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class Engine(Protocol):
    """Runs the frozen target. The rest of the worker does not know which engine it talks to."""

    name: str
    shape: TargetShape
    device: torch.device
    dtype: torch.dtype
    logit_transform: LogitTransform  # what the target applies to lm_head's output, for ranks that rebuild logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture) -> ForwardOutput:
        """One forward over the batch as given (``use_cache=False``), returning what ``capture`` asks for."""
        ...

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding weight [V, H]."""
        ...

    def output_embeddings(self) -> torch.Tensor:
        """The output embedding (lm_head) weight [V, H]."""
        ...
