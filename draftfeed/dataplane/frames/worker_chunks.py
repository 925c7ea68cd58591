"""The worker's half of a chunked result (chunks.py has the plan): its header, then each piece as a message of its
own, made only when it is about to be sent.

A piece of a contiguous host tensor is a view of the tensor's own memory (libzmq sends from it, zero-copy). A piece
of a device tensor is copied to the host when its message is made, so the host holds only the pieces libzmq has
not sent yet (the link's high-water mark), never a host copy of the whole answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from draftfeed.dataplane.frames.chunks import chunk_plan
from draftfeed.dataplane.frames.codec import encode_specs, flat_bytes, tensor_frame
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import Chunk, Result


class ChunkedResult:
    """A result of ``tensors`` to send in pieces of at most ``chunk_bytes``: ``header`` first, then ``pieces()``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], chunk_bytes: int, **fields: Any) -> None:
        specs = encode_specs(tensors)
        self.header = pack(Result(tensors=specs, chunk_bytes=chunk_bytes, **fields))
        self.plan = chunk_plan(specs, chunk_bytes)
        self._flat = [_flat_bytes(tensor) for tensor in tensors.values()]
        self._names = {key: fields[key] for key in ("request_id", "token", "worker")}

    def __len__(self) -> int:
        return len(self.plan)

    def pieces(self) -> Iterator[list[Any]]:
        """Each piece's message, in order; a device tensor's piece is copied to the host here."""
        for index, (tensor, offset, nbytes) in enumerate(self.plan):
            flat = self._flat[tensor]
            if isinstance(flat, memoryview):
                buffer = flat[offset : offset + nbytes]
            else:
                buffer = memoryview(flat[offset : offset + nbytes].cpu().numpy())
            yield pack(Chunk(index=index, **self._names), [buffer])


def _flat_bytes(tensor: torch.Tensor) -> memoryview | torch.Tensor:
    """A host tensor's bytes as a memoryview (its own memory when contiguous); a device tensor as a flat uint8 view,
    each piece of which goes to the host on its own."""
    return tensor_frame(tensor) if tensor.device.type == "cpu" else flat_bytes(tensor)
