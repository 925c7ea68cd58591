"""DSpark supervision from one forward pass, as docs/contract.md defines it.

Layer ids: -1 is the embedding output (the input of decoder layer 0), L - 1 the final norm's output
(post-norm), any other id the output of that decoder layer. A target whose layers carry several residual streams
(DeepSeek-V4) gives an intermediate layer as the mean of its streams and the embedding output as it was before it was
copied into them (contract/streams.py), as NeMo AutoModel's DSpark wrapper does.
"""

from __future__ import annotations

import torch

from draftfeed.consumers.engines.base import EMBEDDINGS, FINAL_HIDDEN, Capture, Engine, Joined, ModelFeature, Part
from draftfeed.consumers.settings import DEFAULT_DRAFT_LAYERS
from draftfeed.consumers.tasks.base import Task, TaskBatch, chosen_layer_ids
from draftfeed.contract.streams import first_stream, mean_streams
from draftfeed.schemas.messages import DSparkTargetInfo


def default_target_layer_ids(num_hidden_layers: int, draft_layers: int = DEFAULT_DRAFT_LAYERS) -> list[int]:
    """``draft_layers`` ids spread evenly over [1, L - 1], rounded half up (L = 6, 5 layers: [1, 2, 3, 4, 5])."""
    if draft_layers == 1:
        return [num_hidden_layers - 1]
    span = num_hidden_layers - 2
    return [int(1 + i * span / (draft_layers - 1) + 0.5) for i in range(draft_layers)]


def check_target_layer_ids(layer_ids: list[int], num_hidden_layers: int, *, default: bool) -> list[int]:
    """Strictly increasing ids, each -1 or in [0, L - 1]; the message names the first bad id and why."""
    where = f"the default DSpark target layer ids {layer_ids}" if default else f"--target-layer-ids {layer_ids}"
    advice = f"pass --target-layer-ids with strictly increasing ids from -1 (embeddings) to {num_hidden_layers - 1} (final norm)"
    if not layer_ids:
        raise ValueError(f"{where}: at least one layer is needed; {advice}")
    for index, layer_id in enumerate(layer_ids):
        if not -1 <= layer_id < num_hidden_layers:
            raise ValueError(f"{where}: id {layer_id} is out of range for a {num_hidden_layers}-layer target; {advice}")
        if index and layer_id <= layer_ids[index - 1]:
            raise ValueError(f"{where}: id {layer_id} does not come after {layer_ids[index - 1]} (ids must be strictly increasing); {advice}")
    return list(layer_ids)


class DSparkTask(Task):
    """DSpark supervision on top of any engine."""

    name = "dspark"
    INFO = DSparkTargetInfo
    supervision = "probs"  # DSpark has one form

    def __init__(self, engine: Engine, target_layer_ids: list[int] | None = None, draft_layers: int = DEFAULT_DRAFT_LAYERS) -> None:
        super().__init__(engine)
        self.logit_transform = engine.logit_transform
        layers = engine.shape.num_hidden_layers
        self.target_layer_ids = chosen_layer_ids(
            target_layer_ids, layers, lambda: default_target_layer_ids(layers, draft_layers), check_target_layer_ids
        )
        last = layers - 1
        if getattr(engine, "model_features", False):  # the model says where its DSpark features are (NeMo's models)
            parts: tuple[Part, ...] = tuple(ModelFeature(i) for i in self.target_layer_ids)
        else:
            parts = tuple(EMBEDDINGS if i == -1 else FINAL_HIDDEN if i == last else i for i in self.target_layer_ids)
        self.capture = Capture(final_hidden=True, joined=Joined(parts, fold=dspark_fold))
        engine.prepare([self.capture])

    def info_fields(self) -> dict[str, object]:
        return {"target_layer_ids": self.target_layer_ids}

    def layer_fields(self) -> dict[str, list[int]]:
        return {"target_hidden_states": list(self.target_layer_ids)}

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """target_hidden_states [B, S, len(ids) * H] and target_last_hidden_states [B, S, H].

        input_ids and loss_mask are not shifted for DSpark, so the rank keeps its own copies; the vocab is not used
        (DSpark has no draft-vocab mapping).
        """
        out = self.forward(batch)
        assert out.final_hidden is not None and out.joined is not None
        return {"target_hidden_states": out.joined, "target_last_hidden_states": out.final_hidden}


def dspark_fold(part: Part, tensor: torch.Tensor) -> torch.Tensor:
    """DSpark's reading of a part of a target with several residual streams: the embedding output as it was before
    it was copied into them, any other layer as their mean (the final norm's output is one stream already)."""
    return first_stream(tensor) if part == EMBEDDINGS else mean_streams(tensor)
