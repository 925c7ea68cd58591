"""Which workers hold a link to which ranks (from the pairs their heartbeats report), so that a departure is told
to exactly the peers that hold state of the one that left: a rank's to its workers (``forget_ranks``), a worker's to
its ranks (``workers_gone``), gathered in notices.py. O(the links of the one that left)."""

from __future__ import annotations

import sys

from draftfeed.broker.notices import Notices
from draftfeed.broker.records import PairRecord, RankRecord, WorkerRecord
from draftfeed.schemas.messages import RankAddress, WorkerHeartbeat


def record_pairs(worker: WorkerRecord, heartbeat: WorkerHeartbeat, ranks: dict[bytes, RankRecord]) -> None:
    """The pairs whose status changed, each a link (a pair of a rank the broker does not know is not kept: the
    worker hears the rank is forgotten, and drops the pair)."""
    for pair in heartbeat.pairs:
        rank = ranks.get(pair.rank.encode())
        if rank is None:
            continue
        worker.pairs[sys.intern(pair.rank)] = PairRecord.of(pair)
        if rank.peer not in worker.ranks_served:  # it holds a link to the rank: it hears when the rank goes
            worker.ranks_served.add(rank.peer)
            rank.workers_served.add(worker.peer)


def release_rank(rank: RankRecord, workers: dict[bytes, WorkerRecord], notices: Notices) -> None:
    """Every worker linked to a departed rank drops its pair and is to forget the rank."""
    address = RankAddress(rank=rank.hello.rank, data_endpoint=rank.hello.data_endpoint)
    for worker_peer in rank.workers_served:
        worker = workers.get(worker_peer)
        if worker is not None:
            worker.ranks_served.discard(rank.peer)
            worker.pairs.pop(rank.hello.rank, None)
            notices.forget_rank(worker_peer, address)
    rank.workers_served.clear()


def release_worker(worker: WorkerRecord, ranks: dict[bytes, RankRecord], notices: Notices) -> None:
    """Every rank a departed worker served releases its pair with it (docs/data-planes.md)."""
    for rank_peer in worker.ranks_served:
        rank = ranks.get(rank_peer)
        if rank is not None:
            rank.workers_served.discard(worker.peer)
            notices.worker_gone(rank_peer, worker.name)
    worker.ranks_served.clear()
    worker.pairs.clear()
