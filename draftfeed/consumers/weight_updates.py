"""New weights for a running target, loaded in place between two requests, all or nothing (docs/versions.md).

An update is any subset of the target's tensors under the names its engine gives them (``named_weights``:
transformers' state-dict names for the hf engine, as ``save_pretrained`` writes them), from a safetensors file or a
folder of them on the worker's filesystem, or pulled from a publisher's memory (dataplane/weights/worker.py). From a
file, every tensor is checked before any is copied: its name must be one of the target's, its shape and dtype the
same, and, unless the worker skips the finite check, every value finite; the first that is not is named in one line
(``UpdateRefused``) and nothing changes. Then each is copied into its place; a tensor sharded over a tensor-parallel
group (a DTensor) takes its own shard of the whole tensor (dataplane/weights/place.py), on every process of the group,
each of which reads the file, or pulls the update, itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from draftfeed.dataplane.weights.place import place
from draftfeed.dataplane.weights.worker import UpdateBroken, UpdateRefused, pull_keys, pull_update, tensor_problem
from draftfeed.schemas.messages import UpdateWeights
from draftfeed.security.keys import KeyPair

__all__ = ["UpdateBroken", "UpdateRefused", "apply_update", "load_update", "read_update", "update_files", "update_problem"]


def update_files(path: str) -> list[Path]:
    """A safetensors file, or every one in a folder; UpdateRefused in one line if there are none."""
    where = Path(path)
    files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where] if where.is_file() else []
    if not files:
        raise UpdateRefused(f"weights {path}: no safetensors file there (give a .safetensors file or a folder of them, on the worker's filesystem)")
    return files


def read_update(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or of every one in a folder; UpdateRefused in one line if there are none."""
    from safetensors.torch import load_file

    files = update_files(path)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # a truncated or foreign file: say which
            raise UpdateRefused(f"weights {file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if not tensors:
        raise UpdateRefused(f"weights {path}: the files hold no tensors")
    return tensors


def update_problem(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], check_finite: bool) -> str | None:
    """Why ``new`` cannot replace its tensors of ``current`` (the first tensor that does not fit, named), or None."""
    for name, tensor in new.items():
        if (problem := tensor_problem(current, name, list(tensor.shape), tensor.dtype)) is not None:
            return problem
        if check_finite and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return f"tensor {name}: holds NaN or Inf (the worker's finite check is on)"
    return None


def apply_update(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``new`` into its tensor of ``current`` (checked first: ``update_problem``); a DTensor takes its own
    shard of the whole tensor (every process of its group holds the whole tensor read from the file)."""
    for name, tensor in new.items():
        place(current[name], tensor)


def load_update(
    current: Mapping[str, torch.Tensor], message: UpdateWeights, check_finite: bool, timeout_s: float, keys: KeyPair | None = None
) -> None:
    """The update ``message`` names, into ``current`` in place: UpdateRefused when nothing was written, UpdateBroken when
    a pull broke off after some was (``timeout_s``: the longest wait for one part of a pulled update; ``keys``: this
    worker's pair, for an encrypted publisher)."""
    if message.source is not None:
        pull_update(message.source, message.update, current, check_finite, timeout_s, pull_keys(message.source_key, keys))
        return
    new = read_update(message.weights or "")
    problem = update_problem(current, new, check_finite)
    if problem is not None:
        raise UpdateRefused(problem)
    apply_update(current, new)
