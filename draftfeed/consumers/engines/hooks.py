"""Forward hooks that catch what a capture asks for (base.Capture): each writes the tensor a module returns into the
joined tensor if it is a joined part (joining.py), and keeps it in the forward's output if it is wanted alone. The
engines that run a torch model in process (hf, automodel) place them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, ForwardOutput, Part
from draftfeed.consumers.engines.joining import JoinedWriter


def store_hook(out: ForwardOutput, joined: JoinedWriter | None, part: Part, keep: bool, device: torch.device, at: tuple = ()) -> Callable[..., None]:
    """A forward hook for ``part``: what the module returns (its first output), on ``device`` (with --device-map auto a
    layer may sit on another one), written into ``joined`` at the leading index ``at`` and kept in ``out`` if ``keep``."""

    def hook(_module: nn.Module, _inputs: object, output: Any) -> None:
        tensor = (output[0] if isinstance(output, tuple) else output).to(device)
        if joined is not None and joined.wants(part):
            joined.write(part, tensor, at)
        if not keep:
            return
        if part == EMBEDDINGS:
            out.embeddings = tensor
        elif part == FINAL_HIDDEN:
            out.final_hidden = tensor
        else:
            out.layer_outputs[part] = tensor  # type: ignore[index]

    return hook


def first_input_hook(store: Callable[..., None]) -> Callable[..., None]:
    """A forward pre-hook (``with_kwargs=True``) that gives a module's first input (positional, else its
    ``hidden_states`` keyword, else its first keyword) to ``store`` as a forward hook's output: decoder layer 0's is the
    embeddings; a model's own DSpark feature module's is that feature."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        first = args[0] if args else kwargs["hidden_states"] if "hidden_states" in kwargs else next(iter(kwargs.values()))
        store(module, args, first)

    return hook
