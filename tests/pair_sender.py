"""The worker side of a pair group, in its own process: ``python tests/pair_sender.py PORT MODE``.

MODE ``send`` sends ``sample_tensors()``; ``die`` joins the group and exits without sending. It prints
READY once the group is built.
"""

from __future__ import annotations

import os
import sys

import torch

from draftfeed.dataplane.pair_group.transport import SENDER, PairGroup, join_store


def sample_tensors() -> dict[str, torch.Tensor]:
    """Every dtype supervision uses, a scalar and a non-contiguous tensor; the same on both sides."""
    generator = torch.Generator().manual_seed(7)
    probs = torch.rand(2, 5, 16, generator=generator)
    return {
        "aux_hidden_states": torch.randn(2, 5, 12, generator=generator).to(torch.bfloat16),
        "target_probs": probs.softmax(-1),
        "position_mask": (probs[..., :1] > 0.5),
        "input_ids": torch.randint(0, 1000, (2, 5), generator=generator),
        "transposed": torch.randn(4, 3, generator=generator).t(),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
    }


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    group = PairGroup(join_store("127.0.0.1", port), SENDER, "gloo", timeout_s=20)
    print("READY", flush=True)
    if mode == "send":
        group.send(sample_tensors())
    elif mode == "die":
        os._exit(3)
    group.close()


if __name__ == "__main__":
    main()
