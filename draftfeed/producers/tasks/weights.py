"""The target's weights a rank asks its service for: the input and output embeddings, fetched once each, and the
lm_head made of the output embedding's tensor (no copy)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# kind -> rows (None: all) -> the weight, on the rank's device
Fetch = Callable[[str, "torch.Tensor | None"], torch.Tensor]


class TargetWeights:
    """Frozen modules over the weights ``fetch`` gives, each asked for once."""

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch
        self._embeddings: dict[str, nn.Embedding] = {}
        self._lm_head: nn.Linear | None = None

    def embedding(self, kind: str) -> nn.Embedding:
        """``input_embeddings`` or ``output_embeddings`` as a frozen ``nn.Embedding`` ([V, H] weight)."""
        if kind not in self._embeddings:
            self._embeddings[kind] = nn.Embedding.from_pretrained(self._fetch(kind, None), freeze=True)
        return self._embeddings[kind]

    def lm_head(self) -> nn.Linear:
        """A frozen ``nn.Linear`` without bias whose weight [V, H] is the output embedding's tensor."""
        if self._lm_head is None:
            weight = self.embedding("output_embeddings").weight
            head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            head.weight = weight  # a frozen Parameter: no copy
            self._lm_head = head.requires_grad_(False)
        return self._lm_head
