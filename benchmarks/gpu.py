"""GPU measurements for one H200 in one run of under 10 minutes (``--small`` runs the same code on CPU in seconds).

    python benchmarks/gpu.py [--device cuda:0] [--small] [--json out.json]

With an 8B-shaped random-weight Llama in bfloat16 (saved and loaded through the same path users use):
1. the bare forward (B=1, S=2048) against the worker's supervision computation (EAGLE-3, probs and compact
   forms, including the copy to host memory): goal at least 0.9 of the forward's rate;
2. device-to-host copies of one batch's supervision from pinned against pageable memory;
3. the compact form: bytes against the probs form, and the rank-side rebuild of target_probs on the device;
4. end to end: a broker, a worker process on the GPU and a rank process, for both forms;
5. Kimi-K3 on ``--engine automodel`` (NeMo's own model, its KDA layers on the fla package's Triton/CUDA kernels): a
   tiny random-weight Kimi-K3 (draftfeed.tiny) served in process, DSpark against NeMo's ``HFDSparkTargetModel`` around
   the same NeMo model, bit for bit at real positions of a padded batch; on a CPU, or without fla, the engine's one-line
   refusal (NeMo AutoModel on the path: PYTHONPATH=.nemo-packages).
Prints one JSON document (and writes it with --json); a part that fails records its error and the others run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.tasks.eagle3 import Eagle3Task
from draftfeed.contract.compact import CompactEagle3

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, vocab_size=4096),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> float:
    fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - started) / repeat


def build_target(path: Path, shape: str, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.save_pretrained(path)
    del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke run anywhere")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per batch (default 2048; 256 with --small)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-pipeline", action="store_true", help="leave out the end-to-end processes")
    parser.add_argument("--skip-kimi-k3", action="store_true", help="leave out the Kimi-K3 case (part 5)")
    parser.add_argument(
        "--pipeline-forms", default="probs,hidden", help="supervision forms the end-to-end part runs, comma-separated (default: probs,hidden)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    shape = "small" if args.small else "8b"
    seq = args.seq_len or (256 if args.small else 2048)
    repeat = 3 if args.small else 10
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "shape": shape, "batch": [1, seq]}

    with tempfile.TemporaryDirectory(prefix="draftfeed-gpu-") as scratch:
        target = Path(scratch) / f"llama-{shape}"
        started = time.perf_counter()
        build_target(target, shape, device)
        engine = HFEngine(str(target), device=str(device), dtype="auto")
        results["load_s"] = round(time.perf_counter() - started, 1)
        vocab = engine.shape.vocab_size
        input_ids = torch.randint(0, vocab, (1, seq))
        mask = torch.ones_like(input_ids)
        draft = torch.arange(0, vocab, max(1, vocab // 32000))[:32000]
        draft_mask = torch.zeros(vocab, dtype=torch.bool)
        draft_mask[draft] = True
        from draftfeed.contract.vocab import VocabMap

        vocab_map = VocabMap(draft.to(device), draft_mask.to(device))

        # 1. bare forward against the worker's supervision, host copy included
        ids_dev, mask_dev = input_ids.to(device), mask.to(device)
        with torch.inference_mode():
            forward_s = timed(lambda: engine.model(input_ids=ids_dev, attention_mask=mask_dev, use_cache=False), device, repeat)
        results["forward_ms"] = round(forward_s * 1000, 2)
        for form in ("probs", "hidden"):
            task = Eagle3Task(engine, None, form)

            def supervise(task: Eagle3Task = task) -> dict:
                out = task.compute(input_ids, mask, mask, vocab_map)
                return {name: t.cpu() for name, t in out.items()}

            supervision_s = timed(supervise, device, repeat)
            nbytes = sum(t.numel() * t.element_size() for t in supervise().values())
            results[f"supervision_{form}"] = {
                "ms": round(supervision_s * 1000, 2),
                "rate_vs_forward": round(forward_s / supervision_s, 3),
                "bytes": nbytes,
                "gb_per_s": round(nbytes / supervision_s / 1e9, 2),
            }

        # 2. device to host, pinned against pageable, one batch of probs-form supervision
        if device.type == "cuda":
            out = Eagle3Task(engine, None, "probs").compute(input_ids, mask, mask, vocab_map)
            flat = [t.reshape(-1).view(torch.uint8) for t in out.values()]
            total = sum(t.numel() for t in flat)
            pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)

            def to_pinned() -> None:
                offset = 0
                for t in flat:
                    pinned[offset : offset + t.numel()].copy_(t, non_blocking=True)
                    offset += t.numel()

            results["d2h_pinned_gb_per_s"] = round(total / timed(to_pinned, device, repeat) / 1e9, 1)
            results["d2h_pageable_gb_per_s"] = round(total / timed(lambda: [t.cpu() for t in flat], device, repeat) / 1e9, 1)

        # 3. compact form: bytes and the rank-side rebuild on the device
        weight = engine.output_embeddings().index_select(0, draft.to(device))
        compact = CompactEagle3(weight, draft_mask.to(device), engine.logit_transform)
        hidden_out = Eagle3Task(engine, None, "hidden").compute(input_ids, mask, mask, vocab_map)
        rebuild_s = timed(
            lambda: compact.rebuild(hidden_out["final_hidden_states"], hidden_out["target_argmax"], hidden_out["loss_mask"]), device, repeat
        )
        probs_out = Eagle3Task(engine, None, "probs").compute(input_ids, mask, mask, vocab_map)
        rebuilt = compact.rebuild(hidden_out["final_hidden_states"], hidden_out["target_argmax"], hidden_out["loss_mask"])
        results["compact"] = {
            "bytes_ratio_vs_probs": round(results["supervision_probs"]["bytes"] / results["supervision_hidden"]["bytes"], 2),
            "rank_rebuild_ms": round(rebuild_s * 1000, 2),
            "max_abs_diff_target_probs": float((rebuilt["target_probs"] - probs_out["target_probs"]).abs().max()),
            "position_mask_equal": bool(torch.equal(rebuilt["position_mask"], probs_out["position_mask"])),
        }
        engine = probs_out = hidden_out = rebuilt = None  # frees the device memory before the pipeline runs
        if device.type == "cuda":
            torch.cuda.empty_cache()

        # 4. end to end through broker, worker process and rank process
        if not args.skip_pipeline:
            results["pipeline"] = {
                form: pipeline_rate(target, device, seq, form, 4 if args.small else 12, forward_s) for form in args.pipeline_forms.split(",")
            }

        # 5. Kimi-K3 on the automodel engine
        if not args.skip_kimi_k3:
            results["kimi_k3_automodel"] = kimi_k3_case(Path(scratch) / "kimi-k3", device)

    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


KIMI_LAYERS = [0, 2, 3]  # of the tiny Kimi-K3's 4 layers: two KDA layers and the post-norm last one


def kimi_k3_case(path: Path, device: torch.device) -> dict:
    """DSpark of a tiny Kimi-K3 through the automodel engine against NeMo's wrapper around NeMo's model in process:
    the largest difference at real positions of a padded batch (0.0: bit for bit), or the engine's refusal."""
    from draftfeed.consumers.engines.automodel import CPU_BACKEND, AutoModelEngine, kernels_problem
    from draftfeed.consumers.settings import TaskSettings
    from draftfeed.consumers.tasks import load_task
    from draftfeed.tiny import build_tiny_nemo_target

    try:
        from nemo_automodel.components.models.kimi_k3.config import KimiK3Config
        from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel
    except ImportError as exc:
        return {"error": f"NeMo AutoModel is not importable ({exc}): PYTHONPATH=.nemo-packages"}
    problem = kernels_problem(KimiK3Config(), device)
    if problem is not None:  # a CPU, or no fla: what the engine says at start
        return {"refused": problem}
    try:
        started = time.perf_counter()
        build_tiny_nemo_target(path, arch="kimi-k3", device=str(device))
        engine = AutoModelEngine(str(path), device=str(device), dtype="bfloat16", **CPU_BACKEND)
        load_s = time.perf_counter() - started
        input_ids = torch.randint(0, 256, (2, 48))
        mask = torch.ones_like(input_ids)
        mask[1, 40:] = 0
        got = load_task(TaskSettings.of("dspark", KIMI_LAYERS), engine).compute(input_ids, mask, mask)
        want = HFDSparkTargetModel(engine.model, KIMI_LAYERS).generate_batch(input_ids.to(device), mask.to(device), mask.to(device))
        real = mask.bool()
        worst = {
            name: float((got[name].float().cpu() - getattr(want, name).float().cpu())[real].abs().max())
            for name in ("target_hidden_states", "target_last_hidden_states")
        }
        return {"load_s": round(load_s, 1), "largest_difference_at_real_positions": worst}
    except Exception as exc:  # recorded, so that the run's other parts still report
        return {"error": f"{type(exc).__name__}: {exc}"}


RANK = """
import json, sys, time, torch
from draftfeed import RemoteEagle3Target
frontend, seq, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
batch = {"input_ids": torch.randint(0, 1000, (1, seq)), "attention_mask": torch.ones(1, seq, dtype=torch.int64), "loss_mask": torch.ones(1, seq, dtype=torch.int64)}
with RemoteEagle3Target(frontend, "gpu", prefetch_depth=2) as target:
    target.generate_batch(**batch)
    started = time.perf_counter()
    for _ in target.iterate(batch for _ in range(count)):
        pass
    print(json.dumps({"batch_s": (time.perf_counter() - started) / count}))
"""


def pipeline_rate(target: Path, device: torch.device, seq: int, form: str, count: int, forward_s: float) -> dict:
    from draftfeed.processes import commands

    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        worker = commands.start_worker(
            broker.ready["backend"],
            str(target),
            "--service",
            "gpu",
            "--device",
            str(device),
            "--supervision",
            form,
            "--log-level",
            "WARNING",
            ready_timeout_s=300,
        )
        try:
            rank = subprocess.run(
                [sys.executable, "-c", RANK, broker.ready["frontend"], str(seq), str(count)],
                capture_output=True,
                text=True,
                timeout=400,
                env={**os.environ, **env},
            )
            if rank.returncode != 0:
                return {"error": rank.stderr[-2000:]}
            batch_s = json.loads(rank.stdout.strip().splitlines()[-1])["batch_s"]
            return {"batch_ms": round(batch_s * 1000, 2), "rate_vs_forward": round(forward_s / batch_s, 3)}
        finally:
            worker.stop()
    finally:
        broker.stop()


if __name__ == "__main__":
    main()
