"""What a started process prints, and waiting for it (draftfeed.processes.commands.Process keeps the tail of its
output)."""

from __future__ import annotations

import re
import sys
import time

from draftfeed.processes.commands import Process


def wait_for_line(process: Process, pattern: str, timeout_s: float, after: int = 0) -> str:
    """The first line matching ``pattern`` (a regular expression) among those ``process`` printed after the first
    ``after`` lines (its ``lines_seen`` at some earlier moment); raises TimeoutError with the log's tail if none comes
    within ``timeout_s`` or the process ends without printing one."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    with process.printed:
        while True:
            new = min(process.lines_seen - after, len(process.log_tail))
            for line in process.log_tail[len(process.log_tail) - new :] if new > 0 else ():
                if regex.search(line):
                    return line
            after = process.lines_seen
            remaining = deadline - time.monotonic()
            if remaining <= 0 or process.output_ended:
                ended = "the process ended" if process.output_ended else f"{timeout_s:.0f} s passed"
                raise TimeoutError(f"no line matching {pattern!r} before {ended}:\n" + "\n".join(process.log_tail[-40:]))
            process.printed.wait(remaining)


def say(line: str) -> None:
    """Print ``line`` in one write and flush: a log line another thread writes to the same pipe cannot land inside it
    (``print`` writes the line and its newline apart, and "batch 3" once ran into a log line)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
