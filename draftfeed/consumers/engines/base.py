"""The engine interface: what a worker needs from whatever runs the frozen target.

Three engines implement it (``hf``, ``vllm``, ``sglang``); the tasks and the worker see only this
interface. Layer semantics are the hf engine's (transformers' modules): "output of layer i" is what
decoder layer i returns after its residual add; the embeddings are the input of decoder layer 0; the
final hidden state is the final norm's output.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Union

import torch

from draftfeed.contract.images import PACKED_WITH_IMAGES
from draftfeed.contract.ops import zero_padding_
from draftfeed.contract.packing import Documents
from draftfeed.schemas.errors import BadRequest
from draftfeed.schemas.messages import LogitTransform


class RetryableEngineError(RuntimeError):
    """An engine error that another worker may not hit (a transient device fault): the request goes to another worker."""


class EngineLost(RuntimeError):
    """The engine can no longer compute, through no fault of the request (a tensor-parallel process died): the worker
    hands the request back uncharged and stops."""


# Errors a worker hands a request back for, instead of failing it: another worker may well serve it.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError, RetryableEngineError)


@dataclass(frozen=True)
class TargetShape:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None = None  # the longest row the target takes (max_position_embeddings), None if unknown

    @classmethod
    def from_text_config(cls, text_config: object) -> TargetShape:
        """The depth and widths of a transformers text config (``config.get_text_config()``)."""
        return cls(
            num_hidden_layers=text_config.num_hidden_layers,  # type: ignore[attr-defined]
            hidden_size=text_config.hidden_size,  # type: ignore[attr-defined]
            vocab_size=text_config.vocab_size,  # type: ignore[attr-defined]
            max_positions=getattr(text_config, "max_position_embeddings", None),
        )


# The parts of a joined tensor (``Joined``): a decoder layer's output by its id, one of these two, or a ModelFeature.
EMBEDDINGS, FINAL_HIDDEN = "embeddings", "final_hidden"


@dataclass(frozen=True)
class ModelFeature:
    """DSpark's feature of target layer ``layer_id`` as the model defines it itself (NeMo AutoModel's
    ``get_dspark_target_feature_modules``: the first input of the module it names), asked of an engine whose
    ``model_features`` is true (the automodel engine) only."""

    layer_id: int


Part = Union[int, str, ModelFeature]  # noqa: UP007 (an alias: the union is evaluated at import)


@dataclass(frozen=True)
class Joined:
    """Captured tensors an engine writes side by side, on the last dimension, into one tensor as it computes each, so
    that the worker holds one copy of the supervision, never the parts and their concatenation as well.

    parts: in order, a decoder layer id, ``EMBEDDINGS`` or ``FINAL_HIDDEN``;
    fold: what a part is before it is written (``fold(part, tensor)``), None for as it is: the contract's reading of
    a layer of several residual streams (contract/streams.py) for a task that folds them.
    """

    parts: tuple[Part, ...]
    fold: Callable[[Part, torch.Tensor], torch.Tensor] | None = None

    def layer_ids(self) -> tuple[int, ...]:
        return tuple(part for part in self.parts if isinstance(part, int))


@dataclass(frozen=True)
class Capture:
    """What one forward must return.

    layer_ids: decoder layers whose output (what the layer returns, after its residual add) is wanted;
    embeddings: the input of decoder layer 0 (``output_hidden_states[0]`` in transformers);
    final_hidden: the final norm's output (post-norm last hidden state);
    logits: the full-vocab logits [B, S, V], with the target's own scaling or soft-capping;
    joined: parts wanted only side by side in one tensor (``ForwardOutput.joined``), written there as computed.
    """

    layer_ids: tuple[int, ...] = ()
    embeddings: bool = False
    final_hidden: bool = False
    logits: bool = False
    joined: Joined | None = None

    def needed_layer_ids(self) -> tuple[int, ...]:
        """Every decoder layer the forward must catch: those wanted alone and those joined."""
        return tuple(sorted(set(self.layer_ids) | set(self.joined.layer_ids() if self.joined else ())))

    def needs_embeddings(self) -> bool:
        return self.embeddings or (self.joined is not None and EMBEDDINGS in self.joined.parts)

    def needs_final_hidden(self) -> bool:
        return self.final_hidden or (self.joined is not None and FINAL_HIDDEN in self.joined.parts)


@dataclass
class ForwardOutput:
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    embeddings: torch.Tensor | None = None
    final_hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    joined: torch.Tensor | None = None  # the capture's ``joined`` parts side by side [B, S, ..., parts x H]


class Engine(Protocol):
    """Runs the frozen target. The rest of the worker does not know which engine it talks to."""

    name: str
    shape: TargetShape
    device: torch.device  # where forward's tensors land
    dtype: torch.dtype
    logit_transform: LogitTransform  # what the target applies to lm_head's output, for ranks that rebuild logits
    # The image inputs forward takes by name (contract/images.py), and why none when empty; engines without the two
    # attributes take none (``image_policy``).
    image_inputs: frozenset[str]
    images_refusal: str | None

    def prepare(self, captures: Sequence[Capture]) -> None:
        """Called once by the task, before any forward, with every capture it will ask for.

        Engines that fix what they capture when they start (vllm, sglang) start here. Raises ValueError,
        naming what cannot be captured and what to do instead, for a capture this engine cannot give.
        """
        ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, capture: Capture, documents: Documents | None = None) -> ForwardOutput:
        """One forward over the batch [B, S], returning what ``capture`` asks for, each [B, S, ...].

        Positions where ``attention_mask`` is 0 may hold anything; the tasks overwrite them
        (``fill_padding``). Real positions must not depend on the other rows or on the padding. A packed batch
        comes with its ``documents`` (contract/packing.py): a real position must then depend on its own
        document only, at the positions its document gives it. The tasks pass ``documents`` only for a packed
        batch, so an engine that does not take packed rows needs no such parameter (the batch is refused). An
        unpacked batch of an image-text target may come with ``images`` (name -> tensor, checked against
        ``image_inputs``), which the one forward takes as its keyword arguments.
        """
        ...

    def input_embeddings(self) -> torch.Tensor:
        """The input embedding weight [V, H]."""
        ...

    def output_embeddings(self) -> torch.Tensor:
        """The output embedding (lm_head) weight [V, H]."""
        ...

    def close(self) -> None:
        """Release the engine's processes and memory; the engine is not used afterwards."""
        ...


def image_policy(engine: Engine) -> tuple[frozenset[str], str]:
    """The image inputs ``engine`` takes, and why none when it takes none."""
    accepted = frozenset(getattr(engine, "image_inputs", frozenset()))
    refusal = getattr(engine, "images_refusal", None) or f"engine {engine.name} takes no image inputs: serve image-text batches with --engine hf"
    return accepted, refusal


def forward_batch(
    engine: Engine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    capture: Capture,
    documents: Documents | None,
    images: Mapping[str, torch.Tensor] | None = None,
) -> ForwardOutput:
    """``engine.forward``, with the documents of a packed batch and the image inputs of an image-text batch; a packed
    batch for an engine that cannot take one is refused (BadRequest), never computed as one causal sequence, and so
    are images for an engine that takes none, and images in a packed batch."""
    if images:
        accepted, refusal = image_policy(engine)
        if not accepted or "images" not in inspect.signature(engine.forward).parameters:
            raise BadRequest(refusal)
        if documents is not None:
            raise BadRequest(PACKED_WITH_IMAGES)
        return engine.forward(input_ids, attention_mask, capture, images=dict(images))  # type: ignore[call-arg]
    if documents is None:
        return engine.forward(input_ids, attention_mask, capture)
    if "documents" not in inspect.signature(engine.forward).parameters:
        raise BadRequest(f"engine {engine.name} does not take packed rows (seq_lens): send unpacked rows, or serve with --engine hf, vllm or sglang")
    return engine.forward(input_ids, attention_mask, capture, documents=documents)


def request_segments(attention_mask: torch.Tensor, documents: Documents | None) -> list[tuple[int, torch.Tensor]]:
    """What an engine that runs one request per sequence (vllm, sglang) sends: (row, real positions) of each row, or
    of each document of a packed row, leaving out those without a real token."""
    if documents is not None:
        return documents.segments(attention_mask)
    rows = [(row, torch.nonzero(attention_mask[row], as_tuple=True)[0]) for row in range(attention_mask.shape[0])]
    return [(row, positions) for row, positions in rows if len(positions)]


def fill_padding(out: ForwardOutput, attention_mask: torch.Tensor) -> ForwardOutput:
    """Zero every tensor of ``out`` at the positions where ``attention_mask`` is 0, in place.

    What a target computes for a padding token depends on the engine (transformers runs it, vLLM never
    sees it), so every engine's padded positions are defined the same way: all zeros. Real positions are
    untouched. A batch without padding costs one check.
    """
    if bool(attention_mask.all()):
        return out
    for tensor in [*out.layer_outputs.values(), out.embeddings, out.final_hidden, out.logits, out.joined]:
        if tensor is not None:
            zero_padding_(tensor, attention_mask)
    return out
