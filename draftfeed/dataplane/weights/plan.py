"""The pieces a weight update moves in: each tensor's bytes, in the manifest's order, cut into pieces of at most
``chunk_bytes``. The publisher and every worker compute the same plan from the same manifest, so a piece is named by
its index alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.tensor_specs import spec_bytes


@dataclass(frozen=True)
class Piece:
    tensor: int  # its tensor's place in the manifest
    offset: int  # where its bytes start in that tensor
    nbytes: int


def plan(specs: Sequence[TensorSpec], chunk_bytes: int) -> list[Piece]:
    """Every piece of the update, in order; an empty tensor has none. The specs' dtypes are the wire's (checked by
    whoever made them)."""
    pieces = []
    for index, spec in enumerate(specs):
        total = spec_bytes(spec) or 0
        pieces.extend(Piece(index, offset, min(chunk_bytes, total - offset)) for offset in range(0, total, chunk_bytes))
    return pieces
