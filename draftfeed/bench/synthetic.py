"""A synthetic EAGLE-3 worker for benchmarks: fixed-size supervision after a fixed compute time, no model.

Named synthetic because it is: it measures the pipeline around a target, not a target. Run as
``python -m draftfeed.bench.synthetic --broker ... --service ... --tokens N --compute-ms M``.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import get_args

import torch

from draftfeed.consumers.engines.base import TargetShape
from draftfeed.consumers.settings import TargetSettings, WorkerSettings
from draftfeed.consumers.tasks.base import Task, TaskBatch
from draftfeed.consumers.worker import Worker
from draftfeed.processes.ready import announce_ready
from draftfeed.schemas.messages import DataPlaneMode, Eagle3TargetInfo, LogitTransform
from draftfeed.security.curve import PeerKeys

# An 8B target's shape (Llama-3.1-8B: H = 4096, 32 layers) with a 32k draft vocabulary:
# per token, aux bf16 [3H] = 24 KiB and fp32 probs [32000] = 125 KB, 312.5 MB for 2048 tokens.
HIDDEN, LAYERS, DRAFT_VOCAB = 4096, 32, 32000
BYTES_PER_TOKEN = 3 * HIDDEN * 2 + DRAFT_VOCAB * 4 + 1 + 8 + 8


def tokens_for(payload_bytes: int) -> int:
    return max(1, round(payload_bytes / BYTES_PER_TOKEN))


class SyntheticEngine:
    name = "synthetic"
    device = torch.device("cpu")
    dtype = torch.bfloat16
    logit_transform = LogitTransform()
    shape = TargetShape(num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=DRAFT_VOCAB)

    def input_embeddings(self) -> torch.Tensor:
        return torch.zeros(DRAFT_VOCAB, HIDDEN, dtype=torch.bfloat16)

    output_embeddings = input_embeddings


class SyntheticEagle3Task(Task):
    """Returns the same preallocated supervision for every batch of ``tokens`` tokens, after ``compute_s``."""

    name = "eagle3"
    INFO = Eagle3TargetInfo
    supervision = "probs"

    def __init__(self, tokens: int, compute_s: float) -> None:
        super().__init__(SyntheticEngine())  # type: ignore[arg-type]
        self.logit_transform = LogitTransform()
        self.compute_s = compute_s
        generator = torch.Generator().manual_seed(0)
        self.cached = {
            "aux_hidden_states": torch.randn(1, tokens, 3 * HIDDEN, generator=generator).to(torch.bfloat16),
            "target_probs": torch.rand(1, tokens, DRAFT_VOCAB, generator=generator),
            "position_mask": torch.ones(1, tokens, 1, dtype=torch.bool),
            "input_ids": torch.zeros(1, tokens, dtype=torch.int64),
            "loss_mask": torch.ones(1, tokens, dtype=torch.int64),
        }

    def info_fields(self) -> dict[str, object]:
        return {"aux_layer_ids": [1, 15, 28]}

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        deadline = time.perf_counter() + self.compute_s
        while time.perf_counter() < deadline:  # a GPU forward keeps the host thread waiting, not computing
            time.sleep(min(0.001, max(0.0, deadline - time.perf_counter())))
        return self.cached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftfeed.bench.synthetic", description=__doc__)
    parser.add_argument("--broker", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    defaults = WorkerSettings.model_fields
    parser.add_argument("--capacity", type=int, default=defaults["capacity"].default)
    parser.add_argument("--name", default=None)
    parser.add_argument("--data-plane", default=defaults["data_plane"].default, choices=get_args(DataPlaneMode))
    parser.add_argument("--keys", default=None, help="a folder from `draftfeed keys generate`: CURVE with its worker key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    worker = Worker(
        SyntheticEagle3Task(args.tokens, args.compute_ms / 1000),
        WorkerSettings(
            broker=args.broker,
            service=args.service,
            target=TargetSettings(path="synthetic"),  # no target: SyntheticEagle3Task makes its supervision
            capacity=args.capacity,
            name=args.name,
            data_plane=args.data_plane,
            keys=PeerKeys.from_folder(args.keys, "worker") if args.keys else None,
        ),
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    worker.run(on_ready=lambda: announce_ready(role="worker", worker=worker.name, service=args.service))
    return 0


if __name__ == "__main__":
    sys.exit(main())
