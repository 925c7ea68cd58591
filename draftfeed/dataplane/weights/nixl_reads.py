"""A worker reading a weight update's pieces itself, one-sided, from the memory a publisher registered with NIXL
(publisher.py offers it; worker.py chooses it when this process has NIXL and the manifest says where each tensor lies).

Each piece is read into one of ``ahead`` staging slots of host memory, registered once (``ahead`` x the piece size:
the whole of the extra memory), and handed to the same checks and writes as a piece that came as a frame; a slot is
read into again only after its piece was written. A read that fails or does not finish within the timeout is a
``ConnectionError``, as a publisher that stops answering is.
"""

from __future__ import annotations

import time
import uuid

import torch

from draftfeed.dataplane.nixl.memory import Region, host_memory
from draftfeed.dataplane.nixl.transport import NixlAgent, NixlError, Transfer
from draftfeed.dataplane.weights.plan import Piece
from draftfeed.schemas.messages import WeightsRegion


class NixlReads:
    """The pieces of one update, read from the publisher's agent ``remote`` (its metadata already given) into slots."""

    plane = "NIXL"

    def __init__(self, metadata: bytes, regions: list[WeightsRegion], pieces: list[Piece], chunk_bytes: int, ahead: int, timeout_s: float) -> None:
        self.regions, self.pieces, self.timeout_s = regions, pieces, timeout_s
        self.agent = NixlAgent(f"draftfeed-weights-reader-{uuid.uuid4().hex[:12]}")
        try:
            self.memory = host_memory(chunk_bytes * ahead)
            self.slots = [Region(self.memory.ctypes.data + slot * chunk_bytes, chunk_bytes) for slot in range(ahead)]
            self.agent.register(Region(self.memory.ctypes.data, self.memory.nbytes))
            self.remote = self.agent.add_remote(metadata)
        except BaseException:
            self.agent.close()
            raise
        self._reads: dict[int, Transfer] = {}
        self.failed = False  # a read failed: the plane's fault, not the update's
        self.closed = False

    def ask(self, index: int) -> None:
        """Start reading piece ``index`` into its slot (free: the piece ``ahead`` before it is written)."""
        piece, region = self.pieces[index], self.regions[self.pieces[index].tensor]
        local = self._slot(index)
        remote = Region(region.address + piece.offset, piece.nbytes, region.device, region.kind)
        try:
            self._reads[index] = self.agent.read([Region(local.address, piece.nbytes)], [remote], self.remote)
        except NixlError as exc:
            self.failed = True
            raise ConnectionError(str(exc)) from None

    def take(self, index: int) -> torch.Tensor:
        """Piece ``index``'s bytes once they have landed in its slot (valid until the slot is read into again)."""
        transfer, piece = self._reads.pop(index), self.pieces[index]
        deadline, pause = time.monotonic() + self.timeout_s, 1e-5
        self.failed = True  # until the read is done
        try:
            while (state := transfer.poll()) == "PROC":
                if time.monotonic() > deadline:
                    raise ConnectionError(f"a NIXL read of piece {index} from the publisher did not finish within {self.timeout_s:g} s")
                time.sleep(pause)  # polling a read that UCX's progress thread moves, not synchronising peers
                pause = min(pause * 2, 1e-3)
        except NixlError as exc:
            raise ConnectionError(str(exc)) from None
        finally:
            transfer.release()
        if state != "DONE":
            raise ConnectionError(f"a NIXL read of piece {index} from the publisher failed ({state})")
        self.failed = False
        start = self._slot(index).address - self.memory.ctypes.data
        return torch.from_numpy(self.memory[start : start + piece.nbytes])

    def _slot(self, index: int) -> Region:
        return self.slots[index % len(self.slots)]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for transfer in self._reads.values():
            transfer.release()
        self._reads.clear()
        self.agent.remove_remote(self.remote)
        self.agent.close()
