"""Batches per second with 1, 2 and 4 synthetic workers against ideal linear scaling."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftfeed.bench.harness import Pipeline, Row


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target

    compute_ms, count = 50, (30 if quick else 120)
    batch = {k: torch.zeros(1, 16, dtype=torch.int64) for k in ("input_ids", "attention_mask", "loss_mask")}
    rows, single = [], None
    for workers in (1, 2, 4):
        with Pipeline(workers=workers, tokens=16, compute_ms=compute_ms, capacity=2) as pipeline:
            with RemoteEagle3Target(pipeline.frontend, "bench", prefetch_depth=2 * workers) as target:
                target.model_info()
                started = time.perf_counter()
                for _ in target.iterate(batch for _ in range(count)):
                    pass
                rate = count / (time.perf_counter() - started)
        single = single or rate
        rows.append(Row("scaling", f"{workers} synthetic workers ({compute_ms} ms each)", rate, single * workers, "batches/s", "ideal linear"))
    return rows
