"""NeMo AutoModel for the tests that compare with it or drive its recipes.

NeMo and the packages its recipes import (torchao, datasets, ...) are installed apart from the venv, in .nemo-packages
(the Makefile: pip --target, --no-deps), and put on the path only by the tests that use them: with torchao importable,
transformers loads it in every process that loads a model, every worker of the suite included.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

NEMO_PACKAGES = Path(__file__).resolve().parents[2] / ".nemo-packages"


def nemo_on_path() -> None:
    """Put .nemo-packages on this process's path, after the venv's own packages; skip the test if NeMo is not there."""
    if str(NEMO_PACKAGES) not in sys.path:
        sys.path.append(str(NEMO_PACKAGES))
    if importlib.util.find_spec("nemo_automodel") is None:
        pytest.skip(f"nemo-automodel is not installed in {NEMO_PACKAGES} (`make venv` installs it: nemo-automodel 0.7.0, --no-deps)")


def nemo_reference(path):
    """NeMo's own model of the checkpoint, built and loaded as the engine does, apart from it."""
    import torch

    from draftfeed.consumers.engines.automodel import CPU_BACKEND, backend_config, nemo_config, nemo_model_class, read_weights

    config = nemo_config(str(path))
    model = nemo_model_class(config)(config, backend=backend_config(CPU_BACKEND))
    model.load_state_dict(model.state_dict_adapter.from_hf(read_weights(str(path))), strict=True)  # every name, mapped
    return model.to(torch.float32).eval()


def train_steps(trainer, batches, step, before_each=None) -> list:
    """AdamW steps of ``trainer`` as NeMo's recipes take them (lr 1e-2, betas 0.9 / 0.95, gradients clipped to 1.0), one a
    batch: ``step(batch)`` gives the recipe's metrics, whose loss is backpropagated; ``before_each(index)`` runs first
    (a seed for what the step samples). The losses, detached."""
    import torch

    optimizer = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))
    losses = []
    for index, batch in enumerate(batches):
        if before_each is not None:
            before_each(index)
        metrics = step(batch)
        metrics.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainer.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(metrics.loss.detach())
    return losses
