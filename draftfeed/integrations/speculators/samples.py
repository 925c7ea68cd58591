"""speculators' samples and draftfeed's DFlash supervision, one to the other: the request a dataset row becomes,
the layer ids that serve speculators' ``--target-layer-ids``, and the sample a row's supervision becomes.

speculators' layer id k (k < L) is the input of decoder layer k, which is the output of layer k - 1; its id L, always
last in a sample, is the last layer's output before the final norm. A DFlash service (``--task dflash``) gives the
outputs of its ``--target-layer-ids``, the last one (L - 1) before the final norm: speculators' ids k serve as DFlash
ids k - 1, and L as L - 1. Imports no speculators: the backend and ``draftfeed store export`` share it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LayerMismatch(ValueError):
    """The service's layers are not the ones speculators asks for (one line that says what to change)."""


def service_layer_ids(speculators_ids: Sequence[int], num_hidden_layers: int) -> list[int]:
    """The DFlash ``--target-layer-ids`` whose outputs are speculators' sample for ``speculators_ids`` (its
    ``--target-layer-ids``, without L) on a target of ``num_hidden_layers`` layers: each k - 1, then L - 1."""
    last = num_hidden_layers
    ids = [int(k) for k in speculators_ids if int(k) != last]
    bad = [k for k in ids if not 1 <= k < last]
    if bad:
        raise LayerMismatch(
            f"speculators' --target-layer-ids {bad} have no DFlash layer: id 0 is the embeddings' output and ids above "
            f"{last} do not exist on this {last}-layer target; choose ids from 1 to {last}"
        )
    return [k - 1 for k in ids] + [last - 1]


def worker_flag(ids: Sequence[int]) -> str:
    return f"--task dflash --target-layer-ids {','.join(map(str, ids))}"


def check_service(speculators_ids: Sequence[int], service: str, info: object, verifier: dict[str, int]) -> list[int]:
    """The DFlash ids the service must serve, checked against what it serves (``info``: its DFlashTargetInfo) and
    against the verifier's config (``verifier``: num_hidden_layers, hidden_size, vocab_size); raises LayerMismatch."""
    differing = [
        f"{field} {getattr(info, field)} (the verifier's: {verifier[field]})"
        for field in ("num_hidden_layers", "hidden_size", "vocab_size")
        if field in verifier and getattr(info, field) != verifier[field]
    ]
    if differing:
        raise LayerMismatch(
            f"service {service!r} serves another target than --verifier-name-or-path: {', '.join(differing)}; "
            "start its workers with --target set to the verifier"
        )
    wanted = service_layer_ids(speculators_ids, verifier["num_hidden_layers"])
    served = list(info.target_layer_ids)  # type: ignore[attr-defined]
    if served != wanted:
        raise LayerMismatch(
            f"service {service!r} serves DFlash layers {served}, and speculators' --target-layer-ids "
            f"{[int(k) for k in speculators_ids]} need {wanted}: start its workers with `{worker_flag(wanted)}`"
        )
    return wanted


def row_batch(input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The request one dataset row becomes: one unpadded row, every position real."""
    ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(1, -1)
    ones = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}


def to_sample(hidden_states: torch.Tensor, input_ids: torch.Tensor, hidden_size: int) -> dict[str, torch.Tensor]:
    """A row's DFlash ``hidden_states`` [1, S, n x H] as speculators' sample: ``hidden_states`` [S, n, H] (the layers
    in order, L last) and ``token_ids`` [S] int64."""
    rows, length, width = hidden_states.shape
    if rows != 1 or width % hidden_size:
        raise ValueError(f"hidden_states of shape {list(hidden_states.shape)} is not one row of layers {hidden_size} wide")
    return {
        "hidden_states": hidden_states.reshape(length, width // hidden_size, hidden_size),
        "token_ids": torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1).clone(),
    }
