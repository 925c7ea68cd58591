"""The supervision store: its read rate against reading the same bytes with safetensors directly, its bytes per
token on disk in each form, and an epoch replayed from it against the same epoch computed by one worker (and the
same epoch recorded, to show what recording costs the training loop).

The target is the tiny one (8 layers, hidden 64, vocab 1,000): bytes per token scale with hidden size and vocab
(docs/store.md gives them for an 8B target); the rates are this machine's page cache and CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftfeed.bench.harness import Row
from draftfeed.processes import commands

FORMS = ("probs", "probs-bf16", "hidden")
# A batch: 8,192 tokens, about 39 MB of probs-form supervision (an 8B target makes about that much from 260 tokens).
ROWS, SEQ = 8, 1024


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "store-target", num_hidden_layers=8, hidden_size=64, vocab_size=1000)
    count = 6 if quick else 16
    batches = [_batch(seed) for seed in range(count)]
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    forms = ("probs", "hidden") if quick else FORMS
    workers = []
    try:
        workers.extend(_worker(broker, target_dir, form) for form in forms)
        frontend = broker.ready["frontend"]
        rows = _bytes_per_token(frontend, batches[:2], workdir, forms)
        rows += _epochs(frontend, batches, workdir)
    finally:
        for worker in workers:
            worker.stop()
        broker.stop()
    return rows


def _bytes_per_token(frontend: str, batches: list[dict], workdir: Path, forms: tuple[str, ...]) -> list[Row]:
    from draftfeed import RemoteEagle3Target

    per_token: dict[str, float] = {}
    for form in forms:
        path = workdir / f"store-{form}"
        with RemoteEagle3Target(frontend, form, store=path, store_mode="record") as target:
            for _ in target.iterate(batches):
                pass
        on_disk = sum(p.stat().st_size for p in (path / "shards").rglob("*.safetensors"))
        per_token[form] = on_disk / sum(int(b["attention_mask"].sum()) for b in batches)
    return [
        Row(
            "store",
            f"bytes per token on disk, {form} form (tiny target: hidden 64, vocab 1,000)",
            value,
            per_token["probs"],
            "bytes/token",
            "the probs form",
        )
        for form, value in per_token.items()
    ]


def _epochs(frontend: str, batches: list[dict], workdir: Path) -> list[Row]:
    from safetensors import safe_open

    from draftfeed import RemoteEagle3Target

    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    path = workdir / "store-epochs"

    def epoch(**store) -> tuple[float, float]:
        """Seconds of the training loop (every tensor read once, as a trainer would) and of closing the target after it."""
        with RemoteEagle3Target(frontend if store.get("store_mode") != "replay" else None, "probs", prefetch_depth=4, **store) as target:
            started = time.perf_counter()
            for _, supervision in target.iterate(batches):
                for tensor in supervision.as_dict().values():
                    tensor.clone()
            looped = time.perf_counter()
        return looped - started, time.perf_counter() - looped

    computed = min(epoch()[0] for _ in range(2))
    recorded, flushed = epoch(store=path, store_mode="record")
    replayed = min(epoch(store=path, store_mode="replay")[0] for _ in range(3))
    shards = sorted((path / "shards").rglob("*.safetensors"))
    stored_bytes = sum(p.stat().st_size for p in shards)

    def direct() -> float:
        started = time.perf_counter()
        for shard in shards:
            with safe_open(str(shard), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    handle.get_tensor(name).clone()
        return time.perf_counter() - started

    raw = min(direct() for _ in range(3))
    return [
        Row(
            "store",
            f"read rate: {len(batches)} batches replayed through iterate() / the same shards read with safetensors (each tensor read once)",
            stored_bytes / replayed / 1e9,
            stored_bytes / raw / 1e9,
            "GB/s",
            "safetensors directly",
            ">= 0.8",
        ),
        Row("store", "an epoch replayed from the store / computed by one worker", tokens / replayed, tokens / computed, "tokens/s", "computed"),
        Row(
            "store",
            f"an epoch's training loop while recording / without a store (then {flushed:.2f} s to write the last shard at close)",
            tokens / recorded,
            tokens / computed,
            "tokens/s",
            "without a store",
            "about 1",
        ),
    ]


def _worker(broker: commands.Process, target_dir: Path, form: str) -> commands.Process:
    return commands.start_worker(
        broker.ready["backend"],
        str(target_dir),
        "--service",
        form,
        "--supervision",
        form,
        "--log-level",
        "WARNING",
        env={"OMP_NUM_THREADS": "1"},
    )


def _batch(seed: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, 1000, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": torch.ones_like(input_ids)}
