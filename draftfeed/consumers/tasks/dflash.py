"""DFlash supervision (DFlash, DFlash2, Domino; JetSpec with logits) from one forward pass, as docs/contract.md
defines it: the outputs of chosen decoder layers concatenated, not shifted, and optionally the full-vocab logits.

Layer ids are decoder layers 0..L-1 and mean what the layer returns (pre-norm, after its residual add), as NeMo
AutoModel's DFlash wrapper captures them; unlike DSpark, L-1 is the last layer's output, not the final norm's.
"""

from __future__ import annotations

import torch

from draftfeed.consumers.engines.base import Capture, Engine, Joined
from draftfeed.consumers.settings import DEFAULT_DRAFT_LAYERS, task_settings_problem
from draftfeed.consumers.tasks.base import Task, TaskBatch, chosen_layer_ids
from draftfeed.consumers.tasks.eagle3 import verified_logit_transform
from draftfeed.schemas.messages import DFlashTargetInfo, SupervisionForm, default_supervision


def default_dflash_layer_ids(num_hidden_layers: int, draft_layers: int = DEFAULT_DRAFT_LAYERS) -> list[int]:
    """The DFlash recipe's choice: one layer is the middle one (L // 2); more are spread from 1 to L - 3, each
    rounded to the nearest id (halves to even, as Python rounds)."""
    if draft_layers == 1:
        return [num_hidden_layers // 2]
    last = num_hidden_layers - 3
    return [round(1 + i * (last - 1) / (draft_layers - 1)) for i in range(draft_layers)]


def check_dflash_layer_ids(layer_ids: list[int], num_hidden_layers: int, *, default: bool) -> list[int]:
    """Distinct decoder layers in [0, L - 1], kept in the order given (the order they are concatenated in)."""
    where = f"the default DFlash target layer ids {layer_ids} (from --draft-layers)" if default else f"--target-layer-ids {layer_ids}"
    advice = f"pass --target-layer-ids with distinct decoder layers in [0, {num_hidden_layers - 1}], e.g. 1,{num_hidden_layers // 2}"
    if not layer_ids:
        raise ValueError(f"{where}: DFlash needs at least one layer; {advice}")
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_hidden_layers:
            raise ValueError(f"{where}: layer {layer_id} does not exist in a {num_hidden_layers}-layer target; {advice}")
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"{where} repeat a layer; {advice}")
    return list(layer_ids)


class DFlashTask(Task):
    """DFlash supervision on top of any engine.

    Without ``capture_logits`` it sends the layers' outputs only (its one form, "logits" in name). With it, also the
    target's full-vocab logits: as they are ("logits"), or as the final norm's output ("hidden", compact), from which
    ranks rebuild them with the lm_head and the target's logit transform, checked here on a probe batch.
    """

    name = "dflash"
    INFO = DFlashTargetInfo

    def __init__(
        self,
        engine: Engine,
        target_layer_ids: list[int] | None = None,
        draft_layers: int = DEFAULT_DRAFT_LAYERS,
        capture_logits: bool = False,
        supervision: SupervisionForm | None = None,
    ) -> None:
        super().__init__(engine)
        layers = engine.shape.num_hidden_layers
        self.target_layer_ids = chosen_layer_ids(
            target_layer_ids, layers, lambda: default_dflash_layer_ids(layers, draft_layers), check_dflash_layer_ids
        )
        self.capture_logits = capture_logits
        if (problem := task_settings_problem("dflash", supervision, capture_logits)) is not None:
            raise ValueError(problem)
        self.supervision: SupervisionForm = supervision or default_supervision("dflash")
        compact = capture_logits and self.supervision == "hidden"
        self.capture = Capture(joined=Joined(tuple(self.target_layer_ids)), logits=capture_logits and not compact, final_hidden=compact)
        engine.prepare([self.capture, Capture(final_hidden=True, logits=True)] if compact else [self.capture])
        self.logit_transform = verified_logit_transform(engine) if compact else engine.logit_transform

    def info_fields(self) -> dict[str, object]:
        return {"target_layer_ids": self.target_layer_ids, "capture_logits": self.capture_logits}

    def layer_fields(self) -> dict[str, list[int]]:
        return {"hidden_states": list(self.target_layer_ids)}

    def supervise(self, batch: TaskBatch) -> dict[str, torch.Tensor]:
        """hidden_states [B, S, len(ids) * H]; with logits captured, logits [B, S, V] or (compact) final_hidden_states
        [B, S, H]; nothing shifted. The rank keeps its own input_ids, loss_mask and packing fields; the vocab is not used."""
        out = self.forward(batch)
        assert out.joined is not None
        result = {"hidden_states": out.joined}
        if out.logits is not None:
            result["logits"] = out.logits
        if out.final_hidden is not None:
            result["final_hidden_states"] = out.final_hidden
        return result
