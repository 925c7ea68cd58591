"""The rank's half of chunked results (chunks.py has the plan): each piece written into its place as it arrives.

A chunked ``result`` header allocates the answer's tensors once, on the rank's device (so a CUDA rank holds about
one piece of host memory per transfer: the frame libzmq received it into, freed as soon as it is copied). Each
``chunk`` is checked against the plan (its index next, its length the piece's) and copied into place; the last one
hands the tensors over, as a whole answer on frames would be. Called on the rank's IO thread only.

A partial answer is freed at once when it can no longer complete: its request was answered another way, a new
header for the same request came (from the broker's next attempt, on this worker or another), its worker is gone
or a piece came out of order or of the wrong size (both: the request is asked for again), or the rank closes. With
the worker's ``--checksum`` each piece is also read into its tensor's digest as it lands; an answer whose digests
differ from the header's is dropped when its last piece comes (``on_changed``: the request is asked for again).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from draftfeed.dataplane.digests import StreamedDigests
from draftfeed.dataplane.frames.chunks import Piece, chunk_plan, piece_count
from draftfeed.dataplane.frames.codec import allocate
from draftfeed.schemas.messages import Chunk, Result
from draftfeed.schemas.tensor_specs import declared_bytes, frame_buffer

log = logging.getLogger("draftfeed.producer")

MAX_PIECES = 1 << 22  # pieces one answer may come in (its plan is a list): 64 TiB at the default 16 MiB a piece

Awaiting = Callable[[int, int], Hashable | None]  # (request_id, token) -> the request it answers, None if answered
OnComplete = Callable[[Result, dict[str, torch.Tensor], float], None]  # header, tensors, seconds from header to last piece
OnRefused = Callable[[Result, str], None]
OnLost = Callable[[Result, str], None]


@dataclass
class _Assembly:
    header: Result
    request: Hashable
    pieces: list[Piece]
    tensors: dict[str, torch.Tensor]
    flats: list[torch.Tensor]  # each tensor's bytes, flat (uint8), where the pieces go
    nbytes: int
    streamed: StreamedDigests | None = None  # with the worker's --checksum: each tensor's digest, read as pieces land
    next: int = 0
    started_at: float = field(default_factory=time.monotonic)


class ChunkAssemblies:
    """The chunked answers this rank is receiving, keyed by (worker, request id)."""

    def __init__(
        self,
        device: torch.device | str,
        max_result_bytes: int,
        awaiting: Awaiting,
        on_progress: Callable[[int], None],
        on_complete: OnComplete,
        on_refused: OnRefused,
        on_lost: OnLost,
        on_changed: OnLost,
    ) -> None:
        """``awaiting``: which request an answer is for, if it still waits; ``on_progress(request_id)``: a piece of its
        answer arrived (its wait is not over while pieces come); ``on_complete``: the whole answer and the seconds from its
        header to its last piece, or, for one whose request no longer waits, its header alone (the session drops it,
        and counts it as it counts any duplicate)."""
        self.device = torch.device(device)
        self.max_result_bytes = max_result_bytes
        self._awaiting, self._on_progress = awaiting, on_progress
        self._on_complete, self._on_refused, self._on_lost, self._on_changed = on_complete, on_refused, on_lost, on_changed
        self._assemblies: dict[tuple[str, int], _Assembly] = {}
        self.pieces_dropped = 0  # pieces of answers not (or no longer) being assembled
        self.completed = 0

    @property
    def held_bytes(self) -> int:
        """Bytes allocated for answers still being assembled."""
        return sum(assembly.nbytes for assembly in self._assemblies.values())

    def __len__(self) -> int:
        return len(self._assemblies)

    def begin(self, header: Result) -> None:
        """A chunked answer's header: allocate its tensors, unless its request no longer waits or it is over limits."""
        request = self._awaiting(header.request_id, header.token)
        for key, assembly in list(self._assemblies.items()):
            if assembly.request == request or key == (header.worker, header.request_id):
                self._drop(key, f"a new answer to request {header.request_id} began (from worker {header.worker})")
        if request is None:  # answered already (or not ours): the session counts it dropped; its pieces are as they come
            self._on_complete(header, {}, 0.0)
            return
        total = declared_bytes(header.tensors)
        if total is None:
            self._on_refused(header, f"the answer names a dtype this rank does not know ({', '.join(s.dtype for s in header.tensors)})")
            return
        if total > self.max_result_bytes:
            self._on_refused(header, f"the answer announces {total} bytes, over this rank's max_result_bytes of {self.max_result_bytes}")
            return
        assert header.chunk_bytes is not None
        count = piece_count(header.tensors, header.chunk_bytes)
        if count is not None and count > MAX_PIECES:
            self._on_refused(
                header,
                f"the answer comes in {count} pieces of {header.chunk_bytes} bytes, more than {MAX_PIECES}: raise the worker's --transfer-chunk-bytes",
            )
            return
        flats, tensors = allocate(header.tensors, self.device)
        pieces = chunk_plan(header.tensors, header.chunk_bytes)
        streamed = StreamedDigests(len(flats)) if header.digests is not None else None
        self._assemblies[(header.worker, header.request_id)] = _Assembly(header, request, pieces, tensors, flats, total, streamed)

    def piece(self, message: Chunk, frames: list[Any]) -> None:
        """One piece: into its place; the last one completes the answer."""
        key = (message.worker, message.request_id)
        assembly = self._assemblies.get(key)
        if assembly is None or assembly.header.token != message.token:
            self.pieces_dropped += 1
            return
        if self._awaiting(message.request_id, message.token) != assembly.request:
            self.pieces_dropped += 1
            self._drop(key, f"request {message.request_id} was answered another way")
            return
        expected = assembly.pieces[assembly.next] if assembly.next < len(assembly.pieces) else None
        buffer = frame_buffer(frames[0]) if len(frames) == 1 else None
        if message.index != assembly.next or expected is None or buffer is None or buffer.nbytes != expected.nbytes:
            got = f"piece {message.index} of {0 if buffer is None else buffer.nbytes} bytes in {len(frames)} frames"
            want = "no more pieces" if expected is None else f"piece {assembly.next} of {expected.nbytes} bytes"
            self._drop(key, f"{got} where {want} was due")
            self._on_lost(assembly.header, f"its pieces came wrong ({got} where {want} was due)")
            return
        tensor, offset, nbytes = expected
        assembly.flats[tensor][offset : offset + nbytes].copy_(torch.frombuffer(buffer, dtype=torch.uint8))
        if assembly.streamed is not None:
            assembly.streamed.update(tensor, buffer)
        assembly.next += 1
        self._on_progress(message.request_id)
        if assembly.next == len(assembly.pieces):
            del self._assemblies[key]
            header = assembly.header
            changed = assembly.streamed.mismatch(list(assembly.tensors), header.digests) if assembly.streamed and header.digests else None
            if changed is not None:
                self._on_changed(header, changed)
                return
            self.completed += 1
            self._on_complete(header, assembly.tensors, time.monotonic() - assembly.started_at)

    def worker_gone(self, worker: str) -> None:
        """The broker reports the worker gone: its partial answers will not complete. Each request that still waits is
        asked for again: the broker sends a dead worker's unfinished requests elsewhere itself, but not one the worker
        reported done while its last pieces were still on their way (the first answer to come is used)."""
        for key in [key for key in self._assemblies if key[0] == worker]:
            assembly = self._assemblies[key]
            self._drop(key, f"worker {worker} is gone")
            if self._awaiting(assembly.header.request_id, assembly.header.token) == assembly.request:
                self._on_lost(assembly.header, f"worker {worker} left with {len(assembly.pieces) - assembly.next} pieces of it still to come")

    def close(self) -> None:
        for key in list(self._assemblies):
            self._drop(key, "the rank is closing")

    def _drop(self, key: tuple[str, int], why: str) -> None:
        assembly = self._assemblies.pop(key)
        log.info(
            "draftfeed: dropping the partial answer of worker %s to request %d (%d of %d pieces, %.1f s): %s",
            key[0],
            key[1],
            assembly.next,
            len(assembly.pieces),
            time.monotonic() - assembly.started_at,
            why,
        )
