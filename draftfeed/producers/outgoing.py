"""A batch on its way out of the rank: the arguments checked and the tensors the worker needs, on the caller's thread.

What is wrong with a batch is said here, before a prefetch slot is taken, in the caller's words (the argument
names of ``generate_batch``), not later by a worker.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from draftfeed.contract.images import IMAGE_INPUTS, PACKED_WITH_IMAGES
from draftfeed.contract.packing import PACKING_KEYS, SENT_KEYS, check_packing
from draftfeed.contract.supervision import BATCH_KEYS
from draftfeed.dataplane.frames.codec import dtype_name
from draftfeed.schemas.errors import BadRequest


def outgoing_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    doc_remaining: torch.Tensor | None,
    images: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What goes to the worker, and the packing tensors the rank keeps to hand back with the supervision.

    A packed batch (``seq_lens`` given) sends its documents (``seq_lens``, ``position_ids``) as int64;
    ``doc_remaining`` is the rank's alone. ``images`` (name -> tensor: an image processor's outputs) go as they are,
    each under its name; the worker checks them against its target's forward. TypeError for an argument that is not
    a tensor of a dtype the codec carries, ValueError for a packed batch that does not add up or that has images."""
    sent = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask, **(images or {})}
    for name, tensor in sent.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        dtype_name(tensor.dtype)  # raises for a dtype the codec cannot carry
    try:
        packed = check_packing(attention_mask, position_ids, seq_lens, doc_remaining) is not None
    except BadRequest as exc:
        raise ValueError(f"generate_batch: {exc}") from None
    if packed and images:
        raise ValueError(f"generate_batch: {PACKED_WITH_IMAGES}")
    given = {"position_ids": position_ids, "seq_lens": seq_lens, "doc_remaining": doc_remaining}
    kept = {name: tensor for name, tensor in given.items() if tensor is not None}
    if packed:
        sent.update({name: kept[name].long() for name in SENT_KEYS if name in kept})
    return sent, kept


def batch_arguments(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``generate_batch``'s arguments from a dataloader's batch (``iterate()``): the token batch, its packing and its
    image inputs (contract/images.py's names) where it holds them; other keys are left out."""
    missing = [key for key in BATCH_KEYS if key not in batch]
    if missing:
        raise KeyError(f"batch has no {', '.join(missing)}; iterate() needs {', '.join(BATCH_KEYS)} in every batch")
    optional = (*PACKING_KEYS, *IMAGE_INPUTS)
    return {**{key: batch[key] for key in BATCH_KEYS}, **{key: batch[key] for key in optional if batch.get(key) is not None}}


def takes_arguments_of(original: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the decorated ``(*args, **kwargs)`` forwarder the parameters of ``original`` in its signature (what
    ``help()`` and editors show), so that a batch's arguments are written once: on ``generate_batch_async``."""

    def decorate(forwarder: Callable[..., Any]) -> Callable[..., Any]:
        returns = inspect.signature(forwarder).return_annotation
        forwarder.__signature__ = inspect.signature(original).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return forwarder

    return decorate
