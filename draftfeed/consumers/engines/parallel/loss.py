"""How an engine over several processes stops when one of them is lost (a process of its own, a node's, a vLLM node).

The engine cannot compute any more, through no fault of the request in hand. In this order:

- ``why`` says so: the call in progress, and every later one, raises EngineLost (its request goes back to the broker,
  not charged);
- the ``hooks`` run at once (the worker says bye to its broker, which requeues what the worker held, even when the
  worker's own thread is stuck in a collective that will never return);
- ``on_lost`` stops the worker (by default a SIGTERM to this process, which drains as a SIGTERM does);
- and, if the process is still there ``LOST_GRACE_S`` later (stuck in such a collective), ``kill`` ends what it started
  and the process exits with status 70, unless the engine was closed in the meantime (a program that embeds the
  engine goes on).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger("draftfeed.worker")

LOST_GRACE_S = 10.0  # after a process was lost, how long the worker may take to stop before it is ended
LOST_EXIT_CODE = 70


def sigterm_self(_why: str) -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class EngineLoss:
    """The lost state of one engine: what was lost, who is told, and the timer that ends a stuck process."""

    def __init__(self, on_lost: Callable[[str], None] = sigterm_self, kill: Callable[[], None] = lambda: None) -> None:
        self.why: str | None = None
        self.hooks: list[Callable[[str], None]] = []  # told first (the worker leaves its broker)
        self.closing = False  # from here a process's end is expected
        self.started = False  # before, the start itself fails (it waits on the lost state), or the timer ends it
        self._on_lost = on_lost
        self._kill = kill
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._cancelled = False

    def lose(self, how: str) -> None:
        """A process ended or fell silent while the engine runs (called on a watch thread): the steps above, once."""
        if self.why is not None or self.closing:  # already stopping: a process out of step exits by itself
            return
        self.why = how
        log.error("worker: %s; the worker stops (its requests go back to the broker)", how)
        for hook in self.hooks:
            try:
                hook(how)
            except Exception:  # a hook must not keep the worker from stopping
                log.exception("worker: a hook on the lost engine failed")
        with self._lock:
            if not self._cancelled:
                self._timer = threading.Timer(LOST_GRACE_S, self._end_now)
                self._timer.daemon = True
                self._timer.start()
        if self.started:
            self._on_lost(how)

    def out_of_step(self, how: str) -> None:
        """The processes ended one call differently: the worker stops (drains), none of them is stuck."""
        if self.why is None:
            self.why = how
            log.error("worker: %s; the worker stops", how)
            self._on_lost(how)

    def found(self, how: str) -> None:
        """A call found the engine dead (vLLM's engine core ended): it raises EngineLost, and the worker stops for it."""
        if self.why is None:
            self.why = how
            log.error("worker: %s; the worker stops (its requests go back to the broker)", how)

    def close(self) -> None:
        """The engine closes: a later loss is expected, and a timer already running ends nothing."""
        self.closing = True
        with self._lock:
            self._cancelled = True
            if self._timer is not None:
                self._timer.cancel()

    def _end_now(self) -> None:
        log.error("worker: still running %.0f s after %s: exiting now", LOST_GRACE_S, self.why)
        self._kill()
        os._exit(LOST_EXIT_CODE)


class LossReported:
    """What the worker reads of an engine's loss (an engine that holds its EngineLoss as ``_loss``)."""

    _loss: EngineLoss

    @property
    def lost(self) -> str | None:
        """Why the engine can no longer compute, or None."""
        return self._loss.why

    @property
    def lost_hooks(self) -> list[Callable[[str], None]]:
        """Told first when the engine cannot compute (the worker leaves its broker)."""
        return self._loss.hooks
