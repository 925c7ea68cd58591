"""What the clients of the tasks whose supervision carries full-vocab logits share (DFlash with logits, EAGLE-1/2,
ViSpec): the logits as sent, or rebuilt on the rank from a compact answer.

Where the service's workers send the compact form ("hidden": the post-norm final hidden state instead of the logits),
the rank fetches the lm_head weight once, before its first batch, and rebuilds the logits with contract/compact.py's
``task_logits``, the function the workers run for the "logits" form.
"""

from __future__ import annotations

from typing import ClassVar, TypeVar

import torch

from draftfeed.contract.compact import CompactLogits
from draftfeed.contract.supervision import Supervision
from draftfeed.producers.sources import Served
from draftfeed.producers.tasks.base import RemoteTarget
from draftfeed.schemas.messages import DFlashTargetInfo, EagleTargetInfo, VispecTargetInfo

Sup = TypeVar("Sup", bound=Supervision)
Info = TypeVar("Info", DFlashTargetInfo, EagleTargetInfo, VispecTargetInfo)


class WithLogits(RemoteTarget[Sup, Info]):
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
