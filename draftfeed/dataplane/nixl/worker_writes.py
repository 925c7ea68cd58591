"""The worker's NIXL agent, where each answer is written from, and the writes in flight, shared by all its nixl
pairs (dataplane/nixl/worker.py is one pair's protocol). One write's state is a ``Write``: what it reads (its ``Source``: the
answer's tensors or a staging arena), the rank's slot it fills, its notification, NIXL's handle and its deadline.

An answer is written from one of two sources (``choose_source`` decides, and says why):

- ``direct``: from the answer's own tensors, each registered with NIXL for the write (a registration is counted,
  so memory several answers share is registered once) and deregistered once the write has landed. No copy: for
  host memory, where UCX's shared-memory and TCP transports register in microseconds.
- ``staged``: copied end to end into an arena (dataplane/nixl/layout.py packed_layout) registered once, and
  written from there. For a GPU engine's answer (a copy at HBM speed costs less than registering CUDA memory for
  every answer, and the arena is on the engine's GPU, so the write goes from GPU memory), and for host memory whose
  registration turned out slower than copying it (RDMA transports pin the pages they register).
  There are ``ARENAS`` arenas, taken in turn, each grown (a new one registered, the old one dropped) only when an
  answer needs more; an arena is staged into again only once the write from it has landed.

Either way the compute loop posts a write, sends its header and goes on; the sender keeps the writes in flight in
order, at most ``ARENAS`` (``start``, ``finish_writes``), and an answer's tensors are not written after the task returns them (as for frames,
which libzmq sends from them). A CUDA rank's slot is on its GPU (GPUDirect where UCX has it).
Bound: ``ARENAS`` answers in flight; staged, ``ARENAS`` x the largest answer of arena memory on the engine's device.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from draftfeed.dataplane.nixl.memory import Region, host_memory
from draftfeed.dataplane.nixl.transport import NixlAgent, NixlError, Transfer

log = logging.getLogger("draftfeed.worker")

_ROUND = 1 << 20
ARENAS = 2  # answers staged or in flight at once: one being written while the next is prepared
# A host-memory copy's rate, about one server core's memcpy: a registration slower than copying this fast is not worth it.
HOST_COPY_BYTES_PER_S = 10e9
# Registrations of fewer bytes say nothing about the rate (a fixed cost of microseconds dominates, and copying a
# small answer costs little either way): they never turn direct writes off.
MEASURED_REGISTRATION_BYTES = 8 << 20

SourceKind = Literal["direct", "staged"]


def choose_source(tensors: Mapping[str, torch.Tensor], registration_s: float | None, registered_bytes: int) -> tuple[SourceKind, str]:
    """Where to write an answer from, and why. ``registration_s``: how long registering ``registered_bytes`` of
    an earlier answer's host memory took (None before the first; only ``MEASURED_REGISTRATION_BYTES`` or more count).

    Direct from host memory while registering it costs less than copying it; staged for CUDA memory (and any
    answer not wholly in host memory), and for host memory once a registration was slower than a copy."""
    devices = {tensor.device.type for tensor in tensors.values()}
    if devices != {"cpu"}:
        return (
            "staged",
            f"the answer is in {'/'.join(sorted(devices))} memory: a device copy into the registered arena costs less than registering it for every answer",
        )
    if registration_s is not None and registered_bytes >= MEASURED_REGISTRATION_BYTES and registration_s * HOST_COPY_BYTES_PER_S > registered_bytes:
        return "staged", (
            f"registering {registered_bytes / 1e6:.1f} MB of host memory took {registration_s * 1e3:.2f} ms, longer than copying it "
            f"(at {HOST_COPY_BYTES_PER_S / 1e9:.0f} GB/s): answers are copied into a registered arena"
        )
    return "direct", "the answer is in host memory, which NIXL registers for less than a copy costs: written straight from its tensors"


@dataclass
class Source:
    """An answer ready to write: the local regions to read, where each goes in the rank's slot, and what must stay
    alive (and registered) until the write has landed."""

    kind: SourceKind
    regions: list[Region]
    offsets: list[int]
    nbytes: int
    held: list[torch.Tensor] = field(default_factory=list)  # direct: the tensors the regions read

    def remote(self, slot: Region) -> list[Region]:
        """The regions of the rank's ``slot`` these bytes go to."""
        return [Region(slot.address + offset, region.nbytes, slot.device, slot.kind) for region, offset in zip(self.regions, self.offsets)]


class Write:
    """One posted write of an answer, until NIXL says its bytes have landed: all of its state in one place."""

    def __init__(
        self,
        transfer: Transfer,
        source: Source,
        slot: Region,
        remote_agent: str,
        notification: bytes,
        deadline: float,
        gone: Callable[[], bool],
        ended: Callable[[Source, bool], None],
    ) -> None:
        self.transfer = transfer  # NIXL's handle of the posted write
        self.source = source  # what it reads: the answer's own tensors (direct) or a staging arena (staged)
        self.slot = slot  # where it goes: the slot the rank granted
        self.remote_agent = remote_agent
        self.notification = notification  # generation:slot:want, which the rank gets once every byte has landed
        self.deadline, self.gone = deadline, gone
        self.nbytes, self._ended = source.nbytes, ended

    def done(self) -> bool:
        """Whether it has landed, without waiting; raises NixlError on an error, past its deadline, or as soon as
        ``gone()`` (the broker reported the rank gone: a write to a dead rank may never end). Released once it ends;
        a direct source's memory is let go once it has landed (after a failure it stays registered and held until
        the agent closes: a write given up on may still be reading it)."""
        try:
            state = self.transfer.poll()
            if state == "DONE":
                self.transfer.release()
                self._ended(self.source, True)
                return True
            if state != "PROC":
                raise NixlError(f"a NIXL write of {self.nbytes} bytes to {self.remote_agent} failed ({state})")
            if time.monotonic() > self.deadline:
                raise NixlError(f"a NIXL write of {self.nbytes} bytes to {self.remote_agent} did not finish in time")
            if self.gone():
                raise NixlError(f"the broker reported rank agent {self.remote_agent} gone during a NIXL write")
        except NixlError:
            self.transfer.release()
            self._ended(self.source, False)
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
        self._next = 0  # the arena the next staged answer goes into
        self._pinned: dict[Region, int] = {}  # direct sources' registrations: region -> writes in flight that read it
        self._abandoned: list[Source] = []  # direct sources of failed writes, held until the agent closes
        self._registration: tuple[float, int] | None = None  # the last direct answer's registration: seconds, bytes
        self._source_kind: SourceKind | None = None
        self._next_want = 0  # the last want asked for, on any pair
        # The writes in flight, oldest first, each with its pair's report of a failure: at most one per staging arena.
        self._writing: deque[tuple[Write, Callable[[str], None]]] = deque()

    @property
    def name(self) -> str:
        return self.ensure().name

    @property
    def writing(self) -> int:
        """How many writes are in flight (the compute loop checks on them every millisecond meanwhile)."""
        return len(self._writing)

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

    def prepare(self, tensors: Mapping[str, torch.Tensor], offsets: Sequence[int], total: int) -> Source:
        """The answer, ready to be written to a slot laid out at ``offsets`` (``total`` bytes): straight from its
        tensors or staged into the next arena (``choose_source``; the choice is logged when it changes). A staged
        answer needs the write posted from that arena before (ARENAS answers ago) to have landed."""
        registration = self._registration
        kind, why = choose_source(tensors, registration[0] if registration else None, registration[1] if registration else 0)
        if kind != self._source_kind:
            log.info(
                "worker %s: NIXL writes go %s: %s", self.worker, "from the answer's tensors" if kind == "direct" else "through a staging arena", why
            )
            self._source_kind = kind
        return self._direct(tensors, offsets, total) if kind == "direct" else self._stage(tensors, offsets, total)

    def next_want(self) -> int:
        """A new want's number: unique among this worker's wants, whichever pair asks."""
        self._next_want += 1
        return self._next_want

    def post(self, source: Source, slot: Region, remote_agent: str, notification: bytes, timeout_s: float, gone: Callable[[], bool]) -> Write:
        """Start writing ``source`` into the rank's ``slot``; UCX's progress thread moves it. A staged source's arena
        must not be staged into again until the write is done (``Write.wait``)."""
        try:
            transfer = self.ensure().write(source.regions, source.remote(slot), remote_agent, notification)
        except NixlError:
            self._release(source)  # nothing was posted: nothing reads it
            raise
        return Write(transfer, source, slot, remote_agent, notification, time.monotonic() + timeout_s, gone, self._ended)

    def start(
        self,
        source: Source,
        slot: Region,
        remote_agent: str,
        notification: bytes,
        timeout_s: float,
        gone: Callable[[], bool],
        failed: Callable[[str], None],
    ) -> Write:
        """``post``, and keep the write in flight until ``finish_writes`` sees it land; ``failed``: its pair's report
        of a write that failed in flight."""
        write = self.post(source, slot, remote_agent, notification, timeout_s, gone)
        self._writing.append((write, failed))
        return write

    def make_room(self) -> None:
        """Until fewer than ``ARENAS`` writes are in flight: a staged answer's arena must be free again."""
        while len(self._writing) >= ARENAS:
            self.finish_writes(block=True)

    def drain(self) -> None:
        """Until every write in flight has ended (landed, or failed and reported)."""
        while self._writing:
            self.finish_writes(block=True)

    def finish_writes(self, block: bool) -> None:
        """Check on the writes in flight, oldest first, dropping those that have landed (``block``: wait for the
        oldest). One that failed is reported to its pair, which goes down (``pair_close``): the rank gives up on its
        answer and asks again, and the pair is rebuilt after the backoff."""
        while self._writing:
            write, failed = self._writing[0]
            try:
                if block:
                    write.wait()
                elif not write.done():
                    return
            except NixlError as exc:
                failed(str(exc))
            self._writing.popleft()
            if block:
                return

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()  # deregisters every region, direct ones included
        self.agent, self._arenas = None, [None] * ARENAS
        self._writing.clear()
        self._pinned.clear()
        self._abandoned.clear()

    def _ended(self, source: Source, landed: bool) -> None:
        """A write has landed (its direct memory is let go), or was given up on: failed, past its deadline, its rank
        gone (its memory stays registered and held until the agent closes: the transfer may still be reading it)."""
        if landed:
            self._release(source)
        elif source.kind == "direct":
            self._abandoned.append(source)

    def _direct(self, tensors: Mapping[str, torch.Tensor], offsets: Sequence[int], total: int) -> Source:
        agent = self.ensure()
        source = Source("direct", [], [], total)
        registering, fresh = 0.0, 0
        try:
            for tensor, offset in zip(tensors.values(), offsets):
                flat = tensor.detach().contiguous().reshape(-1)  # a copy only for a tensor that is not contiguous
                nbytes = flat.numel() * flat.element_size()
                if nbytes == 0:
                    continue
                region = Region(flat.data_ptr(), nbytes)
                count = self._pinned.get(region, 0)
                if count == 0:
                    started = time.perf_counter()
                    agent.register(region)
                    registering += time.perf_counter() - started
                    fresh += nbytes
                self._pinned[region] = count + 1
                source.held.append(flat)
                source.regions.append(region)
                source.offsets.append(offset)
        except NixlError:
            self._release(source)  # what it registered so far: no registration outlives the memory it covers
            raise
        if fresh:
            self._registration = (registering, fresh)
        return source

    def _release(self, source: Source) -> None:
        """A direct source's write has landed (or was never posted): deregister what no other write reads."""
        if source.kind != "direct":
            return
        for region in source.regions:
            count = self._pinned.get(region, 0) - 1
            if count > 0:
                self._pinned[region] = count
            elif count == 0:
                del self._pinned[region]
                if self.agent is not None:
                    self.agent.deregister(region)
        source.held.clear()

    def _stage(self, tensors: Mapping[str, torch.Tensor], offsets: Sequence[int], total: int) -> Source:
        region, raw = self._room(self._next, total)
        self._next = (self._next + 1) % ARENAS
        for tensor, offset in zip(tensors.values(), offsets):
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            raw[offset : offset + flat.numel()].copy_(flat)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return Source("staged", [Region(region.address, total, region.device, region.kind)], [0], total)

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
                arena = host_memory(size)
                region = Region(arena.ctypes.data, size, 0, "DRAM")
            agent.register(region)
            held = self._arenas[index] = (arena, region)
            log.info("worker %s: NIXL staging arena %d of %d MiB on %s", self.worker, index, size >> 20, self.device)
        arena, region = held
        raw = arena if isinstance(arena, torch.Tensor) else torch.from_numpy(arena)
        return region, raw
