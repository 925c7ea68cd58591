"""Tensor frames described by their specs, checked without torch: what the broker needs of them, and the first
step of every decode (dataplane/frames/codec.py builds the tensors).

A tensor travels as one frame of its raw bytes in C order; its spec (name, dtype, shape) is in the header.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.protocol import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_TENSOR_BYTES, MAX_TENSORS_PER_MESSAGE

# The dtypes the wire carries and their sizes in bytes (bool as one byte per element).
ITEMSIZES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def frame_buffer(frame: Any) -> memoryview:
    """The bytes of a received frame (zmq.Frame, bytes, bytearray or memoryview), without copying."""
    buffer = getattr(frame, "buffer", None)
    return buffer if buffer is not None else memoryview(frame)


def spec_bytes(spec: TensorSpec) -> int | None:
    """The bytes one spec announces, or None for a dtype the wire does not carry."""
    itemsize = ITEMSIZES.get(spec.dtype)
    return None if itemsize is None else spec.numel() * itemsize


def declared_bytes(specs: Sequence[TensorSpec]) -> int | None:
    """The bytes the specs announce in all, or None if a dtype is unknown (check_frames says which)."""
    total = 0
    for spec in specs:
        size = spec_bytes(spec)
        if size is None:
            return None
        total += size
    return total


def check_frames(
    specs: Sequence[TensorSpec],
    frames: Sequence[Any],
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> list[memoryview]:
    """The frames' buffers, once frame count, dtype names, unique names, declared sizes against the limits,
    and each frame holding exactly shape x itemsize bytes are checked; nothing is allocated or copied.
    Raises MalformedMessage with what is wrong. The broker checks requests with it, workers and ranks
    decode with it."""
    if len(specs) > MAX_TENSORS_PER_MESSAGE:
        raise MalformedMessage(f"message declares {len(specs)} tensors; at most {MAX_TENSORS_PER_MESSAGE} are allowed")
    if len(specs) != len(frames):
        raise MalformedMessage(f"header declares {len(specs)} tensors but the message carries {len(frames)} tensor frames")
    seen: set[str] = set()
    total = 0
    buffers: list[memoryview] = []
    for spec, frame in zip(specs, frames):
        if spec.name in seen:
            raise MalformedMessage(f"tensor name {spec.name!r} appears twice in one message")
        seen.add(spec.name)
        nbytes = spec_bytes(spec)
        if nbytes is None:
            raise MalformedMessage(f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}; known: {', '.join(ITEMSIZES)}")
        if nbytes > max_tensor_bytes:
            raise MalformedMessage(f"tensor {spec.name!r} declares {nbytes} bytes, over the limit of {max_tensor_bytes} bytes per tensor")
        total += nbytes
        if total > max_message_bytes:
            raise MalformedMessage(f"message declares over {max_message_bytes} bytes of tensors, the limit per message")
        buffer = frame_buffer(frame)
        if buffer.nbytes != nbytes:
            raise MalformedMessage(f"tensor {spec.name!r} ({spec.dtype} {spec.shape}) needs {nbytes} bytes but its frame holds {buffer.nbytes}")
        buffers.append(buffer)
    return buffers
