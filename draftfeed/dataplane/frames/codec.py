"""Tensor frame codec, the torch side of schemas/tensor_specs.py: tensors to zero-copy frames and back, with every
field of the receipt checked before a tensor is built.

Encoding never copies a contiguous CPU tensor: the frame is a memoryview of the tensor's own memory,
and the numpy array under that view holds the tensor alive until ZeroMQ is done sending it
(pyzmq keeps a reference to the buffer of a ``copy=False`` frame for as long as libzmq needs it).
Decoding views large frames in place with ``torch.frombuffer``; small ones are copied into fresh,
aligned memory (libzmq stores tiny messages inline, without alignment guarantees), and so are
read-only buffers (``bytes``), which a writable tensor must not alias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.protocol import DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_MAX_TENSOR_BYTES, INLINE_COPY_BYTES
from draftfeed.schemas.tensor_specs import check_frames

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises ValueError for dtypes the codec does not carry."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be sent; supported dtypes: {', '.join(DTYPES)}. Convert the tensor first.") from None


def tensor_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes the tensors hold (what an answer of them carries)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its own device (a contiguous copy first if it is not contiguous)."""
    tensor = tensor.detach().contiguous()
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.view(torch.uint8).reshape(-1)


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """A memoryview over the bytes of ``tensor`` (CPU, contiguous), without copying when it already is."""
    if tensor.is_cpu and tensor.dtype is not torch.bfloat16 and not tensor.requires_grad and tensor.is_contiguous() and tensor.numel():
        # The common case, in the fewest calls: numpy shares the memory and holds the tensor alive.
        return memoryview(tensor.numpy()).cast("B")
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.numel() == 0:
        return memoryview(b"")
    # reshape(-1) handles 0-dim tensors; a uint8 view carries bfloat16, which numpy lacks.
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def encode_specs(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The header specs of named tensors, in their order."""
    specs: list[TensorSpec] = []
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        specs.append(TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=list(tensor.shape)))
    return specs


def encode_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], list[memoryview]]:
    """Split named tensors into header specs and one buffer each, in the same order."""
    return encode_specs(tensors), [tensor_frame(tensor) for tensor in tensors.values()]


def decode_tensors(
    specs: Sequence[TensorSpec],
    frames: Sequence[Any],
    *,
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> dict[str, torch.Tensor]:
    """Rebuild named tensors from header specs and received frames (zmq.Frame, bytes or memoryview).

    Everything is checked (check_frames) before any tensor is built. Raises MalformedMessage with what is wrong.
    """
    buffers = check_frames(specs, frames, max_tensor_bytes=max_tensor_bytes, max_message_bytes=max_message_bytes)
    return {spec.name: _view(spec, buffer) for spec, buffer in zip(specs, buffers)}


def allocate(specs: Sequence[TensorSpec], device: torch.device | str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Uninitialised tensors for ``specs`` on ``device``, for a receive to fill: each one's bytes as a flat uint8 tensor
    (where pieces land), and the tensors by name, viewing those bytes as their dtype and shape."""
    flats = [torch.empty(spec.numel() * DTYPES[spec.dtype].itemsize, dtype=torch.uint8, device=device) for spec in specs]
    return flats, {spec.name: flat.view(DTYPES[spec.dtype]).reshape(spec.shape) for spec, flat in zip(specs, flats)}


def pack_tensors(make_header: Any, tensors: Mapping[str, torch.Tensor], **fields: Any) -> list[Any]:
    """Encode tensors and pack them with the header ``make_header(tensors=specs, **fields)``."""
    specs, buffers = encode_tensors(tensors)
    return pack(make_header(tensors=specs, **fields), buffers)


def _view(spec: TensorSpec, buffer: memoryview) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    if buffer.nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    if buffer.readonly:
        # torch tensors are writable; read-only memory (a bytes object) is copied rather than aliased.
        return torch.frombuffer(bytearray(buffer), dtype=torch.uint8).view(dtype).reshape(spec.shape)
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    if buffer.nbytes < INLINE_COPY_BYTES:
        raw = raw.clone()
    return raw.view(dtype).reshape(spec.shape)
