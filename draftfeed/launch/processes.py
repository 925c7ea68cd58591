"""Start broker and worker processes and wait until they say they are ready (used by the demo and the tests)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from draftfeed.launch.cli import READY_PREFIX


@dataclass
class Process:
    """A draftfeed process with its ready message and the tail of its log."""

    popen: subprocess.Popen
    ready: dict = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)

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


def _pump(stream: IO[str], lines: "queue.Queue[str | None]", tail: list[str], keep: int = 200) -> None:
    for line in stream:
        tail.append(line.rstrip("\n"))
        del tail[:-keep]
        lines.put(line)
    lines.put(None)


def start(args: Sequence[str], *, ready_timeout_s: float = 120.0, env: dict[str, str] | None = None, module: str = "draftfeed.launch") -> Process:
    """Run ``python -m MODULE ARGS`` (``draftfeed.launch`` by default) and wait for its ready line; raises with its log if it fails."""
    popen = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    process = Process(popen)
    lines: queue.Queue[str | None] = queue.Queue()
    assert popen.stdout is not None
    threading.Thread(target=_pump, args=(popen.stdout, lines, process.log_tail), daemon=True).start()
    try:
        while True:
            line = lines.get(timeout=ready_timeout_s)
            if line is None:
                raise RuntimeError(f"draftfeed {' '.join(args[:1])} exited with {popen.wait(10)} before it was ready:\n" + "\n".join(process.log_tail))
            if line.startswith(READY_PREFIX):
                process.ready = json.loads(line[len(READY_PREFIX):])
                return process
    except queue.Empty:
        process.kill()
        raise TimeoutError(f"draftfeed {' '.join(args[:1])} was not ready within {ready_timeout_s:.0f} s:\n" + "\n".join(process.log_tail)) from None
    except BaseException:
        process.kill()
        raise


def start_broker(host: str = "127.0.0.1", extra: Sequence[str] = (), **kwargs: object) -> Process:
    """A broker on free ports of ``host``; its endpoints are in ``ready['frontend']`` and ``ready['backend']``."""
    return start(["broker", "--frontend", f"tcp://{host}:*", "--backend", f"tcp://{host}:*", *extra], **kwargs)  # type: ignore[arg-type]


def start_worker(backend: str, target: str, *extra: str, **kwargs: object) -> Process:
    return start(["worker", "--broker", backend, "--target", target, *extra], **kwargs)  # type: ignore[arg-type]
