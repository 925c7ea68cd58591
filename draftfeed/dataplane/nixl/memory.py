"""The memory NIXL moves bytes between, as both sides describe it: a ``Region`` (address, length, device, kind), and
the page-aligned host memory both sides register (the rank's receive slots, the worker's staging arenas, the bench's
raw probes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

MemoryKind = Literal["DRAM", "VRAM"]

# Host memory for NIXL starts on a page boundary. numpy's and malloc's large buffers start 16 bytes into a page,
# while torch's start on a 64-byte line; a copy between two addresses that differ modulo 64 ran at 0.5-0.7 of the
# rate of one between aligned addresses here (UCX's shared-memory path, 64 MB writes, three runs of each pair).
HOST_ALIGNMENT = 4096


@dataclass(frozen=True)
class Region:
    """Memory one side registered: where it starts, how long it is, on which device (0 for host memory)."""

    address: int
    nbytes: int
    device: int = 0
    kind: MemoryKind = "DRAM"


def host_memory(nbytes: int) -> Any:
    """A numpy uint8 array of ``nbytes`` that starts at a multiple of HOST_ALIGNMENT, every page touched (zeros),
    so that neither the first writes into it nor reads from it take page faults."""
    import numpy as np

    whole = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
    start = -whole.ctypes.data % HOST_ALIGNMENT
    memory = whole[start : start + nbytes]  # a view: it keeps the whole array alive
    memory.fill(0)  # written, not np.zeros: calloc's untouched pages would all fault at the first write
    return memory
