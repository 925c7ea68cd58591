"""Logging helpers shared by every process."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """At most one line per ``interval`` seconds per key; the lines skipped meanwhile are counted.

    Bad input comes in floods; one line per kind of problem every few seconds keeps logs readable
    and logging cheap.
    """

    def __init__(self, logger: logging.Logger, interval: float = 5.0, max_keys: int = 1024) -> None:
        self.logger, self.interval, self.max_keys = logger, interval, max_keys
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, message: str, *args: object) -> None:
        now = time.monotonic()
        if len(self._last) > self.max_keys:
            self._last.clear()
        last, skipped = self._last.get(key, (-1e9, 0))
        if now - last >= self.interval:
            suffix = f" ({skipped} similar messages suppressed)" if skipped else ""
            self.logger.warning(message + suffix, *args)
            self._last[key] = (now, 0)
        else:
            self._last[key] = (last, skipped + 1)
