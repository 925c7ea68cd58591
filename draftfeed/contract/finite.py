"""Supervision is finite (docs/contract.md, "Finite supervision"): the check a worker runs on every tensor it sends.

A target that overflows (float16 activations, a bad shard, a broken kernel) gives NaN or Inf, and a draft trained on
them is silently wrong. The check is one reduction per tensor, on the tensor's own device, that allocates nothing
(``torch.aminmax``: NaN propagates to both ends, and an Inf is one of them); only a tensor that fails is searched for
its first bad element, one slice of at most ``CHECK_ELEMENTS`` elements at a time (a boolean mask of a slice). Padded positions are zeros by the contract, so the first bad element is always
at a real position.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

CHECK_ELEMENTS = 1 << 26  # elements per slice of the search: a 64 MiB boolean mask at most


@dataclass(frozen=True)
class NonFinite:
    """The first NaN or Inf of a batch's supervision: its tensor, its index there (row and position first), its value,
    and the layer id whose slice holds it where the tensor concatenates layers."""

    tensor: str
    index: tuple[int, ...]
    value: str  # "nan", "inf" or "-inf"
    layer: int | None = None

    def describe(self) -> str:
        where = ", ".join(f"{axis} {at}" for axis, at in zip(("row", "position"), self.index)) or "its only element"
        layer = f" (layer {self.layer})" if self.layer is not None else ""
        return f"{self.tensor} holds {self.value} at {where}{layer}"


def _value(number: float) -> str:
    return "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")


def _unravel(flat_index: int, shape: Sequence[int]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat_index % size)
        flat_index //= size
    return tuple(reversed(index))


def _first_in(tensor: torch.Tensor) -> tuple[tuple[int, ...], float] | None:
    """The index and value of the first non-finite element of ``tensor``, or None. One reduction decides (its least
    and greatest values: NaN propagates through both, and Inf is one of them); only a tensor that fails is searched,
    slice by slice."""
    low, high = torch.aminmax(tensor)
    if bool(torch.isfinite(low)) and bool(torch.isfinite(high)):
        return None
    return _search(tensor)


def _search(tensor: torch.Tensor) -> tuple[tuple[int, ...], float] | None:
    """The first non-finite element of a tensor that has one, slice by slice (a mask of a slice at most)."""
    if not tensor.is_contiguous():
        if tensor.dim() > 1:  # each row is a view of its own; its index is prefixed by the row's
            for row in range(tensor.shape[0]):
                found = _search(tensor[row])
                if found is not None:
                    return (row, *found[0]), found[1]
            return None
        tensor = tensor.contiguous()
    flat = tensor.view(-1)
    for start in range(0, flat.numel(), CHECK_ELEMENTS):
        part = flat[start : start + CHECK_ELEMENTS]
        if bool(torch.isfinite(part).all()):
            continue
        offset = int((~torch.isfinite(part)).nonzero()[0, 0])
        return _unravel(start + offset, tensor.shape), float(part[offset])
    return None


def first_nonfinite(
    tensors: Mapping[str, torch.Tensor], layers: Mapping[str, Sequence[int]] | None = None, hidden_size: int | None = None
) -> NonFinite | None:
    """The first NaN or Inf in ``tensors`` (floating ones; in their order), or None when every one is finite.

    ``layers``: for a tensor that concatenates layers along its last dimension, each ``hidden_size`` wide, their ids,
    so the finding names the layer.
    """
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        found = _first_in(tensor.detach())
        if found is None:
            continue
        index, number = found
        ids = (layers or {}).get(name)
        layer = None
        if ids and hidden_size and tensor.dim() >= 2 and tensor.shape[-1] == len(ids) * hidden_size:
            layer = ids[index[-1] // hidden_size]
        return NonFinite(tensor=name, index=index, value=_value(number), layer=layer)
    return None
