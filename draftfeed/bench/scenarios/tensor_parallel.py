"""A worker at --tensor-parallel 2 end to end against the same forward at degree 2 in this process, same run.

Both run the tiny Llama sharded by transformers' tensor-parallel plan over two processes (gloo on CPU), one thread
each; the in-process side is the EAGLE-3 task over draftfeed's tensor-parallel engine (this process rank 0), the
other a broker, a worker and its follower. The ratio is in-process time over end-to-end time (goal: 0.9 or more).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from draftfeed.bench.harness import Row, seconds_per_call, token_batch
from draftfeed.launch import processes

DEGREE = 2


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target
    from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
    from draftfeed.consumers.tasks.eagle3 import Eagle3Task
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "tiny-tp", num_hidden_layers=8, hidden_size=256, vocab_size=4096)
    batch = token_batch(4, 256, 4096)
    count = 5 if quick else 20
    os.environ["OMP_NUM_THREADS"] = "1"  # the follower's threads, as the worker's below
    torch.set_num_threads(1)
    engine = TensorParallelEngine("hf", str(target_dir), ["cpu"] * DEGREE, "float32")
    try:
        task = Eagle3Task(engine)
        in_process = seconds_per_call(lambda: task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None), count)
    finally:
        engine.close()
    broker = processes.start_broker(extra=["--log-level", "WARNING"])
    try:
        flags = ["--service", "tiny-tp", "--tensor-parallel", str(DEGREE), "--log-level", "WARNING"]
        worker = processes.start_worker(broker.ready["backend"], str(target_dir), *flags, env={"OMP_NUM_THREADS": "1"})
        try:
            with RemoteEagle3Target(broker.ready["frontend"], "tiny-tp", prefetch_depth=0) as target:
                remote = seconds_per_call(lambda: target.generate_batch(**batch), count)
        finally:
            worker.stop(timeout_s=30)
    finally:
        broker.stop()
    return [
        Row(
            "tensor parallel",
            f"tiny Llama H=256 B=4 S=256 over {DEGREE} processes, one batch at a time: in-process / end to end",
            in_process * 1000,
            remote * 1000,
            "ms",
            f"a worker at --tensor-parallel {DEGREE}, end to end",
            ">= 0.9",
        )
    ]
