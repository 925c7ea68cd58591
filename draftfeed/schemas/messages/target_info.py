"""What a worker says of its target, one model a task (the ``task`` field tells them apart): the sizes every rank
checks, and each task's own fields (its layer ids, JetSpec's logits, ViSpec's image token).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field
from typing_extensions import Self

from draftfeed.schemas.messages.common import Strict


class _TargetInfo(Strict):
    """What a worker's target is; every worker of one service must report the same."""

    num_hidden_layers: Annotated[int, Field(ge=1)]
    hidden_size: Annotated[int, Field(ge=1)]
    vocab_size: Annotated[int, Field(ge=1)]

    def __getitem__(self, key: str) -> object:
        """Dict-style access (``info["hidden_size"]``), as ranks written for a dict of model info expect."""
        if key not in type(self).model_fields:
            raise KeyError(key)
        return getattr(self, key)

    def mismatched_fields(self, other: _TargetInfo) -> list[str]:
        """Names of the fields whose values differ (the task included)."""
        names = dict.fromkeys([*type(self).model_fields, *type(other).model_fields])
        return [name for name in names if getattr(self, name, None) != getattr(other, name, None)]

    def describe_mismatch(self, other: _TargetInfo, mine: str = "expected", theirs: str = "served") -> str:
        return "; ".join(
            f"{name}: {mine} {getattr(self, name, None)!r}, {theirs} {getattr(other, name, None)!r}" for name in self.mismatched_fields(other)
        )

    LAYER_FIELD: ClassVar[str | None] = None  # the field naming the layers this task's draft reads (None: it reads none)

    @classmethod
    def from_text_config(cls, text_config: object, layer_ids: list[int] | None = None, **fields: object) -> Self:
        """From a transformers config (of a multimodal target, its text config is used), the layer ids the draft
        reads (the aux layers for EAGLE-3, the target layers for DSpark and DFlash; none for EAGLE-1/2 and ViSpec)
        and the task's other fields."""
        get_text_config = getattr(text_config, "get_text_config", None)
        config = get_text_config() if callable(get_text_config) else getattr(text_config, "text_config", None) or text_config
        if cls.LAYER_FIELD is not None:
            fields[cls.LAYER_FIELD] = list(layer_ids or [])
        return cls(num_hidden_layers=config.num_hidden_layers, hidden_size=config.hidden_size, vocab_size=config.vocab_size, **fields)


class Eagle3TargetInfo(_TargetInfo):
    LAYER_FIELD: ClassVar[str | None] = "aux_layer_ids"
    task: Literal["eagle3"] = "eagle3"
    aux_layer_ids: Annotated[list[int], Field(min_length=3, max_length=3)]


class DSparkTargetInfo(_TargetInfo):
    LAYER_FIELD: ClassVar[str | None] = "target_layer_ids"
    task: Literal["dspark"] = "dspark"
    target_layer_ids: Annotated[list[int], Field(min_length=1, max_length=256)]


class DFlashTargetInfo(_TargetInfo):
    """DFlash, DFlash2, Domino and JetSpec: the outputs of ``target_layer_ids`` (decoder layers 0..L-1, pre-norm),
    and with ``capture_logits`` the full-vocab logits too (JetSpec's distillation needs them)."""

    LAYER_FIELD: ClassVar[str | None] = "target_layer_ids"
    task: Literal["dflash"] = "dflash"
    target_layer_ids: Annotated[list[int], Field(min_length=1, max_length=256)]
    capture_logits: bool = False


class EagleTargetInfo(_TargetInfo):
    """EAGLE-1 and EAGLE-2: the post-norm last hidden state and lm_head's logits; no layer ids."""

    task: Literal["eagle"] = "eagle"


class VispecTargetInfo(_TargetInfo):
    """ViSpec on an image-text target: the embedding output (vision features merged in), the post-norm last hidden
    state and lm_head's logits. The rank builds the image mask from the batch's ids and ``image_token_id``."""

    task: Literal["vispec"] = "vispec"
    image_token_id: Annotated[int, Field(ge=0)]


TargetInfo = Annotated[Eagle3TargetInfo | DSparkTargetInfo | DFlashTargetInfo | EagleTargetInfo | VispecTargetInfo, Field(discriminator="task")]


AnyTargetInfo = Eagle3TargetInfo | DSparkTargetInfo | DFlashTargetInfo | EagleTargetInfo | VispecTargetInfo
