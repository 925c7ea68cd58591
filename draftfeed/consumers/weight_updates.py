"""New weights for a running target, loaded in place between two requests, all or nothing (docs/versions.md).

An update is a safetensors file, or a folder of them, holding any subset of the target's tensors under the names its
engine gives them (``named_weights``: transformers' state-dict names for the hf engine, as ``save_pretrained``
writes them). Every tensor is checked before any is copied: its name must be one of the target's, its shape and dtype
the same, and, unless the worker skips the finite check, every value finite. The first that is not is named in one
line and nothing changes: the worker keeps serving its old version. Then each is copied into its place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch


def read_update(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of every one in a folder; ValueError in one line if there are none."""
    from safetensors.torch import load_file

    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where] if where.is_file() else []
    if not files:
        raise ValueError(f"weights {path}: no safetensors file there (give a .safetensors file or a folder of them, on the worker's filesystem)")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # a truncated or foreign file: say which
            raise ValueError(f"weights {file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if not tensors:
        raise ValueError(f"weights {path}: the files hold no tensors")
    return tensors


def update_problem(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], check_finite: bool) -> str | None:
    """Why ``new`` cannot replace its tensors of ``current`` (the first tensor that does not fit, named), or None."""
    for name, tensor in new.items():
        held = current.get(name)
        if held is None:
            near = sorted(n for n in current if n.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1])[:2]
            hint = f" (the target has e.g. {', '.join(near)})" if near else ""
            return f"tensor {name}: the target has no tensor of that name{hint}"
        if tuple(tensor.shape) != tuple(held.shape):
            return f"tensor {name}: shape {list(tensor.shape)}, the target's is {list(held.shape)}"
        if tensor.dtype != held.dtype:
            return f"tensor {name}: dtype {tensor.dtype}, the target's is {held.dtype} (convert it before the update)"
        if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {name}: holds NaN or Inf (the worker's finite check is on)"
    return None


@torch.no_grad()
def apply_update(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``new`` into its tensor of ``current`` (checked first: ``update_problem``)."""
    for name, tensor in new.items():
        current[name].copy_(tensor)
