"""speculators' trainer on draftfeed against the same trainer on its offline files: the time it waits for its samples
(speculators' own ``fetch_ms``, the time from a step's end to its next batch on the device) and its step time, from the
same data and the same steps, on the same machine. The offline files are what the service served, written as
speculators' hs_{i}.safetensors. Runs where speculators is
installed (make test puts it in .venv-vllm); elsewhere it is left out, said on stderr."""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from draftfeed.bench.harness import Row
from draftfeed.bench.speculators_run import read_metrics
from draftfeed.processes import commands

LAYERS, HIDDEN, VOCAB = 8, 256, 2000
SPECULATORS_IDS, DFLASH_IDS = [2, 4, 5], [1, 3, 4, 7]
ROW_TOKENS = 512
# The target's forward would share this machine's cores with the trainer, which offline files never do: the workers
# run FakeFrontierEngine (no model; hidden states of the verifier's shape from a formula), so what the trainer waits
# for is the pipeline alone. The offline files hold the same fake's values.
FAKE_TARGET = [
    "--engine", "draftfeed.bench.frontier:FakeFrontierEngine", "--dtype", "float32",
    "--engine-option", f"hidden_size={HIDDEN}", "--engine-option", f"num_hidden_layers={LAYERS}", "--engine-option", f"vocab_size={VOCAB}",
]  # fmt: skip


def run(quick: bool, workdir: Path) -> list[Row]:
    if importlib.util.find_spec("speculators") is None or importlib.util.find_spec("datasets") is None:
        print(
            "bench: speculators left out: speculators is not installed in this environment "
            "(run `.venv-vllm/bin/python -m draftfeed bench --scenario speculators`)",
            file=sys.stderr,
        )
        return []
    from safetensors.torch import save_file

    from draftfeed.integrations.speculators.samples import row_batch, to_sample
    from draftfeed.producers.tasks.dflash import RemoteDFlashTarget
    from draftfeed.tiny import build_tiny_target

    rows, steps = (24, 10) if quick else (96, 40)
    verifier = build_tiny_target(workdir / "verifier", num_hidden_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB)
    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB - 1, (ROW_TOKENS,), generator=generator) for _ in range(rows)]
    offline_data, served_data = _data_sets(workdir, tokens)
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        worker_flags = ["--task", "dflash", "--target-layer-ids", ",".join(map(str, DFLASH_IDS)), "--service", "bench-speculators", *FAKE_TARGET]
        worker = commands.start_worker(broker.ready["backend"], str(verifier), *worker_flags, "--log-level", "WARNING", env={"OMP_NUM_THREADS": "1"})
        try:
            with RemoteDFlashTarget(broker.ready["frontend"], "bench-speculators") as target:
                for index, row in enumerate(tokens):  # the offline files: what a data-generation run writes
                    sample = to_sample(target.generate_batch(**row_batch(row)).hidden_states, row, HIDDEN)
                    save_file(sample, str(offline_data / "hidden_states" / f"hs_{index}.safetensors"))
            url = f"draftfeed://{broker.ready['frontend'].removeprefix('tcp://')}/bench-speculators"
            offline = _train(workdir / "run-offline", verifier, steps, ["--data-path", str(offline_data)])
            served_args = ["--data-path", str(served_data), "--hidden-states-backend", "draftfeed", "--draftfeed-url", url]
            served = _train(workdir / "run-served", verifier, steps, served_args)
        finally:
            worker.stop(timeout_s=10)
    finally:
        broker.stop()
    shape = f"eagle3, {steps} steps of 2 rows x {ROW_TOKENS} tokens, target H={HIDDEN}, {LAYERS} layers"
    offline_name = "the same run on its offline files"
    return [
        Row(
            "speculators",
            f"trainer waits for its samples (fetch_ms a step, steps 2..): {shape}",
            served["fetch"],
            offline["fetch"],
            "ms",
            offline_name,
        ),
        Row(
            "speculators",
            "the wait draftfeed adds, against the offline step",
            served["fetch"] - offline["fetch"],
            offline["step"],
            "ms",
            "the offline step_ms",
            "<= 0.05",
        ),
        Row("speculators", "step time (step_ms a step, steps 2..), the same runs", served["step"], offline["step"], "ms", offline_name),
    ]


def _data_sets(workdir: Path, tokens: list[torch.Tensor]) -> tuple[Path, Path]:
    from datasets import Dataset

    columns = {
        "input_ids": [row.tolist() for row in tokens],
        "loss_mask": [[1] * len(row) for row in tokens],
        "seq_len": [len(row) for row in tokens],
    }
    paths = workdir / "offline", workdir / "served"
    for path in paths:
        Dataset.from_dict(columns).with_format("torch").save_to_disk(str(path))
    (paths[0] / "hidden_states").mkdir()
    return paths


def _flags(verifier: Path, steps: int, out: Path) -> list[str]:
    return [
        "--verifier-name-or-path", str(verifier), "--speculator-type", "eagle3",
        "--target-layer-ids", *map(str, SPECULATORS_IDS), "--mask-token-id", str(VOCAB - 1),
        "--hidden-states-dtype", "float32", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
        "--total-seq-len", str(2 * ROW_TOKENS), "--train-data-ratio", "0.9", "--epochs", "1", "--max-steps", str(steps),
        "--num-workers", "0", "--seed", "0", "--on-missing", "raise", "--save-path", str(out / "checkpoint"),
    ]  # fmt: skip


def _train(out: Path, verifier: Path, steps: int, args: list[str]) -> dict[str, float]:
    """One run's mean fetch and step time in ms, the first step (which opens everything) left out. Each run has a
    folder of its own: one that found another's checkpoint at its --save-path would resume from it."""
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    command = [sys.executable, "-m", "draftfeed.bench.speculators_run", str(metrics), *_flags(verifier, steps, out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"speculators' trainer failed: {done.stderr[-2000:]}")
    steps, _val = read_metrics(metrics)
    profiles = [step["profile"] for step in steps[1:] if step.get("profile")]
    if not profiles:
        raise RuntimeError("speculators logged no step profiles")
    return {"fetch": statistics.mean(p["fetch_ms"] for p in profiles), "step": statistics.mean(p["step_ms"] for p in profiles)}
