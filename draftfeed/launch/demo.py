"""``draftfeed demo``: a broker, workers on a tiny local target, and a training loop fed through ``iterate``."""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from draftfeed.processes import children, commands
from draftfeed.producers.tasks.eagle3 import RemoteEagle3Target
from draftfeed.progress import Progress
from draftfeed.tiny import build_tiny_target

SERVICE = "tiny-llama-eagle3"


def synthetic_batches(steps: int, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0):
    """Token batches with ragged right padding, as a tokenizing dataloader yields them."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=generator)
        attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        yield {"step": step, "input_ids": input_ids * attention_mask, "attention_mask": attention_mask, "loss_mask": attention_mask.clone()}


def run_demo(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="draftfeed-demo-") as scratch:
        workdir = Path(args.workdir or scratch)
        target_dir = build_tiny_target(workdir / "tiny-llama", num_hidden_layers=8, hidden_size=128, vocab_size=4096)
        print(f"target: tiny random Llama (8 layers, hidden 128, vocab 4096) saved to {target_dir}")
        try:
            broker = commands.start_broker()
            print(f"broker: pid {broker.pid}, ranks -> {broker.ready['frontend']}, workers -> {broker.ready['backend']}")
            _start_workers(broker, target_dir, args.workers)
            return _train(broker.ready["frontend"], args)
        finally:
            children.stop_all()  # every process it started, also a worker still starting; before the folder goes


def _start_workers(broker: commands.Process, target_dir: Path, count: int) -> list[commands.Process]:
    """``count`` workers, started side by side (each spends seconds importing torch); raises the first failure (the
    caller stops what was started). A signal meanwhile does not wait for the workers to be ready."""
    pool = ThreadPoolExecutor(max(count, 1))
    try:
        futures = [
            pool.submit(
                commands.start_worker,
                broker.ready["backend"],
                str(target_dir),
                "--service",
                SERVICE,
                "--name",
                f"demo-worker-{index}",
                env={"OMP_NUM_THREADS": "1"},
            )
            for index in range(count)
        ]
        wait(futures)
    finally:
        pool.shutdown(wait=False)
    workers = [future.result() for future in futures]
    for worker in workers:
        print(f"worker: {worker.ready['worker']} (pid {worker.pid}) serving {SERVICE!r}")
    return workers


def _settled_status(target: RemoteEagle3Target, timeout_s: float = 5.0) -> dict:
    """The broker's status once it has every done of this rank (a worker's done can trail its result)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = target.status()
        me = next(c for c in status["ranks"] if c["rank"] == target.rank_id)
        if me["completed"] == me["submitted"] or time.monotonic() > deadline:
            return status
        time.sleep(0.05)


def _train(frontend: str, args: argparse.Namespace) -> int:
    with RemoteEagle3Target(frontend, service=SERVICE, prefetch_depth=args.prefetch_depth) as target:
        info = target.model_info()
        print(f"model info: {info.num_hidden_layers} layers, hidden {info.hidden_size}, vocab {info.vocab_size}, aux layers {info.aux_layer_ids}")
        draft_vocab = 1024
        selected = torch.arange(draft_vocab, dtype=torch.int64) * (info.vocab_size // draft_vocab)
        mask = torch.zeros(info.vocab_size, dtype=torch.bool)
        mask[selected] = True
        target.set_vocab_mapping(selected, mask)
        embeddings = target.get_input_embeddings().weight
        print(f"draft vocab {draft_vocab} of {info.vocab_size}; input embeddings {list(embeddings.shape)} fetched once")

        # A stand-in draft head: aux hidden states -> draft-vocab logits, trained on the target's probabilities.
        head = torch.nn.Linear(3 * info.hidden_size, draft_vocab)
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-3)
        total_bytes = tokens = 0
        waited = 0.0
        started = time.perf_counter()
        mark = started
        progress = Progress(args.steps, "training steps")
        for batch, sup in target.iterate(synthetic_batches(args.steps, args.batch_size, args.seq_len, info.vocab_size)):
            waited += time.perf_counter() - mark
            log_probs = torch.log_softmax(head(sup.aux_hidden_states), dim=-1)
            per_token = -(sup.target_probs * log_probs).sum(-1)
            weight = sup.position_mask.squeeze(-1).float()
            loss = (per_token * weight).sum() / weight.sum().clamp(min=1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total_bytes += sup.nbytes
            tokens += int(batch["attention_mask"].sum())
            step = batch["step"]
            if step % max(1, args.steps // 8) == 0 or step == args.steps - 1:
                progress.write(f"step {step:4d}  loss {loss.item():8.4f}  supervision {sup.nbytes / 1e6:6.2f} MB  in flight {target.in_flight}")
            progress.advance(note=f"loss {loss.item():.4f}")
            mark = time.perf_counter()
        progress.close()
        elapsed = time.perf_counter() - started
        status = _settled_status(target)
    served = {w["worker"]: w["batches"] for s in status["services"].values() for w in s["workers"]}
    print(
        f"done: {args.steps} steps in {elapsed:.2f} s: {args.steps / elapsed:.1f} steps/s, {tokens / elapsed:,.0f} tokens/s, "
        f"{total_bytes / 1e6:,.1f} MB of supervision ({total_bytes / elapsed / 1e6:,.1f} MB/s); "
        f"rank waited {100 * waited / elapsed:.0f}% of the time"
    )
    print(f"batches served per worker: {served}")
    return 0
