"""The vocab mappings the broker holds, who needs each, and what it believes each worker holds.

Policy: a mapping is kept while a rank uses it (it set it last) or a live request names it, and forgotten
the moment neither holds: every worker believed to hold it is told ``forget_mapping`` at that moment, and
the belief is dropped with it, so what the broker believes a worker holds never outlives what the worker
holds. A worker that turns out to lack one (``done.missing_mapping``) loses the belief and is sent the
mapping again before the request is. Bound: one record per distinct mapping in use. Cost: each record knows the
workers believed to hold it, so forgetting one costs O(those workers), not O(all workers).
"""

from __future__ import annotations

from typing import Any

from draftfeed.broker.records import MappingRecord, Outgoing, Pending, RankRecord, WorkerRecord, to_worker
from draftfeed.schemas.messages import ForgetMapping, SetVocabMapping, VocabMapping


class MappingTable:
    def __init__(self, workers: dict[bytes, WorkerRecord]) -> None:
        self.records: dict[str, MappingRecord] = {}
        self.workers = workers  # every worker the broker knows (the state's)

    def __contains__(self, digest: str) -> bool:
        return digest in self.records

    def __len__(self) -> int:
        return len(self.records)

    def set_for(self, rank: RankRecord, message: SetVocabMapping, frames: list[Any]) -> list[Outgoing]:
        """The rank uses this mapping from now on (the one it used before may go)."""
        if rank.mapping_digest == message.digest:
            return []
        out = self.release_rank(rank)
        record = self.records.get(message.digest)
        if record is None:
            record = self.records[message.digest] = MappingRecord(message, frames)
        record.users.add(rank.peer)
        rank.mapping_digest = message.digest
        return out

    def release_rank(self, rank: RankRecord) -> list[Outgoing]:
        """The rank no longer uses the mapping it set (requests naming it keep it)."""
        digest, rank.mapping_digest = rank.mapping_digest, None
        record = self.records.get(digest) if digest else None
        if record is None:
            return []
        record.users.discard(rank.peer)
        return self._drop_if_unneeded(record.header.digest)

    def hold(self, pending: Pending) -> None:
        """A new live request names its mapping (which the broker holds: the submit was refused otherwise)."""
        if pending.mapping is not None:
            self.records[pending.mapping].requests += 1

    def release(self, pending: Pending) -> list[Outgoing]:
        """A request leaves the broker's care; idempotent (``pending.finished``)."""
        if pending.finished:
            return []
        pending.finished = True
        record = self.records.get(pending.mapping) if pending.mapping is not None else None
        if record is None:
            return []
        record.requests -= 1
        return self._drop_if_unneeded(record.header.digest)

    def send_before(self, worker: WorkerRecord, pending: Pending) -> list[Outgoing]:
        """The ``vocab_mapping`` the worker needs before this request, if it does not hold it yet."""
        digest = pending.mapping
        if digest is None or digest in worker.mappings_sent:
            return []
        record = self.records[digest]  # held: a live request keeps its mapping
        worker.mappings_sent.add(digest)
        record.sent_to.add(worker.peer)
        return [to_worker(worker.peer, VocabMapping(digest=digest, tensors=record.header.tensors), record.frames)]

    def worker_lacks(self, worker: WorkerRecord, digest: str) -> None:
        worker.mappings_sent.discard(digest)
        record = self.records.get(digest)
        if record is not None:
            record.sent_to.discard(worker.peer)

    def worker_left(self, worker: WorkerRecord) -> None:
        """The worker is gone: it holds nothing any more."""
        for digest in worker.mappings_sent:
            record = self.records.get(digest)
            if record is not None:
                record.sent_to.discard(worker.peer)
        worker.mappings_sent.clear()

    def _drop_if_unneeded(self, digest: str) -> list[Outgoing]:
        record = self.records.get(digest)
        if record is None or record.needed:
            return []
        del self.records[digest]
        out = []
        for peer in record.sent_to:
            worker = self.workers.get(peer)
            if worker is not None and digest in worker.mappings_sent:
                worker.mappings_sent.discard(digest)
                out.append(to_worker(peer, ForgetMapping(digest=digest)))
        return out
