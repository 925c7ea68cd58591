"""The workers of one service that have free credits, best first, in O(log W) per change.

Best: the most free credits, ties to the one whose last request was handed out longest ago (never: first), ties
again to the one that registered first; the scheduler's rule (scheduler.py). A heap of (key, worker) entries: every
change of a worker's credits pushes a fresh entry and leaves the old one behind, stale, to be skipped when it comes
up (lazy deletion). The heap is rebuilt when stale entries outnumber live ones several times over, so its size
stays within a constant factor of the service's workers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection
from typing import Protocol


class WorkerRecord(Protocol):
    """What the heap reads of a worker's record (records.py)."""

    peer: bytes
    last_assigned: int
    order: int
    version: int
    removed: bool
    target_version: int

    @property
    def free_credits(self) -> int: ...


_Entry = tuple[int, int, int, int, WorkerRecord]  # (-free credits, last assigned, registration order, version, worker)


class FreeWorkers:
    def __init__(self) -> None:
        self._heap: list[_Entry] = []
        self._live: dict[bytes, int] = {}  # worker -> the version of its one live entry
        # Versions are unique across records: a worker that registers again is a new record under the same peer, and
        # an entry of its old record must never pass for one of the new.
        self._versions = itertools.count(1)

    def __len__(self) -> int:
        """How many workers have free credits."""
        return len(self._live)

    def update(self, worker: WorkerRecord) -> None:
        """The worker's free credits or its last assignment changed (or it joined, or drains): file it afresh."""
        worker.version = next(self._versions)
        free = worker.free_credits
        if free <= 0 or worker.removed:
            self._live.pop(worker.peer, None)
        else:
            self._live[worker.peer] = worker.version
            heapq.heappush(self._heap, (-free, worker.last_assigned, worker.order, worker.version, worker))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._rebuild()

    def remove(self, worker: WorkerRecord) -> None:
        """The worker left the service."""
        worker.version = next(self._versions)
        self._live.pop(worker.peer, None)

    def pick(self, excluded: Collection[bytes] = (), fits: Callable[[WorkerRecord], bool] | None = None) -> WorkerRecord | None:
        """The best free worker not in ``excluded`` and that ``fits`` (None: any), or None. Entries of the workers
        passed over are put back; they are never more than ``len(excluded)`` plus the workers that do not fit."""
        skipped: list[_Entry] = []
        chosen: WorkerRecord | None = None
        heap = self._heap
        while heap:
            entry = heap[0]
            worker = entry[4]
            if self._live.get(worker.peer) != entry[3]:
                heapq.heappop(heap)  # stale
                continue
            if worker.peer in excluded or (fits is not None and not fits(worker)):
                skipped.append(heapq.heappop(heap))
                continue
            chosen = worker
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return chosen

    def _rebuild(self) -> None:
        live = {}
        for entry in self._heap:
            if self._live.get(entry[4].peer) == entry[3]:
                live[entry[4].peer] = entry
        self._heap = list(live.values())
        heapq.heapify(self._heap)
