"""Writing an update's whole tensor into the target's tensor of that name, in place: the one place where a tensor
sharded over a tensor-parallel group (a DTensor) keeps its own shard, for updates from a file
(consumers/weight_updates.py) and pulled ones (worker.py) alike."""

from __future__ import annotations

import torch


def local(held: torch.Tensor) -> torch.Tensor:
    """The part of ``held`` this process holds: a DTensor's own shard, else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return held.to_local() if isinstance(held, DTensor) else held


def is_sharded(held: torch.Tensor) -> bool:
    """Whether ``held`` is a DTensor: this process holds only its own part of it."""
    from torch.distributed.tensor import DTensor

    return isinstance(held, DTensor)


@torch.no_grad()
def place(held: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy ``whole`` (the update's tensor, its shape and dtype those of ``held``) into ``held`` in place; a DTensor
    takes its own shard of it, cut here over its mesh and placements (``distribute_tensor`` with no source rank: every
    process of the group holds the whole tensor, so nothing is communicated)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(held, DTensor):
        shard = distribute_tensor(whole.to(held.device), held.device_mesh, held.placements, src_data_rank=None)
        held.to_local().copy_(shard.to_local())
    else:
        held.copy_(whole)
