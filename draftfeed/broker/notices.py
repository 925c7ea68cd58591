"""What the broker tells peers of other peers' comings and goings, gathered per peer and said in few messages.

A rank that leaves concerns every worker that holds a link to it (``forget_ranks``); a worker that leaves, every
rank it served (``workers_gone``); a worker that joins, drains or leaves, every rank of its service
(``service_workers``). Said one by one as they happen, a thousand ranks leaving at once would be hundreds of
thousands of messages. Instead each notice waits in its peer's list, and the broker says what has gathered:

- before any other message to that peer (``take``), so that a peer always hears of a departure before anything
  that comes after it (a worker hears a rank is gone before it hears to forget that rank's mapping);
- at the end of each batch of messages the broker handles, and on each heartbeat tick (``flush``): one message per
  peer, naming up to ``MAX_NOTICES`` ranks or workers (more go in more messages);
- a worker that holds requests of the rank that left is told at once (the handler takes its notices).

A service's ready-worker count goes to its ranks once per heartbeat tick, whatever changed in between, except when
it goes to or from zero (a rank waits for a first worker): then at the next flush. Cost: O(1) per notice, one
message per peer per flush at most; nothing here grows with the cluster beyond the notices pending.
"""

from __future__ import annotations

from collections.abc import Callable

from draftfeed.broker.records import Outgoing, ServiceRecord, to_rank, to_worker
from draftfeed.schemas.messages import ForgetRanks, RankAddress, ServiceWorkers, WorkersGone
from draftfeed.schemas.protocol import MAX_NOTICES


class Notices:
    def __init__(self) -> None:
        self._forget: dict[bytes, list[RankAddress]] = {}  # worker -> the ranks it is to forget
        self._gone: dict[bytes, list[str]] = {}  # rank -> the workers it is to release
        self._services: dict[str, ServiceRecord] = {}  # services whose ready-worker count changed
        self._urgent: set[str] = set()  # of those, the ones whose count went to or from zero

    def __bool__(self) -> bool:
        return bool(self._forget or self._gone or self._services)

    def forget_rank(self, worker: bytes, address: RankAddress) -> None:
        self._forget.setdefault(worker, []).append(address)

    def worker_gone(self, rank: bytes, worker_name: str) -> None:
        self._gone.setdefault(rank, []).append(worker_name)

    def workers_changed(self, service: ServiceRecord, before: int) -> None:
        """The service's ready-worker count changed from ``before``."""
        self._services[service.name] = service
        if (before == 0) != (service.ready_workers == 0):
            self._urgent.add(service.name)

    def drop_rank(self, rank: bytes) -> None:
        """The rank is gone itself: what was to be said to it goes nowhere."""
        self._gone.pop(rank, None)

    def drop_worker(self, worker: bytes) -> None:
        self._forget.pop(worker, None)

    def take(self, side: str, peer: bytes) -> list[Outgoing]:
        """What waits for ``peer``, to go before the next message to it."""
        if side == "backend":
            ranks = self._forget.pop(peer, None) if self._forget else None
            return _chunked(ranks, lambda part: to_worker(peer, ForgetRanks(ranks=part))) if ranks else []
        workers = self._gone.pop(peer, None) if self._gone else None
        return _chunked(workers, lambda part: to_rank(peer, WorkersGone(workers=part))) if workers else []

    def flush(self, tick: bool = False) -> list[Outgoing]:
        """What waits: each peer's notices, and the changed services' counts to their ranks (on a ``tick``; the ones
        to or from zero always)."""
        if not self and not tick:
            return []
        out: list[Outgoing] = []
        for worker in list(self._forget):
            out.extend(self.take("backend", worker))
        for rank in list(self._gone):
            out.extend(self.take("frontend", rank))
        names = list(self._services) if tick else [name for name in self._urgent if name in self._services]
        for name in names:
            service = self._services.pop(name)
            self._urgent.discard(name)
            message = ServiceWorkers(service=service.name, workers=service.ready_workers)
            out.extend(to_rank(rank, message) for rank in service.ranks)
        return out

    def ordered(self, out: list[Outgoing]) -> list[Outgoing]:
        """``out`` as it goes on the wire: each peer's waiting notices before the next message to it, then what is
        left of them (the broker sends so, and ``flush`` after each batch)."""
        if not self:
            return out
        ordered: list[Outgoing] = []
        for item in out:
            ordered.extend(self.take(item.side, item.peer))
            ordered.append(item)
        return ordered + self.flush()


def _chunked(items: list, make: Callable[[list], Outgoing]) -> list[Outgoing]:
    return [make(items[start : start + MAX_NOTICES]) for start in range(0, len(items), MAX_NOTICES)]
