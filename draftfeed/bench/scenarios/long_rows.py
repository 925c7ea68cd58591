"""Long rows: tokens per second at S = 2k to 16k through the pipeline against the same row computed in process,
and a worker's peak memory (VmHWM) serving one 16,384-token row with its vocab-sized step chunked and whole.

The target is tiny in depth and width but has a 32,000-token vocabulary and a 2,000-token draft vocabulary, so that
the vocab-sized step (full-vocab logits for every position) is what a long row's memory is made of.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from draftfeed.bench.harness import Row
from draftfeed.processes import commands

VOCAB, DRAFT = 32_000, 2_000
LONGEST = 16_384
CHUNK_TOKENS = 1_024  # the chunked worker of the memory rows


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed import RemoteEagle3Target
    from draftfeed.consumers.engines.hf import HFEngine
    from draftfeed.consumers.tasks.eagle3 import Eagle3Task
    from draftfeed.contract.vocab import VocabMap
    from draftfeed.tiny import build_tiny_target

    target_dir = build_tiny_target(workdir / "long", num_hidden_layers=8, hidden_size=64, vocab_size=VOCAB, max_position_embeddings=LONGEST)
    draft_ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT]
    draft_mask = torch.zeros(VOCAB, dtype=torch.bool)
    draft_mask[draft_ids] = True
    lengths = [2048, 4096] if quick else [2048, 4096, 8192, LONGEST]
    rows: list[Row] = []
    torch.set_num_threads(1)
    in_process = Eagle3Task(HFEngine(str(target_dir)), chunk_tokens=CHUNK_TOKENS)
    vocab_map = VocabMap(draft_ids, draft_mask)
    broker = commands.start_broker(extra=["--log-level", "WARNING"])
    try:
        chunked = _worker(broker, target_dir, "chunked", CHUNK_TOKENS)
        whole = None if quick else _worker(broker, target_dir, "whole", 0)
        try:
            with RemoteEagle3Target(broker.ready["frontend"], "chunked", prefetch_depth=0) as target:
                target.set_vocab_mapping(draft_ids, draft_mask)
                for seq in lengths:
                    batch = _row(seq)
                    target.generate_batch(**_row(128))
                    started = time.perf_counter()
                    target.generate_batch(**batch)
                    remote = time.perf_counter() - started
                    started = time.perf_counter()
                    in_process.compute(batch["input_ids"], batch["attention_mask"], batch["loss_mask"], vocab_map)
                    local = time.perf_counter() - started
                    rows.append(
                        Row(
                            "long rows",
                            f"one row of S={seq}, V={VOCAB}, draft {DRAFT}: tokens/s end to end (--chunk-tokens {CHUNK_TOKENS})",
                            seq / remote,
                            seq / local,
                            "tokens/s",
                            "the same row in process",
                        )
                    )
            peak_chunked = _peak_kib(chunked)
            if whole is not None:
                with RemoteEagle3Target(broker.ready["frontend"], "whole", prefetch_depth=0) as target:
                    target.set_vocab_mapping(draft_ids, draft_mask)
                    target.generate_batch(**_row(LONGEST))
                peak_whole = _peak_kib(whole)
                rows.append(
                    Row(
                        "long rows",
                        f"worker peak resident memory (VmHWM) serving S={LONGEST}: --chunk-tokens {CHUNK_TOKENS} / --chunk-tokens 0",
                        peak_chunked / 1024,
                        peak_whole / 1024,
                        "MiB",
                        "the same worker computing the row whole",
                        "bounded by the chunk",
                    )
                )
        finally:
            chunked.stop()
            if whole is not None:
                whole.stop()
    finally:
        broker.stop()
    return rows


def _worker(broker: commands.Process, target_dir: Path, service: str, chunk_tokens: int) -> commands.Process:
    return commands.start_worker(
        broker.ready["backend"],
        str(target_dir),
        "--service",
        service,
        "--chunk-tokens",
        str(chunk_tokens),
        "--capacity",
        "1",
        "--log-level",
        "WARNING",
        env={"OMP_NUM_THREADS": "1"},
    )


def _row(seq: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "loss_mask": torch.ones_like(input_ids)}


def _peak_kib(process: commands.Process) -> int:
    """The process's peak resident set (VmHWM), in KiB."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    found = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    assert found is not None, "no VmHWM in /proc/PID/status"
    return int(found.group(1))
