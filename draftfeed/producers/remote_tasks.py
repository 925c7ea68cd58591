"""The training rank's view of the tasks whose supervision may carry full-vocab logits: RemoteDFlashTarget (DFlash,
DFlash2, Domino; JetSpec with logits), RemoteEagleTarget (EAGLE-1 and EAGLE-2) and RemoteVispecTarget (ViSpec).

Each result carries the fields of NeMo AutoModel's batch dataclass of that task under the same names
(draftfeed/contract/supervision.py), so a recipe written against NeMo's in-process wrapper runs unchanged. Where the
service's workers send the compact form ("hidden": the post-norm final hidden state instead of the logits), the rank
fetches the lm_head weight once, before its first batch, and rebuilds the logits with contract/compact.py's
``task_logits``, the function the workers run for the "logits" form.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import torch

from draftfeed.contract.compact import CompactLogits
from draftfeed.contract.images import shifted_image_mask
from draftfeed.contract.ops import shift_left
from draftfeed.contract.supervision import DFlashSupervision, EagleSupervision, Supervision, VispecSupervision
from draftfeed.producers.remote_target import RemoteTarget
from draftfeed.producers.sources import Served
from draftfeed.schemas.messages import DFlashTargetInfo, EagleTargetInfo, VispecTargetInfo

Sup = TypeVar("Sup", bound=Supervision)
Info = TypeVar("Info", DFlashTargetInfo, EagleTargetInfo, VispecTargetInfo)


class _WithLogits(RemoteTarget[Sup, Info]):
    """A task whose supervision carries full-vocab logits, sent as they are ("logits") or rebuilt here ("hidden")."""

    LOGITS: ClassVar[str]  # the logits' field name
    COMPACT_HIDDEN: ClassVar[str]  # what a compact answer holds instead of the logits: the post-norm final hidden state

    _compact: CompactLogits | None = None

    def _carries_logits(self, served: Served) -> bool:
        return True

    def _before_submit(self) -> None:
        """If the service's workers send the compact form, fetch the lm_head weight once (on the caller's thread)."""
        super()._before_submit()
        served = self._served_target()
        if self._compact is None and "hidden" in served.forms and self._carries_logits(served):
            self._compact = CompactLogits(self.TASK, self.get_output_embeddings().weight, served.logit_transform)

    def _logits(self, received: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The logits as sent, or rebuilt from a compact answer; None when the answer has neither (DFlash without
        logits)."""
        if self.LOGITS in received:
            return received[self.LOGITS]
        if self.COMPACT_HIDDEN not in received:  # DFlash without logits (EAGLE-1/2 and ViSpec always send the hidden state)
            return None
        if self._compact is None:
            raise ValueError("a compact (hidden) answer came before the lm_head weight was fetched")
        return self._compact.rebuild(received[self.COMPACT_HIDDEN])


class RemoteDFlashTarget(_WithLogits[DFlashSupervision, DFlashTargetInfo]):
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


class RemoteEagleTarget(_WithLogits[EagleSupervision, EagleTargetInfo]):
    """EAGLE-1 / EAGLE-2 supervision: the post-norm last hidden state, as is and shifted left, and lm_head's logits
    of it, shifted left; input_ids and loss_mask shifted left, the packing fields as given."""

    TASK = "eagle"
    SUPERVISION = EagleSupervision
    INFO = EagleTargetInfo
    LOGITS = "target_logits"
    COMPACT_HIDDEN = "input_hidden_states"

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hidden = received["input_hidden_states"]
        return {
            "input_hidden_states": hidden,
            "target_hidden_states": shift_left(hidden),
            "target_logits": self._logits(received),
            "input_ids": shift_left(own["input_ids"]),
            "loss_mask": shift_left(own["loss_mask"]),
        }


class RemoteVispecTarget(_WithLogits[VispecSupervision, VispecTargetInfo]):
    """ViSpec supervision of an image-text target: the embedding output with the vision features merged in (shifted
    left), the post-norm last hidden state, lm_head's logits of it (shifted left), and the image mask (shifted left).
    Packed rows are refused: NeMo's ViSpec wrapper runs one sequence a row."""

    TASK = "vispec"
    SUPERVISION = VispecSupervision
    INFO = VispecTargetInfo
    LOGITS = "target_logits"
    COMPACT_HIDDEN = "input_hidden_states"
    PACKED_REFUSAL = "ViSpec takes no packed rows (seq_lens): NeMo's ViSpec wrapper runs one sequence a row; send the batch unpacked"

    @property
    def image_token_id(self) -> int:
        """The target's image placeholder token (image_mask is True where input_ids hold it, shifted left)."""
        return self.model_info().image_token_id

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "inputs_embeds": received["inputs_embeds"],
            "input_hidden_states": received["input_hidden_states"],
            "target_logits": self._logits(received),
            "loss_mask": shift_left(own["loss_mask"]),
            "image_mask": shifted_image_mask(own["input_ids"], self.image_token_id),
        }
