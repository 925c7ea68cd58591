"""Progress of long work for people watching: a bar with rate and ETA redrawn in place on a terminal, a plain
line now and then elsewhere (a log file, CI), so that neither fills up with redraws."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

BAR_WIDTH = 24


class Progress:
    """``total`` steps of ``label``. ``advance`` after each; ``write`` prints a line without breaking the bar; ``close``
    ends it. Not a TTY: a line when ``every_s`` has passed since the last one, and at the end."""

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        terminal: bool | None = None,
    ) -> None:
        self.total, self.label, self.every_s, self.clock = max(1, total), label, every_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.done = 0
        self.started = self.last_line = clock()
        self.note = ""

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.done = min(self.total, self.done + steps)
        self.note = note
        if self.terminal:
            self._draw()
        elif self.clock() - self.last_line >= self.every_s or self.done == self.total:
            self.stream.write(self.line() + "\n")
            self.stream.flush()
            self.last_line = self.clock()

    def write(self, text: str, stream: TextIO | None = None) -> None:
        """A line of output (on ``stream``, default stdout), the bar redrawn below it on a terminal."""
        out = stream if stream is not None else sys.stdout
        if self.terminal:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        out.write(text + "\n")
        out.flush()
        if self.terminal:
            self._draw()

    def close(self) -> None:
        if self.terminal:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        """``label: done/total (percent), rate/s, ETA``: what both forms show."""
        elapsed = self.clock() - self.started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = "done" if self.done == self.total else (f"ETA {_duration(left)}" if left != float("inf") else "ETA ?")
        note = f"  {self.note}" if self.note else ""
        return f"{self.label}: {self.done}/{self.total} ({100 * self.done // self.total}%), {rate:.2f}/s, {eta}{note}"

    def _draw(self) -> None:
        filled = BAR_WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        self.stream.write(f"\r\x1b[K[{bar}] {self.line()}")
        self.stream.flush()


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60} s" if seconds >= 60 else f"{seconds} s"
