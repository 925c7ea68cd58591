"""How long the training loop waits for supervision at each prefetch depth, against waiting the whole time."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftfeed.bench.harness import Pipeline, Row


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target

    steps, step_s, compute_ms = (20, 0.03, 20) if quick else (60, 0.03, 20)
    rows = []
    with Pipeline(workers=1, tokens=64, compute_ms=compute_ms) as pipeline:
        batch = {k: torch.zeros(1, 64, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
        for depth in (0, 1, 2, 4):
            with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=depth) as target:
                target.model_info()
                batches = target.iterate(batch for _ in range(steps + 1))
                next(batches)  # the first batch cannot have been prefetched: steady state starts after it
                waited = 0.0
                started = mark = time.perf_counter()
                for _ in batches:
                    waited += time.perf_counter() - mark
                    time.sleep(step_s)  # the training step
                    mark = time.perf_counter()
                total = time.perf_counter() - started
            rows.append(
                Row(
                    "overlap",
                    f"depth {depth}: the training loop waits, steady state (step {step_s * 1000:.0f} ms, worker {compute_ms} ms)",
                    100 * waited / total,
                    100.0,
                    "% of time",
                    "waiting the whole time",
                    "< 2% at depth >= 2",
                )
            )
    return rows
