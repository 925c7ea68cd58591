"""The follower processes of a tensor-parallel worker: started with the worker, watched, stopped with it.

Each follower is ``python -m draftfeed.consumers.engines.parallel.follower SPEC`` and dies with the process that
started it (``PR_SET_PDEATHSIG``, set by the follower itself), so a SIGKILLed worker leaves none behind. A follower
that exits while the worker runs is reported once, with its rank, pid and how it ended, to ``on_exit``; on a node
other than node 0 (``expected_exit``), a follower that exits 0 ended because the worker stopped, and is not.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from draftfeed.consumers.engines.parallel.spec import FollowerSpec

log = logging.getLogger("draftfeed.worker")

STOP_TIMEOUT_S = 10.0  # how long a follower gets to leave its process group after the stop command


def how_it_ended(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class FollowerProcesses:
    """Ranks 1..N-1 of one worker, each a child process of the worker."""

    def __init__(self, specs: list[FollowerSpec], on_exit: Callable[[str], None], expected_exit: bool = False) -> None:
        self._stopping = threading.Event()
        self._on_exit = on_exit
        self._expected_exit = expected_exit
        self.exited: str | None = None  # how the first follower to end ended, while the worker ran
        self._popens: list[tuple[int, subprocess.Popen]] = []
        try:
            for spec in specs:
                self._popens.append(
                    (spec.rank, subprocess.Popen([sys.executable, "-m", "draftfeed.consumers.engines.parallel.follower", spec.model_dump_json()]))
                )
        except BaseException:  # one could not be started: none is left running
            self.kill()
            raise
        for rank, popen in self._popens:
            threading.Thread(target=self._watch, args=(rank, popen), name=f"draftfeed-tp-watch-{rank}", daemon=True).start()
        log.info("worker: started %d tensor-parallel processes: %s", len(self._popens), ", ".join(f"rank {r} pid {p.pid}" for r, p in self._popens))

    @property
    def pids(self) -> list[int]:
        return [popen.pid for _rank, popen in self._popens]

    def all_ended(self) -> bool:
        return all(popen.poll() is not None for _rank, popen in self._popens)

    def _watch(self, rank: int, popen: subprocess.Popen) -> None:
        returncode = popen.wait()
        if self._stopping.is_set() or self.exited is not None or (self._expected_exit and returncode == 0):
            return
        self.exited = f"its tensor-parallel process rank {rank} (pid {popen.pid}) {how_it_ended(returncode)}"
        self._on_exit(self.exited)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for every follower to exit (after the stop command), then kill what is left."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for _rank, popen in self._popens:
            try:
                popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()

    def kill(self) -> None:
        self._stopping.set()
        for _rank, popen in self._popens:
            if popen.poll() is None:
                popen.kill()
        for _rank, popen in self._popens:
            popen.wait()
