"""Frontier rows: samples of 1, 4 and 16 GB (DSpark, five layers of a 7168-wide target and its last hidden state, in
bfloat16: a 64k row is 5.6 GB, a 128k row 11.3 GB) from a worker to a rank, against raw pyzmq moving the same bytes
between two processes, and the rank's peak memory per sample.

The worker runs FakeFrontierEngine (bench/frontier.py: no model) behind the real DSpark task; the rank is
``python -m draftfeed.bench.frontier``, which checks every byte, at prefetch 0, so that nothing else runs while a
sample moves. The rate is the sample's bytes over the time from its header to its last piece at the rank (the
worker's compute is not in it); the baseline receives one message of the same size as raw pyzmq. A size is left out, and said so on stderr, where this machine's memory cannot hold a sample at
the worker (its tensors once, and a layer on its way), two at the rank and the baseline's at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from draftfeed.bench.frontier import HIDDEN, resident_bytes
from draftfeed.bench.harness import Row
from draftfeed.bench.scenarios.data_plane import raw_rate
from draftfeed.processes import commands

LAYER_IDS = "1,15,30,45,60"
BYTES_PER_TOKEN = 6 * HIDDEN * 2  # five layers and the last hidden state, bfloat16
GB = 1 << 30
SAMPLE_GB = (1, 4, 16)
HELD = 5  # samples' worth of memory a size needs: worker 1.2 (the sample, a layer on its way), rank 1, the baseline's 1, spares


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed.tiny import build_tiny_target

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sizes = [size for size in ((1,) if quick else SAMPLE_GB) if HELD * size * GB <= total]
    for size in set((1,) if quick else SAMPLE_GB) - set(sizes):
        print(
            f"frontier-rows: {size} GB samples left out: this machine has {total / GB:.0f} GiB, a run needs about {HELD * size} GiB", file=sys.stderr
        )
    target = build_tiny_target(workdir / "frontier-config")  # read for nothing: the fake engine has its own shape
    rows: list[Row] = []
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    worker = None
    try:
        worker = commands.start_worker(
            broker.ready["backend"],
            str(target),
            "--engine",
            "draftfeed.bench.frontier:FakeFrontierEngine",
            "--task",
            "dspark",
            "--target-layer-ids",
            LAYER_IDS,
            "--service",
            "frontier",
            "--capacity",
            "1",
            "--log-level",
            "WARNING",
        )
        for size in sizes:
            tokens = size * GB // BYTES_PER_TOKEN
            Path(f"/proc/{worker.popen.pid}/clear_refs").write_text("5")
            idle = resident_bytes(worker.popen.pid)
            ours = _rank(broker.ready["frontend"], tokens, count=3)
            worker_peak = resident_bytes(worker.popen.pid, "VmHWM") - idle
            nbytes = ours["bytes"]
            raw = raw_rate(nbytes, 2, None)
            case = f"{nbytes / 1e9:.2f} GB sample ({tokens} tokens x 6 x {HIDDEN}, bf16) worker -> rank, frames"
            rows.append(
                Row("frontier", case, ours["transfer_bytes_per_s"] / 1e9, raw["bytes_per_s"] / 1e9, "GB/s", "raw pyzmq, one message", ">= 0.8")
            )
            rows.append(
                Row(
                    "frontier",
                    f"rank peak memory, {nbytes / 1e9:.2f} GB samples at prefetch 0",
                    ours["peak_above_baseline"] / nbytes,
                    1.0,
                    "samples",
                    "the sample",
                )
            )
            rows.append(Row("frontier", f"worker peak memory, {nbytes / 1e9:.2f} GB samples", worker_peak / nbytes, 1.0, "samples", "the sample"))
    finally:
        if worker is not None:
            worker.stop()
        broker.stop()
    return rows


def _rank(frontend: str, tokens: int, count: int) -> dict:
    args = [sys.executable, "-m", "draftfeed.bench.frontier", frontend, "frontier", str(tokens), str(count), "0", LAYER_IDS, "--data-plane", "frames"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the frontier rank failed: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["difference"] is not None:
        raise RuntimeError(f"the frontier rank received wrong bytes: {result['difference']}")
    return result
