"""A training rank in a process of its own (on a host of draftfeed/bench/hosts.py, or beside others): iterates a fixed list of
batches and, once done, checks every result against the in-process computation, here, under the workers' thread count.

    python -m rank_process --broker tcp://10.79.0.1:5555 --service svc --target DIR --batches 400 [--task dspark]
        [--draft-vocab 300] [--form probs|hidden] [--seed 5000] [--data-plane auto|frames|nixl]
        [--store DIR --store-mode record|cache --store-shard-bytes N]

Prints the ready line once set up, ``batch N`` after each batch, and at the end one ``RESULT {json}`` line:
how many batches came, whether in order, the differences found (where and how large), how many came over nixl,
the rank's data endpoint, the longest wait for one batch and the requests sent again because the broker had lost
track of them (``lost_resent``), or the error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
from reference import difference, draft_vocab, make_batch, reference_dspark, reference_eagle3
from support.lines import say

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.processes.ready import announce_ready

AUX_LAYER_IDS = [1, 3, 4]  # the default for the 8-layer tiny target
DSPARK_LAYER_IDS = [1, 3, 4, 6, 7]
COMPACT_TOLERANCE = 1e-6  # the compact form with a draft vocab: the rank's matmul over fewer rows


def rank_batches(seed: int, count: int) -> list[dict[str, torch.Tensor]]:
    """The batches a rank process started with ``--seed SEED --batches COUNT`` iterates, in order."""
    return [make_batch(2, 16, 1000, seed=seed + i) for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--task", default="eagle3", choices=["eagle3", "dspark"])
    parser.add_argument("--form", default="probs", choices=["probs", "hidden"])
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--draft-vocab", type=int, default=0)
    parser.add_argument("--seed", type=int, default=5000, help="the first batch's seed; each rank of a test its own")
    parser.add_argument("--data-plane", default="auto")
    parser.add_argument("--store", default=None)
    parser.add_argument("--store-mode", default=None)
    parser.add_argument("--store-shard-bytes", type=int, default=256 << 20)
    parser.add_argument("--leave-open", action="store_true", help="never close the target: the process's exit must")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    batches = rank_batches(args.seed, args.batches)
    mapping = draft_vocab(args.draft_vocab) if args.draft_vocab else None
    results = []
    error = None
    planes = {}
    longest_wait = 0.0
    cls = RemoteEagle3Target if args.task == "eagle3" else RemoteDSparkTarget
    try:
        store = {"store": args.store, "store_mode": args.store_mode, "store_shard_bytes": args.store_shard_bytes} if args.store else {}
        target = cls(args.broker, args.service, prefetch_depth=args.depth, wait_log_interval=1.0, data_plane=args.data_plane, **store)
        try:
            target.model_info()
            if mapping is not None:
                target.set_vocab_mapping(*mapping)
            announce_ready(role="rank", rank=target.rank_id)
            asked = time.monotonic()
            for index, (batch, supervision) in enumerate(target.iterate(batches)):
                longest_wait = max(longest_wait, time.monotonic() - asked)
                results.append((batch, supervision))
                say(f"batch {index}")
                asked = time.monotonic()
            stats = target.connection_stats
            planes = {"over_nixl": stats.received_over_nixl, "data_endpoint": target.data_endpoint, "lost_resent": stats.lost_resent}
        finally:
            if not args.leave_open:
                target.close()
    except Exception as exc:  # reported in the result line, for the test to show
        error = f"{type(exc).__name__}: {exc}"
    say(f"RESULT {json.dumps(check(args, batches, mapping, results, error) | planes | {'longest_wait_s': round(longest_wait, 3)})}")
    return 0


def check(args, batches, mapping, results, error) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    in_order = all(got is sent for (got, _), sent in zip(results, batches))
    differences = []
    for index, (batch, supervision) in enumerate(results):
        if args.task == "eagle3":
            expected = reference_eagle3(model, batch, AUX_LAYER_IDS, *(mapping or ()))
        else:
            expected = reference_dspark(model, batch, DSPARK_LAYER_IDS)
        got = supervision.as_dict()
        for name, tensor in expected.items():
            if args.form == "hidden" and mapping is not None and name == "target_probs" and got[name].shape == tensor.shape:
                gap = (got[name] - tensor).abs().max().item()
                found = None if gap <= COMPACT_TOLERANCE else f"target_probs: largest |difference| {gap:.3g} over {COMPACT_TOLERANCE}"
            else:
                found = difference(name, got[name], tensor)
            if found is not None:
                differences.append(f"batch {index}: {found}")
    return {"received": len(results), "sent": len(batches), "in_order": in_order, "differences": differences[:20], "error": error}


if __name__ == "__main__":
    sys.exit(main())
