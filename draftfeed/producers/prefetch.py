"""In-order prefetching over a dataloader: a fixed number of requests ahead, results in submission order."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import TypeVar

B = TypeVar("B")
R = TypeVar("R")


def prefetch(batches: Iterable[B], submit: Callable[[B], Future], wait: Callable[[Future], R], depth: int) -> Iterator[tuple[B, R]]:
    """Yield ``(batch, result)`` in the order of ``batches``.

    While the caller works on one batch, the next ``depth`` are already submitted; with depth 0 a
    batch is submitted only when asked for. Each request has its own future, so the queue of futures
    is the reorder buffer: workers may finish in any order.
    """
    source = iter(batches)
    pending: deque[tuple[B, Future]] = deque()
    exhausted = False

    def top_up(target: int) -> None:
        nonlocal exhausted
        while not exhausted and len(pending) < target:
            try:
                batch = next(source)
            except StopIteration:
                exhausted = True
                return
            pending.append((batch, submit(batch)))

    try:
        while True:
            top_up(max(depth, 1))
            if not pending:
                return
            batch, future = pending.popleft()
            result = wait(future)
            top_up(depth)
            yield batch, result
            # What the caller was given is theirs alone from here: held here (the future holds it too) it would stay
            # alive through the next wait, one sample more than the caller's own.
            del batch, future, result
    finally:
        for _batch, future in pending:
            future.cancel()
