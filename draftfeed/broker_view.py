"""What a rank or a worker knows of its broker, and when it introduces itself again (hello / register).

Both peers of the broker keep one: the broker instance that welcomed them, the liveness they adopted from it,
when they last heard from it, and whether an introduction is on its way. Policy, the same on both sides:

- introduce again when the broker has been silent for its liveness period, when a heartbeat names another
  instance (it restarted), when it says it does not know or has forgotten this peer, or after its goodbye;
- but never while an introduction sent less than one window ago is unanswered: each one makes the broker
  requeue or resync, so one at a time;
- the instance and liveness of the welcome answering it are adopted.

Pure: it keeps time with the clock it is given and touches no socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from draftfeed.schemas.messages import Liveness

DEFAULT_LIVENESS = Liveness(heartbeat_interval_s=1.0, liveness=5)  # until the broker's own arrives


class BrokerView:
    """What one peer (a rank or a worker) knows of its broker, and when it introduces itself again."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.instance: str | None = None
        self.liveness = DEFAULT_LIVENESS
        self.last_heard = clock()
        self.introduced_at: float | None = None  # when the unanswered introduction went out; None: answered
        self.instances: list[str] = []  # every instance that welcomed this peer, in order

    @property
    def liveness_s(self) -> float:
        return self.liveness.period_s

    def heard(self) -> None:
        self.last_heard = self.clock()

    def silent_s(self) -> float:
        return self.clock() - self.last_heard

    def may_introduce(self) -> bool:
        """Whether an introduction may go out now (none is on its way, or the last one went unanswered a window long)."""
        return self.introduced_at is None or self.clock() - self.introduced_at >= self.liveness_s

    def introducing(self) -> None:
        self.introduced_at = self.clock()

    def welcomed(self, instance: str, liveness: Liveness) -> bool:
        """A welcome (or registration) from ``instance``; True if it is another instance than the last one."""
        self.introduced_at = None
        self.liveness = liveness
        new = instance != self.instance
        if new:
            self.instance = instance
            self.instances.append(instance)
        return new

    def restarted(self, instance: str | None) -> bool:
        """Whether a heartbeat from ``instance`` shows a broker that has not welcomed this peer."""
        return self.instance is not None and instance != self.instance

    def silence(self) -> str | None:
        """Why to introduce again for silence (how long), or None while the broker is heard within its window."""
        silent = self.silent_s()
        return f"silent for {silent:.1f} s (liveness period {self.liveness_s:.1f} s)" if silent > self.liveness_s else None

    @property
    def interval_s(self) -> float:
        return self.liveness.heartbeat_interval_s
