"""A rank's supervision store in use: which batches its store answers, and the recording of the others.

``record``: every batch goes to the workers and is also written. ``replay``: every batch comes from the store,
and one it does not hold is an error naming its key. ``cache``: the store answers the batches it holds, the
workers the others, which are written back. Reads run on one thread in the order they were asked for, at most
``window`` at a time, so a replayed epoch keeps the prefetch depth and memory bound of a computed one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from draftfeed.store.errors import BatchNotInStore, StoreError
from draftfeed.store.store import StoreMode, SupervisionStore

Finish = Callable[[Any, dict[str, torch.Tensor]], Any]


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

    def answer(self, key: str, finish: Finish) -> Future | None:
        """A future of the batch's supervision read from the store; None when the workers must compute it."""
        if self.mode == "record" or (self.mode == "cache" and key not in self.store):
            self.misses += 1
            return None
        if self.mode == "replay" and key not in self.store:
            raise BatchNotInStore(
                f"batch {key} is not in the store at {self.store.path} (store_mode='replay'): it was not recorded, or was "
                "recorded from other tensors (dtype, padding and packing count); record it with store_mode='cache'"
            )
        self.hits += 1
        if not self._window.acquire(timeout=self._timeout_s):
            raise StoreError(f"no read from the store at {self.store.path} finished within {self._timeout_s:.0f} s (request_timeout)")
        with self._count_lock:
            self._reading += 1
        future = self._reads.submit(lambda: finish(None, self.store.read(key)))
        future.add_done_callback(self._read_done)
        return future

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
            self.store.record(key, {name: t.detach().to("cpu", copy=True).contiguous() for name, t in received.items()}, tokens)
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
