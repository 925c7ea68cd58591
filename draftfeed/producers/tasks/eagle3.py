"""EAGLE-3's client on the rank: aux hidden states, the target's probabilities over the draft vocabulary, the
position mask; the draft vocabulary is set here (``set_vocab_mapping``), and a compact answer (the final hidden
state and argmax) is rebuilt here with the lm_head's draft rows, fetched once."""

from __future__ import annotations

from typing import Any

import torch

from draftfeed.contract.compact import CompactEagle3
from draftfeed.contract.supervision import Eagle3Supervision
from draftfeed.contract.vocab import mapping_digest, validate_vocab_mapping
from draftfeed.producers.tasks.base import RemoteTarget
from draftfeed.schemas.errors import BadRequest
from draftfeed.schemas.messages import Eagle3TargetInfo


class RemoteEagle3Target(RemoteTarget[Eagle3Supervision, Eagle3TargetInfo]):
    """EAGLE-3 supervision: aux hidden states, target probabilities over the draft vocab, position mask."""

    TASK = "eagle3"
    SUPERVISION = Eagle3Supervision
    INFO = Eagle3TargetInfo

    def set_vocab_mapping(self, selected_token_ids: torch.Tensor, selected_token_mask: torch.Tensor) -> None:
        """Use a draft vocabulary: ``selected_token_ids`` int64 [Vd] (draft id -> target id), ``selected_token_mask`` bool [V]."""
        ids = _host_tensor("selected_token_ids", selected_token_ids, torch.int64)
        mask = _host_tensor("selected_token_mask", selected_token_mask, torch.bool)
        try:
            validate_vocab_mapping(ids, mask, self.model_info().vocab_size)
        except BadRequest as exc:
            raise ValueError(f"set_vocab_mapping: {exc}") from None
        digest = mapping_digest(ids, mask)
        self._wait(self._opened().set_mapping(ids, mask, digest, self._mapping_digest), "the broker's acknowledgement of the vocab mapping")
        self._mapping, self._mapping_digest, self._compact = (ids, mask), digest, None

    _mapping: tuple[torch.Tensor, torch.Tensor] | None = None
    _compact: CompactEagle3 | None = None

    def _before_submit(self) -> None:
        """If the service's workers send the compact form, fetch the lm_head's draft rows once."""
        super()._before_submit()
        served = self._served_target()  # asked once; it also says which forms the workers send
        if "hidden" not in served.forms or self._compact is not None:
            return
        if self._mapping is None:
            rows, mask = None, torch.ones(served.info.vocab_size, dtype=torch.bool)
        else:
            rows, mask = self._mapping
        weight = self._fetch_weight("output_embeddings", rows)
        self._compact = CompactEagle3(weight, mask.to(weight.device), served.logit_transform)

    def _from_wire(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if "final_hidden_states" not in received:  # probs or probs-bf16
            fields = super()._from_wire(received, own)
            fields["target_probs"] = fields["target_probs"].float()
            return fields
        if self._compact is None:
            raise ValueError("a compact (hidden) answer came before the lm_head rows were fetched")
        rebuilt = self._compact.rebuild(received["final_hidden_states"], received["target_argmax"], received["loss_mask"])
        return {
            "aux_hidden_states": received["aux_hidden_states"],
            "input_ids": received["input_ids"],
            "loss_mask": received["loss_mask"],
            **rebuilt,
        }


def _host_tensor(name: str, value: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor, list, tuple or numpy array as a contiguous CPU tensor of ``dtype``; anything else a TypeError."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", dtype).contiguous()
    if isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        try:
            return torch.as_tensor(value).to(dtype).contiguous()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"set_vocab_mapping: {name} could not be read as a {dtype} tensor: {exc}") from None
    raise TypeError(f"set_vocab_mapping: {name} must be a torch.Tensor (or a list of {dtype} values), got {type(value).__name__}")
