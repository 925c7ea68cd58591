"""A training rank in a process of its own, on a host of draftfeed/bench/hosts.py: iterates named batches of
tests/tp_reference.py (or of ``--batches``, another reference module's) and saves what it received, for the test to
compare with the tensor-parallel reference.

    python tp_rank.py --broker tcp://10.79.0.1:5555 --service svc --task eagle3|dspark --names run-0,run-1 --out FILE

Prints the ready line once set up, ``batch N`` after each batch (so that a test can strike mid-run), then
``RESULT {json}``: the names in the order the batches came, and the error if the run failed. The supervision is in
FILE (safetensors, keys ``NAME/FIELD``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys

import torch
from support.lines import say

from draftfeed import RemoteDSparkTarget, RemoteEagle3Target
from draftfeed.processes.ready import announce_ready


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--service", required=True)
    parser.add_argument("--task", default="eagle3", choices=["eagle3", "dspark"])
    parser.add_argument("--names", required=True)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="tp_reference", help="the reference module whose batches() these are")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    named = importlib.import_module(args.batches).batches()
    names = args.names.split(",")
    received: dict[str, torch.Tensor] = {}
    order: list[str] = []
    error = None
    cls = RemoteEagle3Target if args.task == "eagle3" else RemoteDSparkTarget
    try:
        with cls(args.broker, args.service, prefetch_depth=args.depth, wait_for_workers=240) as remote:
            announce_ready(role="rank", rank=remote.rank_id)
            remote.model_info()
            lookup = {id(named[name]): name for name in names}
            for index, (batch, supervision) in enumerate(remote.iterate(named[name] for name in names)):
                name = lookup[id(batch)]
                order.append(name)
                received |= {f"{name}/{field}": tensor.contiguous().clone() for field, tensor in supervision.as_dict().items()}
                say(f"batch {index + 1}")
    except Exception as exc:  # reported in the result, for the test to show
        error = f"{type(exc).__name__}: {exc}"
    save_file(received, args.out)
    say("RESULT " + json.dumps({"order": order, "error": error}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
