"""A clock the test turns by hand."""

from __future__ import annotations


class Clock:
    """Pass as a ``clock`` callable; it returns ``now``, which only the test moves (``clock.now += 3.5``)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
