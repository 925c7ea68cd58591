"""A training rank that checkpoints and resumes its data: iterates a StatefulDataLoader of token rows through
``iterate()``, checks every supervision against the in-process reference as it comes, and saves the iterator's
state with torch.save after the steps it is told to (then waits to be killed), or resumes from a saved state.

    python -m resume_rank --broker EP --service SVC --target DIR [--num-workers 2] [--shuffle]
        [--checkpoint-at K[,K2]] [--state-dir DIR] [--resume FILE] [--store DIR --store-mode cache]

Prints the ready line, ``BATCH INDEX DIGEST OK|differences`` after each batch (INDEX: its place in the epoch, counting
the batches before a resume), ``SAVED K`` once the state after batch K is on disk, ``STOPPED`` when it waits to be
killed, and, having finished the epoch, ``DONE {json}`` (its store's hits and misses, the batches the broker took
from it to workers, or the error).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import torch
from reference import difference, make_batch, reference_eagle3
from torch.utils.data import Dataset

from draftfeed import RemoteEagle3Target
from draftfeed.processes.ready import announce_ready

AUX_LAYER_IDS = [1, 3, 4]  # the default for the 8-layer tiny target
ROWS, SEQ, BATCH_SIZE = 24, 16, 2  # 12 batches an epoch
SEED = 7100
KILL_WAIT_S = 600.0  # the longest a stopped rank waits for its SIGKILL


class TokenRows(Dataset):
    """Tokenized rows (right-padded, ragged): row i of make_batch(ROWS, SEQ, 1000, SEED)."""

    def __init__(self) -> None:
        self.rows = make_batch(ROWS, SEQ, 1000, seed=SEED)

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: tensor[index] for name, tensor in self.rows.items()}


def make_loader(num_workers: int, shuffle: bool):
    """The dataloader every run of a test makes alike: batches are dicts of input_ids, attention_mask, loss_mask."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(SEED) if shuffle else None
    return StatefulDataLoader(TokenRows(), batch_size=BATCH_SIZE, shuffle=shuffle, generator=generator, num_workers=num_workers)


def digest(batch) -> str:
    """A batch's identity: its tokens and masks, hashed."""
    hashed = hashlib.blake2b(digest_size=8)
    for name in ("input_ids", "attention_mask", "loss_mask"):
        hashed.update(batch[name].contiguous().numpy().tobytes())
    return hashed.hexdigest()


def state_file(folder: str, step: int) -> Path:
    return Path(folder) / f"state-{step}.pt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--checkpoint-at", default="", help="steps after which to save the state (comma-separated); stop after the last")
    parser.add_argument("--state-dir", default=".")
    parser.add_argument("--resume", default=None, help="a saved state to resume from")
    parser.add_argument("--store", default=None)
    parser.add_argument("--store-mode", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the workers' thread count: the reference is bit-exact only under the same
    checkpoints = [int(step) for step in args.checkpoint_at.split(",") if step]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    store = {"store": args.store, "store_mode": args.store_mode} if args.store else {}
    done: dict = {"error": None}
    try:
        with RemoteEagle3Target(args.broker, args.service, prefetch_depth=args.depth, wait_log_interval=1.0, **store) as target:
            target.model_info()
            announce_ready(role="rank", rank=target.rank_id)
            iteration = target.iterate(make_loader(args.num_workers, args.shuffle))
            if args.resume:
                iteration.load_state_dict(torch.load(args.resume, weights_only=True))
            for batch, supervision in iteration:
                index = iteration.batches_yielded - 1
                expected = reference_eagle3(model, batch, AUX_LAYER_IDS)
                got = supervision.as_dict()
                found = [p for name, tensor in expected.items() if (p := difference(name, got[name], tensor)) is not None]
                if set(got) != set(expected):
                    found.append(f"fields {sorted(got)}, expected {sorted(expected)}")
                print(f"BATCH {index} {digest(batch)} {'; '.join(found) or 'OK'}", flush=True)
                if index in checkpoints:
                    path = state_file(args.state_dir, index)
                    torch.save(iteration.state_dict(), path.with_suffix(".partial"))
                    os.replace(path.with_suffix(".partial"), path)
                    print(f"SAVED {index}", flush=True)
                    if index == checkpoints[-1]:
                        print("STOPPED", flush=True)
                        threading.Event().wait(KILL_WAIT_S)  # the test kills it here, batches still in flight
                        return 1
            status = target.status()
            done["store"] = status.get("store")
            done["submitted"] = next(rank["submitted"] for rank in status["ranks"] if rank["rank"] == target.rank_id)
    except Exception as exc:  # reported in the DONE line, for the test to show
        done["error"] = f"{type(exc).__name__}: {exc}"
    print(f"DONE {json.dumps(done)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
