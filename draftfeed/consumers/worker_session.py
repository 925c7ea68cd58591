"""A worker's protocol with the broker, without sockets; and the inbox through which it hands work to the compute loop.

The worker's broker link (broker_link.py) runs the session in the peers' loop (peer_loop.py), which moves its
frames; it keeps time with the clock it is given, so its fault handling is tested under a hand-turned clock
(tests/test_worker_session.py).

- It registers when the loop starts, and again when the broker falls silent for its liveness period, restarts
  (a heartbeat from another instance), says it does not know or has forgotten this worker, or says goodbye
  (broker_view.py decides when; one registration on its way at a time). Each registration afresh tells the
  compute loop to drop what it had queued (``RESET``): the broker has requeued it.
- A refusal of its registration (another target than the service's, a refused handshake) ends the link: the
  worker exits with the reason.
- On each beat, and only then, it sends a heartbeat with the worker's stats; what the compute loop has for the
  broker (``done``, ``computing``, ``draining``) goes out in order; ``STOP`` from it says bye and ends the link.
  Each registration calls ``on_register`` (the heartbeats report every pair again: pair_report.py).
- Everything else the broker sends (dispatches, vocab mappings, forget_ranks, forget_mapping) goes to the compute
  loop through the ``Inbox``, parsed once, in the order it came.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from draftfeed.broker_view import BrokerView
from draftfeed.peer_loop import Outbox
from draftfeed.schemas.frames import pack
from draftfeed.schemas.messages import Bye, ErrorReply, ForgetRanks, Goodbye, Heartbeat, Register, Registered, WorkerHeartbeat

log = logging.getLogger("draftfeed.worker")

STOP = b"stop"  # compute loop -> link: say bye and end
RESET = "reset"  # link -> compute loop, through the inbox: registered afresh; drop queued dispatches and mappings


class Inbox:
    """What the link hands the compute loop: each message with its tensor frames (or ``RESET``), in the order it came.

    It also counts how often ``forget_ranks`` named each rank data endpoint (any thread): a delivery stuck on a rank
    that is gone learns it from the count at once, while the compute loop is busy delivering."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, list[Any]] | str] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._forgets: Counter[str] = Counter()

    def put(self, message: Any, frames: list[Any]) -> None:
        if isinstance(message, ForgetRanks):
            with self._lock:
                for address in message.ranks:
                    self._forgets[address.data_endpoint] += 1
        self._queue.put((message, frames))

    def reset(self) -> None:
        self._queue.put(RESET)

    def get(self, timeout_s: float) -> tuple[Any, list[Any]] | str | None:
        """The next item, waiting up to ``timeout_s``; None if none came."""
        try:
            return self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None

    def forgets(self, data_endpoint: str) -> int:
        """How many times ``forget_ranks`` named the rank at ``data_endpoint`` so far."""
        with self._lock:
            return self._forgets[data_endpoint]


class WorkerSession:
    def __init__(
        self,
        registration: Register,
        broker_endpoint: str,
        stats: Callable[[], WorkerHeartbeat],
        inbox: Inbox,
        clock: Callable[[], float] = time.monotonic,
        on_register: Callable[[], None] | None = None,
    ) -> None:
        self.registration = registration
        self.worker = registration.worker
        self.broker_endpoint = broker_endpoint
        self.broker = BrokerView(clock)
        self.outbox = Outbox()
        self.inbox = inbox
        self._stats = stats
        self._on_register = on_register
        self.registered = threading.Event()  # the first registration, or a refusal (``refused`` then says why)
        self.refused: str | None = None
        self.registrations = 0
        self.ended = False  # refused, or told to stop: the link ends

    # ------------------------------------------------------------ the loop's protocol
    @property
    def answered(self) -> bool:
        return self.registered.is_set()

    def handshake_refused(self, verdict: str) -> None:
        self._refuse(verdict)

    def turn(self) -> None:
        """Nothing each turn: the worker's link acts on messages and beats only."""

    def beat(self) -> None:
        silence = self.broker.silence()
        if self.registered.is_set() and silence is not None and self.broker.may_introduce():
            log.warning("worker %s: broker %s %s; registering again", self.worker, self.broker_endpoint, silence)
            self._register_again()
        self.outbox.put(pack(self._stats()), droppable=True)

    # ------------------------------------------------------------ what it says
    def register(self) -> None:
        if self._on_register is not None:
            self._on_register()
        self.broker.introducing()
        self.outbox.clear()  # what waits went to a broker that requeues it all
        self.outbox.put(pack(self.registration))

    def _register_again(self) -> None:
        """Register afresh, unless a registration is already on its way (each one makes the broker requeue)."""
        if not self.broker.may_introduce():
            return
        self.inbox.reset()
        self.register()

    def from_compute_loop(self, frames: list[Any]) -> None:
        """What the compute loop sends the broker; ``STOP`` says bye (droppable: a broker out of reach forgets this
        worker anyway) and ends the link."""
        if len(frames) == 1 and bytes(frames[0]) == STOP:
            self.outbox.put(pack(Bye()), droppable=True)
            self.ended = True
        else:
            self.outbox.put(frames)

    # ------------------------------------------------------------ what it hears from the broker
    def on_broker(self, message: Any, frames: list[Any]) -> None:
        self.broker.heard()
        if isinstance(message, Registered):
            self.broker.welcomed(message.instance, message.liveness)
            self.registrations += 1
            log.info("worker %s: registered with broker %s (instance %s)", self.worker, message.broker, message.instance)
            self.registered.set()
        elif isinstance(message, ErrorReply):
            self._on_error(message)
        elif isinstance(message, Heartbeat):
            if self.broker.restarted(message.instance):
                log.warning("worker %s: the broker restarted (instance %s); registering again", self.worker, message.instance)
                self._register_again()
        elif isinstance(message, Goodbye):
            log.warning("worker %s: the broker is shutting down; registering with its successor", self.worker)
            self.broker.introduced_at = None  # whatever registration went to the old instance is lost with it
            self._register_again()
        else:
            self.inbox.put(message, frames)

    def _on_error(self, message: ErrorReply) -> None:
        awaiting = self.broker.introduced_at is not None
        if not self.registered.is_set() or (awaiting and message.code == "refused"):
            self._refuse(message.message)
        elif message.code in ("unknown_peer", "forgotten"):
            log.warning("worker %s: %s; registering again", self.worker, message.message)
            self._register_again()
        else:
            log.warning("worker %s: the broker reports: %s", self.worker, message.message)

    def _refuse(self, why: str) -> None:
        self.refused = why
        self.ended = True
        log.error("worker %s: the broker refused registration: %s", self.worker, why)
        self.registered.set()
