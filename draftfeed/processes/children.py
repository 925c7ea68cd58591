"""Children that die with their parent: every process draftfeed's launcher starts (``processes.start``, ``spawn``, the
preloader and what it forks).

Each dies with the process that started it, however that one ends, SIGKILL included: Linux's ``PR_SET_PDEATHSIG``
(``die_with_parent``), set in the child before it runs anything. ``spawn`` starts the child as this module, which sets
it and then becomes the command (``_become``: ``exec``; the signal outlives exec), never through Popen's ``preexec_fn``:
that makes Popen fork a copy of this process and run Python in it before exec, which Python documents as unsafe with
threads, and which was seen to kill the child with SIGSEGV before it ran (a broker started by a test process that had
run gloo ranks and imported NeMo AutoModel). That signal comes when the *thread* that started
the child ends (prctl(2)), not the process, so every child is started from one thread that lives as long as the
process (``_Spawner``): children may be started from short-lived threads (the demo starts its workers side by
side). ``stop_all`` stops every child still running, also one another thread is starting at that moment, and
refuses later starts: for a program on its way out (``draftfeed demo`` and ``draftfeed bench``, whatever moment
a signal comes at).
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
PR_SET_PDEATHSIG = 1
_LIBC_PRCTL: Any = None


def _prctl() -> Any:
    """libc's prctl, looked up in the parent (a child between fork and exec must not load libraries), or None off Linux."""
    global _LIBC_PRCTL
    if _LIBC_PRCTL is None and sys.platform == "linux":
        _LIBC_PRCTL = ctypes.CDLL(None, use_errno=True).prctl
    return _LIBC_PRCTL


def die_with_parent(parent_pid: int) -> None:
    """Make the calling process (a child of ``parent_pid``, before it runs anything) receive SIGKILL when the thread of
    ``parent_pid`` that started it ends; killed at once if its parent has already ended. Nothing off Linux."""
    prctl = _prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent ended before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)


class _Spawner:
    """One daemon thread that starts every child (see the module's docstring): it ends only with the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()

    def run(self, call: Callable[[], T]) -> T:
        if threading.current_thread() is self._thread:
            return call()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also in a forked child, which has no such thread
                self._thread = threading.Thread(target=self._serve, name="draftfeed-spawner", daemon=True)
                self._thread.start()
        future: Future = Future()
        self._requests.put((call, future))
        return future.result()

    def _serve(self) -> None:
        while True:
            call, future = self._requests.get()
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)


_SPAWNER = _Spawner()
_CHILDREN_LOCK = threading.RLock()  # re-entrant: kill_all runs in a signal handler, maybe inside stop_all
_CHILDREN: dict[Any, None] = {}  # the popens started here that may still run, in the order they started
_STOPPING = False


def adopt(popen: Any) -> None:
    """Keep ``popen`` for stop_all; once stop_all has begun, kill it instead and raise."""
    with _CHILDREN_LOCK:
        if not _STOPPING:
            for ended in [child for child in _CHILDREN if child.returncode is not None]:
                del _CHILDREN[ended]
            _CHILDREN[popen] = None
            return
    popen.kill()
    popen.wait(10)
    raise RuntimeError(f"not started: this process is stopping the ones it started ({' '.join(map(str, popen.args))})")


def spawn(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **kwargs)`` for a child that dies with this process (see the module's docstring): on
    Linux started as ``python -m draftfeed.processes.children PARENT ARGS...`` (``_become``), which then runs ``args``."""
    parent = os.getpid()
    command = list(args)
    if _prctl() is not None:
        command = [sys.executable, "-m", __name__, str(parent), *command]

    def start_child() -> subprocess.Popen:
        child = subprocess.Popen(command, **kwargs)
        adopt(child)
        return child

    return _SPAWNER.run(start_child)


def stopping() -> bool:
    """Whether stop_all has begun."""
    return _STOPPING


def stop_all(timeout_s: float = 10.0) -> None:
    """Stop every process started here that still runs: SIGTERM, last started first, then SIGKILL to any still running
    after ``timeout_s``. Starts after this one are refused (killed, with a RuntimeError): for a program on its way out."""
    global _STOPPING
    with _CHILDREN_LOCK:
        _STOPPING = True
        children = [child for child in reversed(_CHILDREN) if child.returncode is None]
    for child in children:
        child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(10)


def kill_all() -> None:
    """SIGKILL every process started here that still runs, now (safe in a signal handler: no waiting, no lock held by
    another thread for long)."""
    with _CHILDREN_LOCK:
        pids = [child.pid for child in _CHILDREN if child.returncode is None]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (its children, theirs, ...), as /proc shows them now; [] where there is no /proc."""
    below: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        below.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in below.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants() -> None:
    """SIGKILL every process below this one now, also those a library started (vLLM's engine and workers)."""
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _become(argv: Sequence[str]) -> None:
    """A spawned child's first program (``python -m draftfeed.processes.children PARENT COMMAND...``): it dies with
    PARENT's thread that started it (``die_with_parent``), then becomes COMMAND."""
    die_with_parent(int(argv[0]))
    os.execvp(argv[1], list(argv[1:]))


if __name__ == "__main__":
    _become(sys.argv[1:])
