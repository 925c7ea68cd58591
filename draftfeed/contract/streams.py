"""Layers that carry several residual streams (hyper-connections), as the contract reads them.

DeepSeek-V4's decoder layers keep ``hc_mult`` residual streams: the embedding output is copied into each of them
before layer 0, every decoder layer takes and returns ``[B, S, hc_mult, H]``, and the model folds the streams into
one (its ``hc_head``) before the final norm, whose output is ``[B, S, H]`` as in any other target. A task reads such a
layer as NeMo AutoModel's own wrapper of that task does (docs/contract.md, "Targets with several residual streams"):
DSpark folds an intermediate layer's streams into their mean (``mean_streams``) and takes the embedding output as it
was before it was copied (``first_stream``: each stream holds it, bit for bit); EAGLE-3 and DFlash keep a layer's
streams as the layer gives them. A tensor of one stream, ``[B, S, H]``, passes through both unchanged.
"""

from __future__ import annotations

import torch

STREAM_DIM = 2  # [B, S, streams, H]


def has_streams(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 4


def mean_streams(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, S, N, H]`` -> ``[B, S, H]``, the mean over the streams; a ``[B, S, H]`` tensor as it is."""
    return tensor.mean(dim=STREAM_DIM) if has_streams(tensor) else tensor


def first_stream(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, S, N, H]`` -> ``[B, S, H]``, the first stream: for the embedding output, which every stream holds a copy of,
    that output itself; a ``[B, S, H]`` tensor as it is."""
    return tensor.select(STREAM_DIM, 0) if has_streams(tensor) else tensor
