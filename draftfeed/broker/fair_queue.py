"""A service's queue, fair across ranks: one FIFO per rank, served round-robin.

Policy: each dispatch takes the oldest request of the next rank in the rotation that has one queued, and
that rank moves to the back of the rotation. A rank with a request queued therefore waits for at most one
request of each other rank with queued work before its own goes out, however many the others queued: one
rank cannot take the whole queue of a service. A requeued request (its worker died or handed it back) goes
to the front of its own rank's FIFO and keeps that rank's place in the rotation.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, Protocol, TypeVar


class _HasRank(Protocol):
    @property
    def rank_key(self) -> Hashable: ...


T = TypeVar("T", bound=_HasRank)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._by_rank: OrderedDict[Hashable, deque[T]] = OrderedDict()  # rotation order: next to serve first
        self._size = 0

    def append(self, item: T) -> None:
        """A new request: at the back of its rank's FIFO; a rank new to the rotation joins at its back."""
        self._by_rank.setdefault(item.rank_key, deque()).append(item)
        self._size += 1

    def push_front(self, items: Iterable[T]) -> None:
        """Requests going back (in their original order) to the front of their ranks' FIFOs."""
        for item in reversed(list(items)):
            queue = self._by_rank.get(item.rank_key)
            if queue is None:
                queue = self._by_rank[item.rank_key] = deque()
                self._by_rank.move_to_end(item.rank_key, last=False)  # it was served before: it goes next
            queue.appendleft(item)
            self._size += 1

    def pop(self) -> T:
        """The next request by the policy; IndexError when empty."""
        if not self._by_rank:
            raise IndexError("pop from an empty FairQueue")
        key, queue = next(iter(self._by_rank.items()))
        item = queue.popleft()
        self._size -= 1
        if queue:
            self._by_rank.move_to_end(key)
        else:
            del self._by_rank[key]
        return item

    def drop_rank(self, key: Hashable) -> list[T]:
        """Take every request of one rank out (it is gone)."""
        queue = self._by_rank.pop(key, deque())
        self._size -= len(queue)
        return list(queue)

    def count(self, key: Hashable) -> int:
        return len(self._by_rank.get(key, ()))

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        for queue in self._by_rank.values():
            yield from queue
