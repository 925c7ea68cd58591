"""The supervision contract computed in-process over 2 processes, the target sharded by transformers' own
tensor-parallel plan: the reference a worker at ``--tensor-parallel 2`` is compared with (tests/test_tensor_parallel.py).

Run as ``python tp_reference.py RANK PORT OUT TASK=TARGET [TASK=TARGET ...]`` in two processes (ranks 0 and 1, gloo over a store
rank 0 hosts on 127.0.0.1:PORT); both make every call in the same order, and rank 0 writes the results to OUT (safetensors,
keys ``TARGET_INDEX/TASK/BATCH/FIELD``). Written from transformers' documented API and tests/reference.py, not from
the worker's code.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
from reference import make_batch, make_packed_batch, reference_dspark, reference_eagle3

AUX = [1, 3, 4]  # EAGLE-3's default ids on an 8-layer target
DSPARK_IDS = [1, 3, 4, 6, 7]  # DSpark's default ids on an 8-layer target
VOCAB = 1000


def batches() -> dict[str, dict[str, torch.Tensor]]:
    """Every batch the tests send to a worker at --tensor-parallel 2, by name."""
    named = {f"plain-{i}": make_batch(3, 21, VOCAB, seed=70 + i) for i in range(3)}
    named["full"] = make_batch(1, 9, VOCAB, seed=75, ragged=False)
    named |= {f"packed-{i}": make_packed_batch([[12, 9, 16], [40]], pad=[3, 0], vocab_size=VOCAB, seed=80 + i) for i in range(2)}
    named |= {f"run-{i}": make_batch(2, 16, VOCAB, seed=90 + i) for i in range(12)}
    return named


def main(rank: int, port: int, out: str, served: list[str]) -> None:
    """``served``: TASK=TARGET, each target's index its place in the list."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from draftfeed.consumers.engines.loading import load_target, transformers_config
    from draftfeed.consumers.engines.plan_fixes import distributed_config

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    results: dict[str, torch.Tensor] = {}
    for index, (task, target) in enumerate(item.split("=", 1) for item in served):
        # The class the worker loads (an image-text one where the config is), under the plan it runs (plan_fixes.py).
        config = transformers_config(target)
        model = load_target(target, config=config, dtype=torch.float32, distributed_config=distributed_config(config, 2)).eval()
        for name, batch in batches().items():
            if index > 0 and name.startswith("run-"):
                continue  # the run batches go to the first target alone
            supervision = reference_eagle3(model, batch, AUX) if task == "eagle3" else reference_dspark(model, batch, DSPARK_IDS)
            results |= {f"{index}/{task}/{name}/{field}": tensor.contiguous().clone() for field, tensor in supervision.items()}
        for which in ("input", "output"):
            weight = (model.get_input_embeddings() if which == "input" else model.get_output_embeddings()).weight.detach()
            results[f"{index}/weights/{which}"] = weight.full_tensor()
    if rank == 0:
        save_file(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:])
