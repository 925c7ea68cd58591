"""DFlash's client on the rank (DFlash, DFlash2, Domino; JetSpec with logits): the outputs of the target layers
concatenated, not shifted, and with ``capture_logits`` the target's own full-vocab logits."""

from __future__ import annotations

import torch

from draftfeed.contract.supervision import DFlashSupervision
from draftfeed.producers.sources import Served
from draftfeed.producers.tasks.with_logits import WithLogits
from draftfeed.schemas.messages import DFlashTargetInfo


class RemoteDFlashTarget(WithLogits[DFlashSupervision, DFlashTargetInfo]):
    """DFlash supervision (DFlash, DFlash2, Domino; JetSpec when the service captures logits): the outputs of the
    target layers concatenated, not shifted, and with ``capture_logits`` the target's own full-vocab logits."""

    TASK = "dflash"
    SUPERVISION = DFlashSupervision
    INFO = DFlashTargetInfo
    LOGITS = "logits"
    COMPACT_HIDDEN = "final_hidden_states"

    @property
    def target_layer_ids(self) -> list[int]:
        """The decoder layers whose outputs ``hidden_states`` concatenates, in order (the service's)."""
        return list(self.model_info().target_layer_ids)

    @property
    def capture_logits(self) -> bool:
        """Whether the service's supervision carries the full-vocab logits (JetSpec's distillation needs them)."""
        return self.model_info().capture_logits

    def _carries_logits(self, served: Served) -> bool:
        return bool(getattr(served.info, "capture_logits", False))

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        fields = {"hidden_states": received["hidden_states"]}
        logits = self._logits(received)
        if logits is not None:
            fields["logits"] = logits
        return fields
