"""What both sides of a nixl pair compute alike, without torch: where each tensor of an answer lies in its slot, and the
notification a write carries to the rank when it lands.

An answer's tensors lie end to end in one slot, each starting at a multiple of ``PACKED_ALIGNMENT``, so that every
dtype can be viewed in place; the worker writes them there (dataplane/nixl/worker.py) and the rank views them back
(dataplane/nixl/rank_slots.py), both from the header's specs alone. The notification ``generation:slot:want`` names the
grant the write fills.
"""

from __future__ import annotations

from collections.abc import Sequence

from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.messages import TensorSpec
from draftfeed.schemas.tensor_specs import ITEMSIZES, spec_bytes

PACKED_ALIGNMENT = 64


def packed_layout(specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
    """Where each tensor starts when an answer's tensors lie end to end in one region (the nixl plane), each at a
    multiple of PACKED_ALIGNMENT, and the region's length. Both sides compute it from the header's specs alone.
    Raises MalformedMessage for a dtype the wire does not carry."""
    offsets: list[int] = []
    end = 0
    for spec in specs:
        nbytes = spec_bytes(spec)
        if nbytes is None:
            raise MalformedMessage(f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}; known: {', '.join(ITEMSIZES)}")
        start = -(-end // PACKED_ALIGNMENT) * PACKED_ALIGNMENT
        offsets.append(start)
        end = start + nbytes
    return offsets, end


def notification(generation: int, slot: int, want: int) -> bytes:
    """What a worker's NIXL write carries to the rank when it lands: which grant it fills."""
    return f"{generation}:{slot}:{want}".encode()


def parse_notification(raw: bytes) -> tuple[int, int, int] | None:
    """(generation, slot, want) of a notification, or None for one that is not ours."""
    try:
        generation, slot, want = (int(part) for part in raw.decode().split(":"))
    except (UnicodeDecodeError, ValueError):
        return None
    return generation, slot, want
