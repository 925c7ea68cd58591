"""Integrity end to end (a worker's ``--checksum``): one digest per tensor of an answer, made by the worker before it
sends and checked by the rank before the answer is used, whatever plane carried it.

The digest is xxHash's XXH3 (64 bits) of the tensor's bytes in C order, as the wire carries them: 28 GB/s on one core
here, so a sample's digests cost a few percent of moving it. A host tensor is read where it lies; a device tensor's
bytes go to the host a piece at a time (``PIECE_BYTES``), never the whole. A rank that finds a digest wrong drops the
answer and asks for the request again: a corrupted transfer costs a retry, never a wrong batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import xxhash

from draftfeed.dataplane.frames.codec import flat_bytes

PIECE_BYTES = 64 << 20  # a device tensor's bytes go to the host this much at a time to be read


def tensor_digest(tensor: torch.Tensor) -> str:
    """The hex XXH3-64 of ``tensor``'s bytes."""
    flat = flat_bytes(tensor)
    hasher = xxhash.xxh3_64()
    if flat.device.type == "cpu":
        hasher.update(memoryview(flat.numpy()))
    else:
        for start in range(0, flat.numel(), PIECE_BYTES):
            hasher.update(memoryview(flat[start : start + PIECE_BYTES].cpu().numpy()))
    return hasher.hexdigest()


def digests(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Each tensor's digest, in the answer's order."""
    return [tensor_digest(tensor) for tensor in tensors.values()]


def mismatch(tensors: Mapping[str, torch.Tensor], expected: Sequence[str]) -> str | None:
    """Which tensor's bytes are not those the worker sent (its digest and the one received), or None."""
    return _first_difference(list(tensors), digests(tensors), expected)


def _first_difference(names: Sequence[str], got: Sequence[str], expected: Sequence[str]) -> str | None:
    for name, digest, sent in zip(names, got, expected):
        if digest != sent:
            return f"{name} arrived with digest {digest}, sent with {sent}"
    return None


class StreamedDigests:
    """The digests of tensors that arrive in pieces, each piece read once as it lands (no second pass)."""

    def __init__(self, count: int) -> None:
        self._hashers = [xxhash.xxh3_64() for _ in range(count)]

    def update(self, tensor: int, buffer: memoryview) -> None:
        self._hashers[tensor].update(buffer)

    def mismatch(self, names: Sequence[str], expected: Sequence[str]) -> str | None:
        return _first_difference(names, [hasher.hexdigest() for hasher in self._hashers], expected)
