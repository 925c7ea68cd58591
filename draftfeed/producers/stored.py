"""A rank's supervision store in use: which batches its store answers, and the recording of the others.

``record``: every batch goes to the workers and is also written. ``replay``: every batch comes from the store,
and one it does not hold is an error naming its key. ``cache``: the store answers the batches it holds, the
workers the others, which are written back. Reads run on one thread in the order they were asked for, at most
``window`` at a time, so a replayed epoch keeps the prefetch depth and memory bound of a computed one. A store may
hold a batch at several target versions: it answers with the one the rank's versions take (store/versions.py), or
not at all, and records each batch under the version its worker computed it at.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from draftfeed.schemas.messages import VersionWanted
from draftfeed.store.errors import BatchNotInStore, StoreError
from draftfeed.store.store import StoreMode, SupervisionStore
from draftfeed.store.versions import Recorded, describe_recorded

Finish = Callable[[Any, dict[str, torch.Tensor]], Any]


@dataclass(frozen=True)
class StoredReply:
    """What ``finish`` gets in place of a worker's result for a batch the store answered."""

    target_version: Recorded  # the version that computed it; None: recorded without one


class StoredSupervision:
    def __init__(self, store: SupervisionStore, window: int, timeout_s: float) -> None:
        self.store = store
        self.mode: StoreMode = store.mode
        self._timeout_s = timeout_s
        self._window = threading.BoundedSemaphore(window)
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftfeed-store-read")
        self._reads.submit(lambda: None)  # its thread starts now, not at the first batch
        self._reading = 0
        self._count_lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def answer(self, key: str, wanted: VersionWanted | None, finish: Finish) -> Future | None:
        """A future of the batch's supervision read from the store, at a version ``wanted`` takes; None when the
        workers must compute it."""
        found, version = (False, None) if self.mode == "record" else self.store.find(key, wanted)
        if self.mode == "replay" and not found:
            raise BatchNotInStore(self._not_held(key, wanted))
        if not found:
            self.misses += 1
            return None
        self.hits += 1
        if not self._window.acquire(timeout=self._timeout_s):
            raise StoreError(f"no read from the store at {self.store.path} finished within {self._timeout_s:.0f} s (request_timeout)")
        with self._count_lock:
            self._reading += 1
        future = self._reads.submit(lambda: finish(StoredReply(version), self.store.read(key, version)))
        future.add_done_callback(self._read_done)
        return future

    def _not_held(self, key: str, wanted: VersionWanted | None) -> str:
        recorded = self.store.recorded(key)
        if recorded and wanted is not None:
            return (
                f"batch {key} is in the store at {self.store.path} {describe_recorded(recorded)} only, and this rank takes "
                f"{wanted.describe()} (store_mode='replay'): record it at that version with store_mode='cache', or take the "
                "versions the store holds"
            )
        return (
            f"batch {key} is not in the store at {self.store.path} (store_mode='replay'): it was not recorded, or was "
            "recorded from other tensors (dtype, padding and packing count); record it with store_mode='cache'"
        )

    def _read_done(self, _future: Future) -> None:
        with self._count_lock:
            self._reading -= 1
        self._window.release()

    def recording(self, key: str, tokens: int, finish: Finish) -> Finish:
        """``finish`` that first hands a copy of what the worker sent to the recorder (waits for room first)."""
        if self.mode == "replay":
            return finish
        self.store.admit(self._timeout_s)

        def record_then_finish(reply: Any, received: dict[str, torch.Tensor]) -> Any:
            # A copy: the rank's supervision may view the same memory, and the training loop may change it in place.
            copied = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in received.items()}
            self.store.record(key, reply.target_version, copied, tokens)
            return finish(reply, received)

        return record_then_finish

    @property
    def reading(self) -> int:
        """Reads asked for and not finished."""
        with self._count_lock:
            return self._reading

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.store.path), "mode": self.mode, "batches": self.store.batches, "hits": self.hits, "misses": self.misses}

    def close(self, timeout_s: float) -> None:
        self._reads.shutdown(wait=True, cancel_futures=True)
        self.store.close(timeout_s)
