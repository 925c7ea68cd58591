"""The recorder: a background thread that writes recorded batches into shards, so that recording does not
slow training.

Bound: at most ``queue_batches`` batches wait for the thread (``admit`` blocks the training loop beyond that,
never the IO thread), and at most one shard of about ``shard_bytes`` is gathered in memory; the batches of both
stay readable (``pending``) until their shard's index line is written. A write that fails (a full disk) stops
the recorder: the error, naming the path, is raised by the next ``admit`` and by ``close``.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from draftfeed.dataplane.frames.codec import dtype_name, tensor_bytes
from draftfeed.store.errors import StoreWriteError
from draftfeed.store.index import BatchRecord, FieldSpec, IndexFile, ShardRecord
from draftfeed.store.shards import SHARD_SUFFIX, tensor_name, write_shard

log = logging.getLogger("draftfeed.store")
EXIT_WRITE_S = 300.0  # the longest a process's exit waits for its recorder's last shard


class Recorder:
    def __init__(
        self,
        store: Path,
        writer: str,
        index: IndexFile,
        on_shard: Callable[[ShardRecord], None],
        shard_bytes: int,
        queue_batches: int,
    ) -> None:
        self.store = store
        self.writer = writer
        self.folder = store / "shards" / writer
        self._index = index
        self._on_shard = on_shard
        self._shard_bytes = shard_bytes
        self._queue_batches = queue_batches
        self._cond = threading.Condition()
        self._queue: deque[tuple[str, int | None, dict[str, torch.Tensor], int]] = deque()
        # Recorded, their shard not yet in the index: by key, then by target version.
        self._pending: dict[str, dict[int | None, dict[str, torch.Tensor]]] = {}
        self._error: StoreWriteError | None = None
        self._closing = False
        self._flushes_asked = 0  # flush() calls so far; the thread has written everything queued before the last done
        self._flushes_done = 0
        self._shards_written = 0
        self._thread = threading.Thread(target=self._run, name=f"draftfeed-store-{writer}", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)  # a rank that never closes its target still writes its last shard

    def admit(self, timeout_s: float) -> None:
        """Wait (on the training loop's thread) until the queue has room for one more batch."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._error is not None or len(self._queue) < self._queue_batches, timeout_s):
                raise StoreWriteError(f"the store at {self.store} has not written a batch within {timeout_s:.0f} s: is its disk this slow, or stuck?")
            if self._error is not None:
                raise self._error

    def put(self, key: str, version: int | None, tensors: dict[str, torch.Tensor], tokens: int) -> None:
        """Queue one batch computed at target version ``version`` (CPU tensors this recorder owns); never blocks."""
        with self._cond:
            if self._error is not None or self._closing or version in self._pending.get(key, {}):
                return
            self._pending.setdefault(key, {})[version] = tensors
            self._queue.append((key, version, tensors, tokens))
            self._cond.notify_all()

    def pending(self, key: str) -> dict[int | None, dict[str, torch.Tensor]]:
        """The batch ``key``'s recorded tensors not yet in the index, by target version."""
        with self._cond:
            return dict(self._pending.get(key, {}))

    def flush(self, timeout_s: float) -> None:
        """Write every batch queued so far into a shard and its index line, then return (a partial shard: a resumed
        run reads these batches back even if this process is killed right after). Raises the recorder's error."""
        with self._cond:
            self._flushes_asked += 1
            asked = self._flushes_asked
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._error is not None or self._flushes_done >= asked, timeout_s):
                raise StoreWriteError(
                    f"the store at {self.store} did not write its batches within {timeout_s:.0f} s: is its disk this slow, or stuck?"
                )
            if self._error is not None:
                raise self._error

    def close(self, timeout_s: float) -> None:
        """Write what is queued and the last, partial shard; raise the recorder's error, if it had one."""
        atexit.unregister(self._close_at_exit)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise StoreWriteError(f"the store at {self.store} did not finish writing within {timeout_s:.0f} s")
        if self._error is not None:
            raise self._error

    def _close_at_exit(self) -> None:
        try:
            self.close(EXIT_WRITE_S)
        except StoreWriteError as exc:
            log.error("draftfeed: at exit: %s", exc)

    def _run(self) -> None:
        tensors: dict[str, torch.Tensor] = {}
        batches: list[BatchRecord] = []
        gathered = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or self._flushes_asked > self._flushes_done)
                item = self._queue.popleft() if self._queue else None
                flush = item is None and not self._closing  # the queue is empty: what flush() asked for is gathered
                flushed = self._flushes_asked
                self._cond.notify_all()  # room for admit()
            if item is not None:
                key, version, fields, tokens = item
                nbytes = tensor_bytes(fields)
                specs = {name: FieldSpec(dtype=dtype_name(t.dtype), shape=list(t.shape)) for name, t in fields.items()}
                batch = BatchRecord(key=key, fields=specs, tokens=tokens, nbytes=nbytes, target_version=version)
                tensors.update({tensor_name(batch.entry, name): t for name, t in fields.items()})
                batches.append(batch)
                gathered += nbytes
            if batches and (gathered >= self._shard_bytes or item is None):
                if not self._write(tensors, batches):
                    return
                tensors, batches, gathered = {}, [], 0
            if item is None:  # everything queued is written: flush() calls made so far are answered
                with self._cond:
                    self._flushes_done = flushed
                    self._cond.notify_all()
                if not flush:
                    return

    def _write(self, tensors: dict[str, torch.Tensor], batches: list[BatchRecord]) -> bool:
        name = f"{self._shards_written:06d}{SHARD_SUFFIX}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            size, sha256 = write_shard(self.folder / name, tensors)
            record = ShardRecord(shard=f"shards/{self.writer}/{name}", size=size, sha256=sha256, writer=self.writer, batches=batches)
            self._index.append(record)
        except (OSError, StoreWriteError) as exc:
            error = exc if isinstance(exc, StoreWriteError) else StoreWriteError(f"writing into the store at {self.store} failed: {exc}")
            log.error("draftfeed: %s; recording stopped", error)
            with self._cond:
                self._error = error
                self._pending.clear()
                self._queue.clear()
                self._cond.notify_all()
            return False
        self._shards_written += 1
        self._on_shard(record)
        with self._cond:
            for batch in batches:
                versions = self._pending.get(batch.key, {})
                versions.pop(batch.target_version, None)
                if not versions:
                    self._pending.pop(batch.key, None)
        return True
