"""Each mixture-of-experts family of ``draftfeed.tiny.MOE_ARCHS`` through draftfeed's tensor-parallel engine at degree 2
(this process rank 0, one follower), against the plain forward at degree 1: one JSON line per family on stdout,
``{"family", "served": true, "layers", "logits"}`` (the largest |difference| at real positions) or ``{"family",
"served": false, "refused": the one-line reason}``. Run by tests/test_tensor_parallel.py as
``python tp_families.py FOLDER`` (the tiny targets are built there).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from draftfeed.consumers.engines.base import Capture
from draftfeed.consumers.engines.hf import HFEngine
from draftfeed.consumers.engines.parallel.engine import TensorParallelEngine
from draftfeed.tiny import MOE_ARCHS, build_tiny_target

LAYERS = (1, 3, 5)


def main(folder: Path) -> None:
    torch.set_num_threads(1)
    input_ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 8:] = 0
    real = attention_mask.bool()
    capture = Capture(layer_ids=LAYERS, logits=True)
    for family in MOE_ARCHS:
        target = str(build_tiny_target(folder / family, arch=family))
        try:
            engine = TensorParallelEngine("hf", target, ["cpu", "cpu"], "float32", on_lost=lambda why: None)
        except ValueError as exc:
            print(json.dumps({"family": family, "served": False, "refused": str(exc)}), flush=True)
            continue
        try:
            two = engine.forward(input_ids, attention_mask, capture)
        finally:
            engine.close()
        one = HFEngine(target, dtype="float32").forward(input_ids, attention_mask, capture)
        layers = max((two.layer_outputs[i] - one.layer_outputs[i])[real].abs().max().item() for i in LAYERS)
        logits = (two.logits - one.logits)[real].abs().max().item()
        print(json.dumps({"family": family, "served": True, "layers": layers, "logits": logits}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
