"""The rank's NIXL receive memory: slots registered once and reused, bounded, never written while viewed.

A worker asks for room for one answer (``nixl_want``); the pool grants a slot: a free one of a fitting size
(at least the answer, at most 5/4 of it), else a new one while the pool's registered bytes stay within
``limit_bytes`` (freeing unused slots of other sizes to make room), else none, and the answer goes as
frames. Host slots are allocated once and touched once, so receives into them take no page faults; a large one is
allocated off the rank's IO thread (NeedsMemory: touching gigabytes takes seconds, and that thread keeps the rank's
heartbeats).

A slot's life: free -> granted (to one want of one worker's pair) -> filled (the notification came) ->
taken (the tensors handed to the user view it) -> free again when the last of those tensors is freed
(a finalizer on the memory they share). A granted slot whose write may still land (its worker failed or
went silent) is quarantined: it is not granted again until ``quarantine_s`` later, past the worker's own
write timeout. On a CUDA rank the tensors are cloned on the device out of the slot (no host copy), and the
slot is free again at once.

Bound: the registered bytes never exceed ``limit_bytes``; every grant is at most one slot; a slot is written
only between its grant and its notification, never while the user holds tensors over it.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draftfeed.dataplane.frames.codec import DTYPES
from draftfeed.dataplane.nixl.layout import packed_layout
from draftfeed.dataplane.nixl.memory import Region, host_memory
from draftfeed.schemas.messages import TensorSpec

log = logging.getLogger("draftfeed.producer")

_ROUND = 1 << 16  # slots are whole multiples of 64 KiB
_REUSE_SLACK = 1.25  # a free slot up to this much larger than the answer is reused


@dataclass
class Slot:
    index: int
    region: Region
    memory: np.ndarray | torch.Tensor  # the host array or CUDA tensor the region is
    state: str = "free"  # free | granted | filled | taken | quarantined
    holder: tuple[str, int, int] | None = None  # (worker, generation, want) while granted or filled
    free_at: float = 0.0  # quarantined until


class PoolFull(Exception):
    """No slot for this answer: the reason names the setting to change."""


class NeedsMemory(Exception):
    """A new host slot of ``size`` bytes is needed: allocating and touching that much takes seconds for a large
    answer, so the caller prepares it apart (``host_memory``, off the thread that keeps the rank's heartbeats) and
    grants again with it. There is room for it in the pool now."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a new slot of {size} bytes")
        self.size = size


PREPARED_BYTES = 64 << 20  # new host slots of this size or more are allocated apart (NeedsMemory)


class ReceivePool:
    """Slots for one rank. ``register``/``deregister`` are the agent's; every method is thread-safe (a slot is
    freed on whichever thread drops the user's last tensor over it)."""

    def __init__(
        self,
        device: torch.device,
        limit_bytes: int,
        register: Callable[[Region], None],
        deregister: Callable[[Region], None],
        quarantine_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device, self.limit_bytes, self.quarantine_s = device, limit_bytes, quarantine_s
        self._register, self._deregister, self._clock = register, deregister, clock
        self._slots: dict[int, Slot] = {}
        self._next = 0
        self._lock = threading.Lock()
        self.kind = "VRAM" if device.type == "cuda" else "DRAM"

    # ------------------------------------------------------------ grants (IO thread)
    def grant(self, holder: tuple[str, int, int], nbytes: int, memory: np.ndarray | None = None) -> Slot:
        """A slot of at least ``nbytes`` for ``holder``; raises PoolFull with the reason, or NeedsMemory for a large
        new host slot, to be granted again with ``memory`` of that size (from ``host_memory``)."""
        with self._lock:
            self._end_quarantines()
            slot = self._fitting_free(nbytes)
            if slot is None:
                slot = self._new(nbytes, memory)
            slot.state, slot.holder = "granted", holder
            return slot

    def filled(self, index: int, holder: tuple[str, int, int]) -> Slot | None:
        """The notification for this slot came: it holds the answer. None if the slot is not this holder's."""
        with self._lock:
            slot = self._slots.get(index)
            if slot is None or slot.holder != holder or slot.state != "granted":
                return None
            slot.state = "filled"
            return slot

    def granted_to(self, index: int, worker: str, generation: int) -> Slot | None:
        with self._lock:
            slot = self._slots.get(index)
            if slot is None or slot.holder is None or slot.holder[:2] != (worker, generation) or slot.state not in ("granted", "filled"):
                return None
            return slot

    def quarantine(self, worker: str, generation: int | None = None) -> int:
        """Slots granted to this worker (of this generation, or any) whose write may still land: not granted again
        for quarantine_s. Returns how many. A filled slot was written: it is free at once."""
        count = 0
        with self._lock:
            for slot in self._slots.values():
                if slot.holder is None or slot.holder[0] != worker or (generation is not None and slot.holder[1] != generation):
                    continue
                if slot.state == "granted":
                    slot.state, slot.free_at = "quarantined", self._clock() + self.quarantine_s
                    count += 1
                elif slot.state == "filled":
                    slot.state = "free"
                slot.holder = None
        return count

    # ------------------------------------------------------------ handing out tensors
    def take(self, slot: Slot, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """The answer's tensors over the filled slot. On the host they view the slot, which is free again when the
        last of them is freed; on CUDA they are device clones and the slot is free at once."""
        offsets, _total = packed_layout(specs)
        if isinstance(slot.memory, torch.Tensor):
            raw = slot.memory
            out = {spec.name: _tensor(raw, offset, spec).clone() for spec, offset in zip(specs, offsets)}
            self._free(slot.index)
            return out
        with self._lock:
            slot.state, slot.holder = "taken", None
        view = slot.memory[:]  # a fresh array object over the slot: the tensors' storage holds it alone
        weakref.finalize(view, self._free, slot.index)
        raw = torch.from_numpy(view)
        del view
        return {spec.name: _tensor(raw, offset, spec) for spec, offset in zip(specs, offsets)}

    def indices(self) -> set[int]:
        """The slots registered now."""
        with self._lock:
            return set(self._slots)

    def stats(self) -> dict[str, int]:
        with self._lock:
            states = [slot.state for slot in self._slots.values()]
            return {
                "slots": len(states),
                "registered_bytes": sum(slot.region.nbytes for slot in self._slots.values()),
                "taken": states.count("taken"),
                "quarantined": states.count("quarantined"),
            }

    def close(self) -> None:
        with self._lock:
            for slot in self._slots.values():
                self._deregister(slot.region)
            self._slots.clear()

    # ------------------------------------------------------------ internals (under the lock)
    def _free(self, index: int) -> None:
        with self._lock:
            slot = self._slots.get(index)
            if slot is not None and slot.state in ("taken", "filled"):
                slot.state, slot.holder = "free", None

    def _end_quarantines(self) -> None:
        now = self._clock()
        for slot in self._slots.values():
            if slot.state == "quarantined" and now >= slot.free_at:
                slot.state = "free"

    def _fitting_free(self, nbytes: int) -> Slot | None:
        fitting = [s for s in self._slots.values() if s.state == "free" and nbytes <= s.region.nbytes <= max(_ROUND, nbytes * _REUSE_SLACK)]
        return min(fitting, key=lambda s: s.region.nbytes) if fitting else None

    def _new(self, nbytes: int, prepared: np.ndarray | None) -> Slot:
        size = max(_ROUND, -(-nbytes // _ROUND) * _ROUND)
        if size > self.limit_bytes:
            raise PoolFull(f"an answer of {nbytes} bytes is larger than the whole receive pool (nixl_pool_bytes={self.limit_bytes})")
        used = sum(slot.region.nbytes for slot in self._slots.values())
        for slot in sorted((s for s in self._slots.values() if s.state == "free"), key=lambda s: -s.region.nbytes):
            if used + size <= self.limit_bytes:
                break
            used -= slot.region.nbytes
            del self._slots[slot.index]
            self._deregister(slot.region)
        if used + size > self.limit_bytes:
            held = [s for s in self._slots.values() if s.state == "taken"]
            raise PoolFull(
                f"the nixl receive pool is full: {len(held)} slots ({sum(s.region.nbytes for s in held)} bytes) are still viewed by "
                f"tensors you hold, {used} of nixl_pool_bytes={self.limit_bytes} registered; raise nixl_pool_bytes or drop "
                "references to earlier batches (this answer comes as frames)"
            )
        memory: np.ndarray | torch.Tensor
        if self.device.type == "cuda":
            memory = torch.empty(size, dtype=torch.uint8, device=self.device)
            region = Region(memory.data_ptr(), size, self.device.index or 0, "VRAM")
        else:
            if prepared is not None and prepared.nbytes == size:
                memory = prepared
            elif size >= PREPARED_BYTES:
                raise NeedsMemory(size)
            else:
                memory = host_memory(size)  # every page touched now, once, rather than at the first receives
            region = Region(memory.ctypes.data, size, 0, "DRAM")
        self._register(region)
        slot = Slot(self._next, region, memory)
        self._next += 1
        self._slots[slot.index] = slot
        return slot


def _tensor(raw: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    dtype = DTYPES[spec.dtype]
    nbytes = spec.numel() * dtype.itemsize
    return raw[offset : offset + nbytes].view(dtype).reshape(spec.shape)
