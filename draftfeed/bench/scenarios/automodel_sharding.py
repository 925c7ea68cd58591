"""The automodel engine sharded over two processes (NeMo's FSDP and, with --expert-parallel, its expert mesh) against
the same engine in one process, same run: what a rank holds, and what a batch costs.

A tiny DeepSeek-V3 (16 experts, hidden 256, DSpark at 3 layers), B=4 x S=256, float32, one thread a process. Memory:
rank 0's parameter bytes against the whole target's (goal: about 1/2; what sharding is for). Time: a batch over the
two processes against one process; both ranks compute every batch (docs/engines.md, "automodel over processes"), so
on this machine's 2 cores this says what sharding costs, not a speed-up. Needs nemo-automodel importable (the
``automodel`` extra; in this repository ``PYTHONPATH=.nemo-packages``); without it the scenario says so and gives no row.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

from draftfeed.bench.harness import Row, seconds_per_call, token_batch

ROWS, TOKENS, DEGREE = 4, 256, 2
LAYERS = [1, 3, 5]


def run(quick: bool, workdir: Path) -> list[Row]:
    if importlib.util.find_spec("nemo_automodel") is None:
        print(
            "bench: automodel-sharding left out: nemo-automodel is not importable here (pip install 'draftfeed[automodel]'; in this "
            "repository PYTHONPATH=.nemo-packages)",
            file=sys.stderr,
        )
        return []
    from draftfeed.consumers.engines.automodel import AutoModelEngine
    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
    from draftfeed.consumers.tasks.dspark import DSparkTask
    from draftfeed.tiny import build_tiny_target

    target = str(build_tiny_target(workdir / "deepseek-v3", arch="deepseek-v3", num_hidden_layers=6, hidden_size=256, vocab_size=4096))
    batch = token_batch(ROWS, TOKENS, 4096)
    count = 3 if quick else 10
    os.environ["OMP_NUM_THREADS"] = "1"  # the followers' threads, as this process's
    torch.set_num_threads(1)

    def per_batch(engine: object) -> float:
        task = DSparkTask(engine, target_layer_ids=LAYERS)
        return seconds_per_call(lambda: task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]), count)

    one = AutoModelEngine(target, device="cpu", dtype="float32")
    whole = sum(p.numel() * p.element_size() for p in one.model.parameters())
    one_s = per_batch(one)
    del one
    rows: list[Row] = []
    for expert_parallel in (True, False):
        how = "--expert-parallel" if expert_parallel else "FSDP alone"
        engine = TensorParallelEngine("automodel", target, ["cpu"] * DEGREE, "float32", expert_parallel=expert_parallel)
        try:
            two_s = per_batch(engine)
            held = sum(_local(p).numel() * p.element_size() for p in engine.inner.model.parameters())
        finally:
            engine.close()
        rows.append(
            Row(
                "automodel sharding",
                f"--tensor-parallel {DEGREE} {how}: rank 0's parameter bytes / the whole target's",
                held / 1e6,
                whole / 1e6,
                "MB",
                "one process",
                "~ 1/2",
            )
        )
        rows.append(
            Row(
                "automodel sharding",
                f"--tensor-parallel {DEGREE} {how}: a DSpark batch (B=4 S=256) over the processes / in one process",
                two_s * 1000,
                one_s * 1000,
                "ms",
                "one process",
                "none: every rank computes every batch",
            )
        )
    return rows


def _local(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's share of a parameter: its shard, or the whole of one NeMo keeps on every rank."""
    from torch.distributed.tensor import DTensor

    return parameter.to_local() if isinstance(parameter, DTensor) else parameter
