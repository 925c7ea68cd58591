"""The vllm engine against the hf engine on one target, in one run: EAGLE-3 supervision per batch.

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python benchmarks/engines.py [--device cpu] [--layers 8 --hidden 128]
        [--batch 4 --seq 256] [--repeat 10] [--target PATH]

Builds a random-weight Llama (or loads --target), then times ``Eagle3Task.compute`` on the same batches
under both engines and reports vllm's time as a ratio of hf's, with the share of vllm's time spent reading
its hidden-states files (vLLM hands captured layers over through one file per request). Needs vLLM
installed (`make venv-vllm`); the vllm engine's start-up is reported apart, not in the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftfeed.consumers.engines import load_engine
from draftfeed.consumers.tasks import load_task
from draftfeed.tiny import build_tiny_target


def timed_compute(task, batches, repeat: int) -> float:
    """Median seconds per batch over ``repeat`` passes (the first batch is a warm-up)."""
    task.compute(*batches[0])
    times = []
    for _ in range(repeat):
        for batch in batches:
            started = time.perf_counter()
            task.compute(*batch)
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default=None, help="a local model folder (default: build a tiny Llama)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="draftfeed-engines-") as workdir:
        target = args.target or str(
            build_tiny_target(Path(workdir) / "target", num_hidden_layers=args.layers, hidden_size=args.hidden, vocab_size=args.vocab)
        )
        generator = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(4):
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
            mask = torch.ones_like(ids)
            batches.append((ids, mask, mask.clone(), None))
        hf_task = load_task("eagle3", load_engine("hf", target, args.device, "auto"))
        hf_s = timed_compute(hf_task, batches, args.repeat)
        started = time.perf_counter()
        engine = load_engine("vllm", target, args.device, "auto")
        vllm_task = load_task("eagle3", engine)
        start_s = time.perf_counter() - started
        load_s = []
        original_load = engine._load

        def counted_load(output, token_ids):
            begun = time.perf_counter()
            try:
                return original_load(output, token_ids)
            finally:
                load_s.append(time.perf_counter() - begun)

        engine._load = counted_load
        vllm_s = timed_compute(vllm_task, batches, args.repeat)
        file_share = sum(load_s) / max(1e-12, vllm_s * (len(batches) * args.repeat + 1))
        version = engine._vllm.__version__
        engine.close()
    result = {
        "shape": f"L={args.layers} H={args.hidden} V={args.vocab}, B={args.batch} S={args.seq}, {args.device}",
        "vllm_version": version,
        "hf_ms_per_batch": round(hf_s * 1000, 2),
        "vllm_ms_per_batch": round(vllm_s * 1000, 2),
        "vllm_over_hf": round(vllm_s / hf_s, 3),
        "vllm_share_reading_files": round(file_share, 3),
        "vllm_start_s": round(start_s, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
