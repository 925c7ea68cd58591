"""NeMo's own model sharded over two processes of the test's own (tests/automodel_reference.py), the reference a worker
of ``--engine automodel --tensor-parallel 2`` is compared with, on one machine (test_automodel_engine.py) and over two
(test_nodes.py)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from conftest import WORKER_ENV

from draftfeed.net import free_port
from support import preload


def sharded_reference(targets: dict[str, Path], out: Path, expert_parallel: bool = True) -> dict[str, torch.Tensor]:
    """Each target's supervision (``NAME/BATCH/TASK/FIELD``) from NeMo's model sharded over two processes, experts over
    both with ``expert_parallel``, NeMo's wrappers around it."""
    from safetensors.torch import load_file

    served = [f"{name}={path}" for name, path in targets.items()]
    args = [str(free_port()), str(out), "1" if expert_parallel else "0", *served]
    preload.run_two_ranks("automodel_reference", args, {**os.environ, **WORKER_ENV}, 200, "NeMo's sharded reference")
    return load_file(str(out))


def nemo_path_env() -> dict[str, str]:
    """A worker's environment with .nemo-packages on its path (its followers inherit it)."""
    from support.nemo import NEMO_PACKAGES

    return {"PYTHONPATH": os.pathsep.join(filter(None, [WORKER_ENV["PYTHONPATH"], str(NEMO_PACKAGES)]))}


def automodel_service(cluster, target: Path, service: str, layer_ids: list[int]) -> str:
    """A worker of ``--engine automodel`` serving ``target``'s DSpark at ``layer_ids`` on ``cluster``: its draftfeed URL."""
    ids = ",".join(map(str, layer_ids))
    flags = ["--engine", "automodel", "--service", service, "--task", "dspark", "--target-layer-ids", ids, "--name", f"{service}-0"]
    cluster.add_worker(target, *flags, env=nemo_path_env())
    return f"draftfeed://{cluster.frontend.removeprefix('tcp://')}/{service}?data_plane=frames"
