"""Logging helpers shared by every process."""

from __future__ import annotations

import json
import logging
import sys
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


LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log collectors: time (UTC, ISO 8601), level, logger, message, pid, thread, and
    the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
            "thread": record.threadName,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level``, as text lines or (``json``) one JSON object per line."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
