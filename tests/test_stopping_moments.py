"""Every process draftfeed starts stops with the process that started it, at any moment of that one's life (issue 27,
"Stopping at any moment"): a signal to ``draftfeed demo`` while its workers are starting, while it trains, or while it
is already stopping them leaves none of its processes behind and removes its folder; a SIGKILLed demo, a SIGKILLed
preloader, or any process that started a child from a thread that has since ended, the same (``PR_SET_PDEATHSIG``)."""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import WORKER_ENV, wait_until
from support.preload import Preloader

from draftfeed.processes import children

pytestmark = pytest.mark.timeout(120)
WAIT_S = 60.0  # for a line or a condition, on a loaded 2-core machine


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state first), or None once the pid is no more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


class Proc:
    """One process, known by its pid and start time (a pid used again by a later process is not this one)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        fields = _stat(pid)
        self.started = fields[19] if fields else None

    def gone(self) -> bool:
        """Ended (a zombie has ended: only its exit status is left for whoever reaps it)."""
        fields = _stat(self.pid)
        return fields is None or fields[19] != self.started or fields[0] in ("Z", "X")

    def kill(self) -> None:
        if not self.gone():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Launched:
    """A command run here with its output read line by line, the processes under it as they appear, and everything it
    started killed on the way out, also when the test fails."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})}, start_new_session=True
        )
        self.lines: list[str] = []
        self._printed = threading.Condition()
        self.descendants: dict[int, Proc] = {}
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._printed:
                self.lines.append(line.rstrip("\n"))
                self._printed.notify_all()
        with self._printed:
            self.lines.append("<end of output>")
            self._printed.notify_all()

    def wait_for_line(self, pattern: str, timeout_s: float = WAIT_S) -> re.Match:
        """The first line matching ``pattern``; fails with the output if none comes within ``timeout_s``."""
        regex = re.compile(pattern)
        with self._printed:
            found = self._printed.wait_for(lambda: any(regex.search(line) for line in self.lines) or "<end of output>" in self.lines, timeout_s)
            match = next((m for line in self.lines if (m := regex.search(line))), None)
            assert found and match, f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:])
            return match

    def collect_descendants(self) -> int:
        """Every process under it now, added to those seen before; how many of them still run."""
        for pid in children.descendants(self.popen.pid):
            self.descendants.setdefault(pid, Proc(pid))
        return sum(not process.gone() for process in self.descendants.values())

    def wait_for_descendants(self, count: int) -> None:
        wait_until(lambda: self.collect_descendants() >= count, timeout_s=WAIT_S, what=f"{count} processes under pid {self.popen.pid}")

    def assert_none_left(self) -> None:
        wait_until(
            lambda: all(process.gone() for process in self.descendants.values()),
            timeout_s=30,
            what=f"the processes it started to end: {sorted(self.descendants)}",
        )

    def close(self) -> None:
        self.collect_descendants()
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        for process in self.descendants.values():
            process.kill()


def run_demo() -> Launched:
    return Launched([sys.executable, "-m", "draftfeed", "demo", "--steps", "100000", "--seq-len", "32"], env=WORKER_ENV)


def demo_folder(demo: Launched) -> Path:
    return Path(demo.wait_for_line(r"saved to (\S+)").group(1)).parent


@pytest.mark.parametrize("moment", [pytest.param(moment, marks=pytest.mark.long) for moment in ("starting its workers", "training", "stopping")])
def test_a_sigterm_to_the_demo_at_any_moment_stops_every_process_it_started_and_removes_its_folder(moment):
    demo = run_demo()
    folder = None
    try:
        folder = demo_folder(demo)
        if moment == "starting its workers":
            demo.wait_for_line(r"^broker: pid")
            demo.wait_for_descendants(3)  # the broker and both workers' processes exist
            assert not any(line.startswith("worker:") for line in demo.lines), "the workers were ready before the signal"
        else:
            demo.wait_for_line(r"^step ")
            demo.wait_for_descendants(3)
        demo.collect_descendants()
        demo.popen.send_signal(signal.SIGTERM)
        if moment == "stopping":
            demo.wait_for_line(r"draftfeed demo: SIGTERM: stopping the processes it started")
            demo.collect_descendants()
            demo.popen.send_signal(signal.SIGTERM)
            demo.wait_for_line(r"draftfeed demo: SIGTERM again: killing the processes it started")
        assert demo.popen.wait(60) == 128 + signal.SIGTERM, "\n".join(demo.lines[-40:])
        demo.assert_none_left()
        assert len(demo.descendants) >= 3, demo.descendants
        assert not folder.exists(), f"{folder} was left behind"
    finally:
        demo.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


# make test-long: the death signal it relies on is checked in the suite by the two tests below, on one child each
@pytest.mark.long
def test_a_sigkilled_demo_leaves_no_process_behind():
    demo = run_demo()
    folder = None
    try:
        folder = demo_folder(demo)
        demo.wait_for_line(r"^step ")
        demo.wait_for_descendants(3)
        demo.popen.kill()
        assert demo.popen.wait(30) == -signal.SIGKILL
        demo.assert_none_left()  # its folder stays: nothing of it ran after SIGKILL
    finally:
        demo.close()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


PARENT = """
import sys, threading
from draftfeed.processes import children
started = []
thread = threading.Thread(target=lambda: started.append(children.spawn([sys.executable, "-c", "import time; time.sleep(600)"])))
thread.start()
thread.join()
print(f"thread ended; child {started[0].pid}", flush=True)
threading.Event().wait()
"""


def test_a_child_started_from_a_thread_that_ended_lives_until_its_parent_is_sigkilled():
    """PR_SET_PDEATHSIG fires when the thread that started a child ends, so ``children.spawn`` starts every child from
    one thread that lives as long as the process."""
    parent = Launched([sys.executable, "-c", PARENT])
    try:
        pid = int(parent.wait_for_line(r"thread ended; child (\d+)").group(1))
        parent.wait_for_descendants(1)
        assert pid in parent.descendants and not parent.descendants[pid].gone()
        parent.popen.kill()
        parent.popen.wait(30)
        parent.assert_none_left()
    finally:
        parent.close()


def test_a_sigkilled_preloader_leaves_none_of_its_processes_behind():
    preloader = Preloader({**os.environ, **WORKER_ENV})
    try:
        child = preloader.popen("preload_probe", ["wait"], {**os.environ, **WORKER_ENV})
        assert child.stdout is not None
        assert select.select([child.stdout], [], [], WAIT_S)[0], "the preloaded process printed nothing"
        assert child.stdout.readline().startswith("probe argv=['wait']")
        probe = Proc(child.pid)
        preloader._server.kill()
        wait_until(probe.gone, timeout_s=30, what="the preloaded process to end with its preloader")
    finally:
        preloader.close()
