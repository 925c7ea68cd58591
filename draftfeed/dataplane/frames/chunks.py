"""Where each chunk of a chunked result goes: the plan both sides compute from the result's header alone.

An answer over a worker's ``--transfer-chunk-bytes`` goes as frames in pieces: its ``result`` header (with
``chunk_bytes``), then one ``chunk`` message per piece, in order (docs/protocol.md, "Chunked results"). Each tensor's
bytes (C order) are cut into pieces of ``chunk_bytes``, the last one shorter; a piece never spans two tensors, and an
empty tensor has none. The worker sends piece ``index`` from its tensors' own memory (worker_chunks.py); the rank
writes it at the same place in the tensor it allocated from the header (rank_chunks.py), so neither side ever holds
a second copy of the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.tensor_specs import spec_bytes


class Piece(NamedTuple):
    """One chunk: bytes ``offset`` to ``offset + nbytes`` of tensor number ``tensor`` (in the header's order)."""

    tensor: int
    offset: int
    nbytes: int


def chunk_plan(specs: Sequence[TensorSpec], chunk_bytes: int) -> list[Piece]:
    """Every piece of the tensors ``specs`` describe, in sending order. Raises ValueError for a dtype the wire does
    not carry or a chunk size under one byte."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    pieces = []
    for number, spec in enumerate(specs):
        size = spec_bytes(spec)
        if size is None:
            raise ValueError(f"tensor {spec.name!r} has dtype {spec.dtype!r}, which the wire does not carry")
        pieces.extend(Piece(number, offset, min(chunk_bytes, size - offset)) for offset in range(0, size, chunk_bytes))
    return pieces


def piece_count(specs: Sequence[TensorSpec], chunk_bytes: int) -> int | None:
    """How many pieces ``chunk_plan`` makes, without making them; None for a dtype the wire does not carry."""
    total = 0
    for spec in specs:
        size = spec_bytes(spec)
        if size is None:
            return None
        total += -(-size // chunk_bytes)
    return total
