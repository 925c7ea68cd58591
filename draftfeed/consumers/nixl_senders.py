"""The worker's NIXL agent and staging arena, shared by all its nixl pairs (pair_planes.py keeps their life).

An answer's tensors are copied end to end into an arena (schemas/tensor_specs.py packed_layout) and written
from there with one NIXL write into the slot the rank granted. Each arena is registered once and grown (a new
one registered, the old one dropped) only when an answer needs more: on the engine's device, so a GPU
engine's answer goes from its GPU's memory, and a CUDA rank's slot is on its GPU (GPUDirect where UCX has it).
There are ``ARENAS`` arenas, taken in turn: the compute loop posts a write, sends its header and goes on; the next
answer is staged into the other arena while the first is still being written, and an arena is staged into again
only once the write from it has landed (the worker keeps the writes in flight in order, at most one per arena).
Bound: ARENAS x the largest answer, on the engine's device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from draftfeed.dataplane.nixl_transport import NixlAgent, NixlError, Region, Transfer

log = logging.getLogger("draftfeed.worker")

_ROUND = 1 << 20
ARENAS = 2  # answers staged or in flight at once: one being written while the next is staged


class Write:
    """One posted write of the staged answer, until NIXL says its bytes have landed."""

    def __init__(self, transfer: Transfer, nbytes: int, remote_agent: str, deadline: float, gone: Callable[[], bool]) -> None:
        self.transfer, self.nbytes, self.remote_agent, self.deadline, self.gone = transfer, nbytes, remote_agent, deadline, gone

    def done(self) -> bool:
        """Whether it has landed, without waiting; raises NixlError on an error, past its deadline, or as soon as
        ``gone()`` (the broker reported the rank gone: a write to a dead rank may never end). Released once it ends."""
        try:
            state = self.transfer.poll()
            if state == "DONE":
                self.transfer.release()
                return True
            if state != "PROC":
                raise NixlError(f"a NIXL write of {self.nbytes} bytes to {self.remote_agent} failed ({state})")
            if time.monotonic() > self.deadline:
                raise NixlError(f"a NIXL write of {self.nbytes} bytes to {self.remote_agent} did not finish in time")
            if self.gone():
                raise NixlError(f"the broker reported rank agent {self.remote_agent} gone during a NIXL write")
        except NixlError:
            self.transfer.release()
            raise
        return False

    def wait(self) -> None:
        """Until it has landed; raises as ``done`` does."""
        pause = 1e-5
        while not self.done():
            time.sleep(pause)  # polling a transfer that UCX's progress thread moves, not synchronising peers
            pause = min(pause * 2, 1e-3)


class NixlSender:
    def __init__(self, worker: str, device: torch.device) -> None:
        self.worker, self.device = worker, device
        self.agent: NixlAgent | None = None
        self._arenas: list[tuple[np.ndarray | torch.Tensor, Region] | None] = [None] * ARENAS
        self._next = 0  # the arena the next answer is staged into

    @property
    def name(self) -> str:
        return self.ensure().name

    def ensure(self) -> NixlAgent:
        """The agent, started on first use; raises NixlError where NIXL cannot run."""
        if self.agent is None:
            self.agent = NixlAgent(f"draftfeed-worker-{self.worker}")
        return self.agent

    def connect(self, metadata: bytes) -> str:
        return self.ensure().add_remote(metadata)

    def disconnect(self, remote_agent: str) -> None:
        if self.agent is not None:
            self.agent.remove_remote(remote_agent)

    def stage(self, tensors: Mapping[str, torch.Tensor], offsets: Sequence[int], total: int) -> Region:
        """Copy the answer into the next arena at ``offsets``; the region holding it. The write posted from that
        arena before (ARENAS answers ago) must have landed."""
        region, raw = self._room(self._next, total)
        self._next = (self._next + 1) % ARENAS
        for tensor, offset in zip(tensors.values(), offsets):
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            raw[offset : offset + flat.numel()].copy_(flat)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Region(region.address, total, region.device, region.kind)

    def post(self, local: Region, remote: Region, remote_agent: str, notification: bytes, timeout_s: float, gone: Callable[[], bool]) -> Write:
        """Start writing the staged answer; UCX's progress thread moves it. The arena must not be staged into again
        until the write is done (``Write.wait``)."""
        return Write(self.ensure().write(local, remote, remote_agent, notification), local.nbytes, remote_agent, time.monotonic() + timeout_s, gone)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()
        self.agent, self._arenas = None, [None] * ARENAS

    def _room(self, index: int, total: int) -> tuple[Region, torch.Tensor]:
        held = self._arenas[index]
        if held is None or held[1].nbytes < total:
            agent = self.ensure()
            size = max(_ROUND, -(-total // _ROUND) * _ROUND)
            if held is not None:
                agent.deregister(held[1])
            if self.device.type == "cuda":
                arena: np.ndarray | torch.Tensor = torch.empty(size, dtype=torch.uint8, device=self.device)
                region = Region(arena.data_ptr(), size, self.device.index or 0, "VRAM")
            else:
                arena = np.empty(size, dtype=np.uint8)
                arena.fill(0)  # touch every page once
                region = Region(arena.ctypes.data, size, 0, "DRAM")
            agent.register(region)
            held = self._arenas[index] = (arena, region)
            log.info("worker %s: NIXL staging arena %d of %d MiB on %s", self.worker, index, size >> 20, self.device)
        arena, region = held
        raw = arena if isinstance(arena, torch.Tensor) else torch.from_numpy(arena)
        return region, raw
