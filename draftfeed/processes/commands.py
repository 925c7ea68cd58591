"""Start broker and worker processes and wait until they say they are ready (used by the demo, the bench and the tests).

Every process started here dies with the process that started it, however that one ends (children.py).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from draftfeed.processes import children
from draftfeed.processes.ready import READY_PREFIX


@dataclass
class Process:
    """A draftfeed process with its ready message and the tail of its log."""

    popen: subprocess.Popen
    ready: dict = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)
    lines_seen: int = 0  # every line it printed, counted (the tail keeps the last ones)
    output_ended: bool = False
    printed: threading.Condition = field(default_factory=threading.Condition, repr=False)  # notified at each line

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout_s)
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL: no chance to clean up, as when a machine or a job dies."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)


def _pump(stream: IO[str], lines: queue.Queue[str | None], process: Process, keep: int = 400) -> None:
    for line in stream:
        with process.printed:
            process.log_tail.append(line.rstrip("\n"))
            del process.log_tail[:-keep]
            process.lines_seen += 1
            process.printed.notify_all()
        lines.put(line)
    with process.printed:
        process.output_ended = True
        process.printed.notify_all()
    lines.put(None)


def start(
    args: Sequence[str],
    *,
    ready_timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
    module: str = "draftfeed.launch",
    prefix: Sequence[str] = (),
    ready_pattern: str | None = None,
) -> Process:
    """Run ``python -m MODULE ARGS`` (``draftfeed.launch`` by default) and wait for its ready line; raises with its log if it fails.

    ``prefix`` runs it through another command, e.g. ``["ip", "netns", "exec", "host1"]`` or ``["numactl", "-N", "0"]``;
    that command must exec the process (its pid is the one signalled). ``ready_pattern``: a line matching this regular
    expression counts as ready too (for a process that will not get as far as its ready line)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen: Any = _LAUNCHER(module, args, full_env, prefix) if _LAUNCHER is not None else None
    if popen is not None:
        children.adopt(popen)
    else:
        popen = children.spawn(
            [*prefix, sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
            start_new_session=True,
        )
    process = Process(popen)
    lines: queue.Queue[str | None] = queue.Queue()
    assert popen.stdout is not None
    threading.Thread(target=_pump, args=(popen.stdout, lines, process), daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=ready_timeout_s)
            if line is None:
                raise RuntimeError(
                    f"draftfeed {' '.join(args[:1])} exited with {popen.wait(10)} before it was ready:\n" + "\n".join(process.log_tail)
                )
            if line.startswith(READY_PREFIX):
                process.ready = json.loads(line[len(READY_PREFIX) :])
                return process
            if ready_pattern is not None and re.search(ready_pattern, line):
                return process
    except queue.Empty:
        process.kill()
        raise TimeoutError(f"draftfeed {' '.join(args[:1])} was not ready within {ready_timeout_s:.0f} s:\n" + "\n".join(process.log_tail)) from None
    except BaseException:
        process.kill()
        raise


# Starts a ``python -m MODULE ARGS`` process some other way (the test suite forks them from a preloaded process):
# (module, args, env, prefix) -> a Popen-like handle, or None to spawn it as usual.
Launcher = Callable[[str, Sequence[str], dict[str, str], Sequence[str]], Any]
_LAUNCHER: Launcher | None = None


def use_launcher(launcher: Launcher | None) -> None:
    """From now on, offer every start to ``launcher`` first (None: spawn every one)."""
    global _LAUNCHER
    _LAUNCHER = launcher


def start_broker(host: str = "127.0.0.1", extra: Sequence[str] = (), **kwargs: object) -> Process:
    """A broker on free ports of ``host``; its endpoints are in ``ready['frontend']`` and ``ready['backend']``. Its
    health and metrics endpoint is off unless ``extra`` names ``--http-port``: local runs start several processes."""
    return start(["broker", "--frontend", f"tcp://{host}:*", "--backend", f"tcp://{host}:*", *_http_off(extra)], **kwargs)  # type: ignore[arg-type]


def start_worker(backend: str, target: str, *extra: str, **kwargs: object) -> Process:
    """A worker of ``target``; its health and metrics endpoint is off unless ``extra`` names ``--http-port``."""
    return start(["worker", "--broker", backend, "--target", target, *_http_off(extra)], **kwargs)  # type: ignore[arg-type]


def _http_off(extra: Sequence[str]) -> list[str]:
    return list(extra) if "--http-port" in extra else [*extra, "--http-port", "0"]
