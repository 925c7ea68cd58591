"""Each mixture-of-experts family of ``draftfeed.tiny.MOE_ARCHS`` (and ``HYPER_CONNECTION_ARCHS``) under transformers' own
tensor-parallel plan at degree 2, and under its expert-parallel plan beside it (``--tensor-parallel 2 --expert-parallel``:
ep_size 2 too), against the plain forward at degree 1, on a padded batch: one JSON line per family and plan on rank 0's
stdout, ``{"family", "plan", "layers", "logits"}`` (the largest |difference| at real positions over layers 1, 3 and 5,
and over the logits) or ``{"family", "plan", "fails": the error}`` when the plan cannot run the batch.

Run as ``python tp_families.py RANK PORT FOLDER [FAMILY ...]`` in two processes (the tiny targets built in FOLDER by
the test). Written from transformers' documented API, not from the worker's code.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch

LAYERS = (1, 3, 5)


def forward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    layers = model.get_decoder().layers
    caught: dict[str, torch.Tensor] = {}
    handles = [
        layers[i].register_forward_hook(lambda _m, _i, out, i=i: caught.__setitem__(f"layer {i}", out[0] if isinstance(out, tuple) else out))
        for i in LAYERS
    ]
    try:
        with torch.no_grad():
            caught["logits"] = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()
    return caught


def main(rank: int, port: int, folder: Path, families: list[str]) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    input_ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    real = attention_mask.bool()
    plans = {"tensor": {"tp_size": 2}, "tensor+expert": {"tp_size": 2, "ep_size": 2}}
    for family in families:
        target = folder / family
        one = forward(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), input_ids, attention_mask)
        for plan, sizes in plans.items():
            model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32, distributed_config=DistributedConfig(**sizes)).eval()
            try:
                two = forward(model, input_ids, attention_mask)
            except RuntimeError as exc:  # the same on both ranks: the group stays in step
                line = {"family": family, "plan": plan, "fails": f"{type(exc).__name__}: {exc}"}
            else:
                layers = max((two[f"layer {i}"] - one[f"layer {i}"])[real].abs().max().item() for i in LAYERS)
                line = {"family": family, "plan": plan, "layers": layers, "logits": (two["logits"] - one["logits"])[real].abs().max().item()}
            if rank == 0:
                print(json.dumps(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
