"""Rank bookkeeping: the ranks the broker knows, the ones it forgot and why, and what it tells a service's ranks.

A rank is known from its hello until it says goodbye, falls silent for the liveness period, or a worker cannot
reach it. A forgotten rank is remembered by name (forgotten.py): its next message is answered ``forgotten``
with the reason, and its old record is marked ``gone`` and never used again. What a rank's going means for its
requests, mappings and workers is the handlers' (state.py); this module holds the records only.

The records are kept in the order the ranks were last heard, so finding the silent ones costs O(the silent ones).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable

from draftfeed.broker.forgotten import ForgottenPeers
from draftfeed.broker.records import Outgoing, RankRecord, ServiceRecord, silent_peers, to_rank
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import ErrorReply, Hello, WorkerKeys

log = logging.getLogger("draftfeed.broker")


def worker_keys(service: ServiceRecord) -> list[str]:
    """The authenticated keys of the service's workers (on a secure broker), which its ranks' data sockets admit."""
    return sorted({w.key for w in service.workers.values() if w.key is not None})


class RankBook:
    def __init__(self, broker: str, instance: str, clock: Callable[[], float]) -> None:
        self.broker = broker
        self.instance = instance
        self.clock = clock
        self.records: OrderedDict[bytes, RankRecord] = OrderedDict()  # least recently heard first
        self._order = itertools.count()  # hellos of new records, in order (the status pages' cursor)
        self.forgotten = ForgottenPeers()

    def known(self, peer: bytes, request_id: int | None) -> tuple[RankRecord | None, list[Outgoing]]:
        """The rank's record (it was heard now), or None and the error that tells it to say hello again."""
        rank = self.records.get(peer)
        if rank is not None:
            rank.last_seen = self.clock()
            self.records.move_to_end(peer)
            return rank, []
        why = self.forgotten.why(peer)
        if why is not None:
            message = f"broker {self.broker} (instance {self.instance}) forgot this rank: {why}; say hello again and resend"
            return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="forgotten"))]
        message = "this broker does not know this rank (it restarted, or the rank was silent too long): say hello again"
        return None, [to_rank(peer, ErrorReply(request_id=request_id, message=message, code="unknown_peer"))]

    def greet(self, peer: bytes, hello: Hello, key: str | None) -> tuple[RankRecord, bool]:
        """The rank's record after its (admitted) hello, and whether it was known already (``resumed``)."""
        rank = self.records.get(peer)
        resumed = rank is not None
        if rank is None:
            self.records[peer] = rank = RankRecord(peer, hello, self.clock(), order=next(self._order))
            why = self.forgotten.take(peer)
            again = f" again (it had been forgotten: {why})" if why else ""
            log.info("broker: rank %s (host %s, pid %d) connected%s for service %r", hello.rank, hello.host, hello.pid, again, hello.service)
        else:  # the same rank again (its link flickered): keep its requests, take its new settings
            rank.hello, rank.last_seen, rank.dispatch_fields = hello, self.clock(), None
            self.records.move_to_end(peer)
        rank.key = key
        return rank, resumed

    def remove(self, peer: bytes, why: str) -> RankRecord | None:
        """Forget the rank (remembering why); its record, marked ``gone``, or None if it was not known."""
        rank = self.records.pop(peer, None)
        if rank is None:
            return None
        rank.gone = True
        at_workers = sum(1 for p in rank.requests.values() if p.ticket >= 0)
        log.info(
            "broker: forgot rank %s of service %r: %s; dropped %d of its requests (%d at workers)",
            rank.hello.rank,
            rank.hello.service,
            why,
            len(rank.requests),
            at_workers,
        )
        self.forgotten.remember(peer, why)
        return rank

    def silent(self, now: float, liveness_s: float) -> list[bytes]:
        """The ranks not heard for longer than the liveness period."""
        return silent_peers(self.records, now, liveness_s)

    def announce_worker_keys(self, service: ServiceRecord) -> list[Outgoing]:
        """Tell the service's ranks (on a secure broker) which workers their data sockets admit."""
        frames = pack(WorkerKeys(keys=worker_keys(service)))
        return [Outgoing("frontend", peer, frames) for peer in service.ranks if (rank := self.records.get(peer)) is not None and rank.key is not None]
