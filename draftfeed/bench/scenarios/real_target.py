"""A tiny Llama target computed in process against the same batches end to end through the pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from draftfeed.bench.harness import Row, seconds_per_call, token_batch
from draftfeed.processes import commands


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target
    from draftfeed.consumers.engines.hf import HFEngine
    from draftfeed.consumers.tasks.eagle3 import Eagle3Task
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "tiny", num_hidden_layers=8, hidden_size=128, vocab_size=4096)
    batch = token_batch(4, 256, 4096)
    count = 10 if quick else 40
    torch.set_num_threads(1)
    task = Eagle3Task(HFEngine(str(target_dir)))
    in_process = seconds_per_call(lambda: task.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], None), count)
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        worker = commands.start_worker(
            broker.ready["backend"], str(target_dir), "--service", "tiny", "--log-level", "WARNING", env={"OMP_NUM_THREADS": "1"}
        )
        try:
            with RemoteEagle3Target(broker.ready["frontend"], "tiny", prefetch_depth=0) as target:
                remote = seconds_per_call(lambda: target.generate_batch(**batch), count)
        finally:
            worker.stop()
    finally:
        broker.stop()
    return [
        Row(
            "real target",
            "tiny Llama B=4 S=256, one batch at a time: in-process / end to end",
            in_process * 1000,
            remote * 1000,
            "ms",
            "end to end through the pipeline",
        )
    ]
