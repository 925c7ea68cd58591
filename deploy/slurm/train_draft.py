"""A small EAGLE-3 draft training loop for torchrun, fed by draftfeed workers through a broker.

It stands for your own trainer: every rank opens a ``RemoteEagle3Target`` on the broker, shares the draft
vocabulary with the workers, and trains a stand-in draft head on the supervision that ``iterate()`` yields for its
own shard of the data, in the shard's order. The head is wrapped in DistributedDataParallel, so gradients go
across the ranks as in a real job; the supervision never does (each rank receives its own from the workers).

Run by deploy/slurm/node.sh (``torchrun ... train_draft.py``); where the broker is comes from the environment the
sbatch script exports:

    DF_BROKER_HOST        the broker's host (the job's first node)
    DF_FRONTEND_PORT      the broker's rank port (5555)
    DF_SERVICE            the service the workers serve
    DF_WAIT_FOR_WORKERS   seconds a rank waits for a first worker (models take a while to load; 1800)
    DF_BROKER_TIMEOUT     seconds a rank waits for the broker to answer (120)

``--summary-dir DIR`` makes every rank write ``rank<R>.json`` (what it trained on and received) and, with
``--save-batches N``, ``rank<R>-batches.pt`` (its first N batches and their supervision), for checking a run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from draftfeed import RemoteEagle3Target
from draftfeed.launch.demo import synthetic_batches


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps per rank")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per batch")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per row")
    parser.add_argument("--prefetch-depth", type=int, default=2, help="batches in flight per rank")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="tokens of the draft's vocabulary (at most the target's)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--summary-dir", default=None, help="write rank<R>.json here")
    parser.add_argument("--save-batches", type=int, default=0, help="with --summary-dir: also save this many batches and their supervision")
    return parser.parse_args()


def broker_endpoint() -> str:
    host = os.environ.get("DF_BROKER_HOST")
    if not host:
        raise SystemExit("train_draft.py: DF_BROKER_HOST is not set (the sbatch script exports it: the job's first node)")
    return f"tcp://{host}:{os.environ.get('DF_FRONTEND_PORT', '5555')}"


def draft_vocabulary(vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (V // size)-th token as the draft's vocabulary. A real EAGLE-3 draft takes the most frequent tokens of
    its training data instead; the workers only need the ids and the mask."""
    size = min(size, vocab_size)
    selected = torch.arange(size, dtype=torch.int64) * (vocab_size // size)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[selected] = True
    return selected, mask


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial head on every rank, as DDP expects

    service = os.environ.get("DF_SERVICE", "")
    with RemoteEagle3Target(
        broker_endpoint(),
        service=service,
        prefetch_depth=args.prefetch_depth,
        device=device if cuda else None,  # CUDA ranks on a worker's machine get supervision over NCCL
        connect_timeout=float(os.environ.get("DF_BROKER_TIMEOUT", "120")),
        wait_for_workers=float(os.environ.get("DF_WAIT_FOR_WORKERS", "1800")),
    ) as target:
        info = target.model_info()
        selected, mask = draft_vocabulary(info.vocab_size, args.draft_vocab)
        target.set_vocab_mapping(selected, mask)
        if rank == 0:
            print(f"rank 0: {service} at {broker_endpoint()}: {info.num_hidden_layers} layers, hidden {info.hidden_size}, ", end="")
            print(f"vocab {info.vocab_size}, aux layers {info.aux_layer_ids}; draft vocab {len(selected)}; {world} ranks", flush=True)

        # A stand-in for the draft: aux hidden states -> draft-vocab logits, trained on the target's probabilities.
        head = torch.nn.Linear(3 * info.hidden_size, len(selected)).to(device)
        model = torch.nn.parallel.DistributedDataParallel(head, device_ids=[local_rank] if cuda else None)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

        # Your tokenized DataLoader goes here, sharded by rank (a DistributedSampler): iterate() takes any iterable of
        # dicts with input_ids, attention_mask and loss_mask, and yields each batch with its supervision in its order.
        dataloader = synthetic_batches(args.steps, args.batch_size, args.seq_len, info.vocab_size, seed=rank)
        steps, losses, saved = [], [], []
        received = waited = 0.0
        mark = started = time.perf_counter()
        for batch, sup in target.iterate(dataloader):
            waited += time.perf_counter() - mark
            log_probs = torch.log_softmax(model(sup.aux_hidden_states.to(device)), dim=-1)
            per_token = -(sup.target_probs.to(device) * log_probs).sum(-1)
            weight = sup.position_mask.to(device).squeeze(-1).float()
            loss = (per_token * weight).sum() / weight.sum().clamp(min=1)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps.append(batch["step"])
            losses.append(loss.item())
            received += sup.nbytes
            if len(saved) < args.save_batches:
                keep = {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}
                saved.append({"batch": keep, "supervision": {k: v.cpu() for k, v in sup.as_dict().items()}})
            if rank == 0 and (batch["step"] % max(1, args.steps // 10) == 0 or batch["step"] == args.steps - 1):
                print(f"rank 0: step {batch['step']:5d}  loss {loss.item():.4f}  in flight {target.in_flight}", flush=True)
            mark = time.perf_counter()
        elapsed = time.perf_counter() - started
        rank_id = target.rank_id

    if args.summary_dir:
        out = Path(args.summary_dir)
        out.mkdir(parents=True, exist_ok=True)
        if saved:
            torch.save(saved, out / f"rank{rank}-batches.pt")
        summary = {
            "rank": rank,
            "world_size": world,
            "rank_id": rank_id,
            "service": service,
            "model_info": info.model_dump(),
            "draft_vocab": len(selected),
            "steps": steps,
            "losses": losses,
            "supervision_bytes": received,
            "seconds": elapsed,
            "waited_seconds": waited,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(summary, indent=2))
    dist.barrier()
    if rank == 0:
        print(f"rank 0: done, {len(steps)} steps in {elapsed:.1f} s, waited {100 * waited / max(elapsed, 1e-9):.0f}% of it", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
