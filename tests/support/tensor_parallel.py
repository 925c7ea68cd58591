"""The tensor-parallel reference (tests/tp_reference.py run in two processes of the test's own, forked from the suite's preloader) that workers at
--tensor-parallel 2 are compared with, on one machine (test_tensor_parallel.py) and over two (test_nodes.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from conftest import WORKER_ENV

from draftfeed.net import free_port
from support import preload

# Each target's task, the targets in the reference file's order: EAGLE-3 on the dense target, DSpark on the MoE one
# (the engine makes the same calls for every task: a forward with a capture).
SERVED = {"llama": "eagle3", "deepseek-v3": "dspark"}
TARGETS = {name: index for index, name in enumerate(SERVED)}


def shared_tensor_parallel_reference(targets: dict[str, Path], folder: Path) -> dict[str, torch.Tensor]:
    """``tensor_parallel_reference``, computed once in ``folder`` for every process of the suite that asks (the suite's
    xdist workers share the folder; the targets are built alike in each): the first to come computes it under a lock,
    the others wait for it and read it."""
    import fcntl

    from safetensors.torch import load_file

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "tensor-parallel-reference.safetensors"
    with open(folder / "tensor-parallel-reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held while computing: at most the reference's own 240 s
        if not out.exists():
            computed = folder / "tensor-parallel-reference.partial.safetensors"
            tensor_parallel_reference(targets, computed)
            computed.rename(out)
    return load_file(out)


def tensor_parallel_reference(targets: dict[str, Path], out: Path) -> dict[str, torch.Tensor]:
    """Every batch's supervision, for the task each target is served for, from two processes of transformers' plan."""
    from safetensors.torch import load_file

    port = free_port()
    env = {**os.environ, **WORKER_ENV}
    paths = [f"{SERVED[name]}={targets[name]}" for name in TARGETS]
    preload.run_two_ranks("tp_reference", [str(port), str(out), *paths], env, 240, "the tensor-parallel reference")  # tests/ is on PYTHONPATH
    return load_file(out)


def expected(reference: dict[str, torch.Tensor], target: str, task: str, batch: str) -> dict[str, torch.Tensor]:
    prefix = f"{TARGETS[target]}/{task}/{batch}/"
    return {key[len(prefix) :]: value for key, value in reference.items() if key.startswith(prefix)}
