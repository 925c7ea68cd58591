"""A rank's table of unanswered requests: ids and tokens, the credit window, first-answer-wins resolution.

Thread-safe: callers add requests and pack them on their threads, the IO thread sends, resends and resolves them.

- Each request has a random 63-bit token; an answer that does not echo it is not for this request.
- A request of kind BATCH holds one slot of the window (``prefetch_depth``) until it is resolved; adding one
  while all slots are held blocks, up to a timeout.
- A request whose answer was lost can be asked again under a new id (``alias``); it answers to every id it
  had, and the first answer resolves it, once. Later answers find nothing and count as duplicates.
- The vocab mappings set through the table are kept by digest while they are the current one or an
  unanswered request names them, so that they can be sent again to a broker that lacks them.
- A request the broker called busy is due again after a backoff that doubles per busy answer.
- A request whose answer shows no sign of progress (its sending, a piece of its answer) for a liveness period is
  asked about (``stale``): the broker says where it is (``located``), and one the broker no longer holds, or never
  had, is due again at once. What the broker last said of it is kept, for the error of a wait that times out
  (``describe``).
"""

from __future__ import annotations

import enum
import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from draftfeed.producers.answers import Answer, Finish, Reply, settle
from draftfeed.schemas.messages import Place
from draftfeed.schemas.protocol import MAX_WHERE

BUSY_RETRY_S = (0.05, 1.0)  # a busy request is sent again after the first, doubling per busy answer up to the second


class RequestKind(enum.Enum):
    BATCH = "batch"  # a submit for workers: holds a window slot, sent again to a broker that lacks it, may name a mapping
    QUERY = "query"  # a question the broker answers (model info): sent again to a broker that lacks it
    SET_MAPPING = "set_mapping"  # a vocab mapping: sent again, and kept by digest for requests that name it
    STATUS = "status"  # asked once: never sent again

    @property
    def holds_window_slot(self) -> bool:
        return self is RequestKind.BATCH

    @property
    def sent_again(self) -> bool:
        return self is not RequestKind.STATUS


@dataclass
class Waiter:
    """One unanswered request."""

    future: Answer
    kind: RequestKind
    token: int
    mapping: str | None = None  # the vocab mapping it names (BATCH) or sets (SET_MAPPING)
    frames: list[Any] | None = None  # packed by the caller, under its latest id; kept for resending
    retry_at: float | None = None
    busy_retries: int = 0
    ids: list[int] = field(default_factory=list)  # every request id it answers to, the latest last
    added_at: float = 0.0  # when the caller asked for it (the table's clock)
    sent_at: float | None = None  # when its frames last went to the outbox (the table's clock)
    asked_at: float | None = None  # when the broker was last asked where it is
    asked: int = 0  # how many times
    seen: Place | None = None  # where the broker last said it was
    seen_at: float | None = None  # when it said so
    sent_again_lost: int = 0  # times it was sent again because the broker no longer held it

    def progressed_at(self) -> float | None:
        """When it last showed a sign of life: sent, or a piece of its answer came (the answer's ``progressed_at``,
        on time.monotonic, which is the table's clock outside tests)."""
        marks = [t for t in (self.sent_at, self.future.progressed_at) if t is not None]
        return max(marks) if marks else None


class RequestTable:
    def __init__(self, window: int, clock: Callable[[], float] = time.monotonic) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self.clock = clock
        self._ids = itertools.count()
        self._random = random.SystemRandom()
        self._waiters: dict[int, Waiter] = {}
        self._mappings: dict[str, Waiter] = {}  # digest -> its set_mapping request, the current one last
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(window)
        self.in_flight = 0  # BATCH requests unanswered
        self.peak_in_flight = 0

    # ------------------------------------------------------------ adding
    def add(
        self,
        finish: Finish,
        kind: RequestKind,
        *,
        mapping: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, Waiter] | None:
        """A new request and its id, to be packed (``frames``) by the caller; None if it needs a window slot and none
        came free within ``timeout_s``. Its future's value is ``finish(reply header, tensors)``, run by the taker."""
        if kind.holds_window_slot and not self._slots.acquire(timeout=timeout_s):
            return None
        with self._lock:
            request_id = next(self._ids)
            waiter = Waiter(Answer(finish, request_id), kind, self._random.getrandbits(63), mapping, added_at=self.clock())
            waiter.ids.append(request_id)
            self._waiters[request_id] = waiter
            if kind is RequestKind.SET_MAPPING and mapping is not None:
                self._mappings.pop(mapping, None)
                self._mappings[mapping] = waiter
                named = {w.mapping for w in self._waiters.values()}
                for digest in [d for d in self._mappings if d != mapping and d not in named]:
                    del self._mappings[digest]
            if kind.holds_window_slot:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return request_id, waiter

    def alias(self, request_id: int) -> tuple[int, Waiter] | None:
        """Ask for an unanswered request again under a new id (it keeps answering to the old ones); None if answered."""
        with self._lock:
            waiter = self._waiters.get(request_id)
            if waiter is None:
                return None
            new_id = next(self._ids)
            self._waiters[new_id] = waiter
            waiter.ids.append(new_id)
            return new_id, waiter

    # ------------------------------------------------------------ looking up
    def get(self, request_id: int) -> Waiter | None:
        with self._lock:
            return self._waiters.get(request_id)

    def __contains__(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._waiters

    def check(self, request_id: int, token: int) -> Literal["ok", "answered", "foreign"]:
        """Whether an answer for ``request_id`` echoing ``token`` is for an unanswered request of this table."""
        waiter = self.get(request_id)
        if waiter is None:
            return "answered"
        return "ok" if waiter.token == token else "foreign"

    def unanswered(self) -> list[Waiter]:
        """Every unanswered request that is sent again after a resync and has been packed, in the order sent."""
        with self._lock:
            waiters = self._unique()
        return [w for w in sorted(waiters, key=lambda w: w.ids[-1]) if w.kind.sent_again and w.frames is not None]

    def mappings_to_resend(self, waiters: list[Waiter]) -> list[Waiter]:
        """The current vocab mapping and any other one of ``waiters`` names, packed, not among ``waiters``."""
        named = {w.mapping for w in waiters if w.kind is RequestKind.BATCH}
        with self._lock:
            current = next(reversed(self._mappings), None)
            chosen = [m for d, m in self._mappings.items() if d == current or d in named]
        return [m for m in chosen if m.frames is not None and all(m is not w for w in waiters)]

    def mapping(self, digest: str) -> Waiter | None:
        with self._lock:
            return self._mappings.get(digest)

    # ------------------------------------------------------------ busy backoff
    def busy(self, request_id: int) -> None:
        """The broker's queue was full: send this request again after a backoff."""
        with self._lock:
            waiter = self._waiters.get(request_id)
            if waiter is not None:
                waiter.busy_retries += 1
                low, high = BUSY_RETRY_S
                waiter.retry_at = self.clock() + min(high, low * 2 ** min(waiter.busy_retries, 10))

    def due_again(self) -> list[Waiter]:
        """The busy requests whose backoff is over (each returned once per busy answer)."""
        now = self.clock()
        with self._lock:
            due = [w for w in self._unique() if w.retry_at is not None and w.retry_at <= now and w.frames is not None]
            for waiter in due:
                waiter.retry_at = None
        return due

    # ------------------------------------------------------------ where is it?
    def sent(self, waiter: Waiter) -> None:
        """Its frames went to the outbox (first sent, sent again after a resync, a busy answer, or a loss)."""
        with self._lock:
            waiter.sent_at = self.clock()

    def stale(self, quiet_s: float, again_s: float) -> list[int]:
        """The ids (each request's latest) of the requests to ask the broker about, oldest first, at most ``MAX_WHERE``:
        batches sent and not in a busy backoff whose answer has shown no sign of progress for ``quiet_s``, not asked
        about since their last progress, or the broker's last word on them older than ``again_s`` (``quiet_s`` when
        it said it holds them: a loss after that is found within a liveness period)."""
        now = self.clock()
        chosen: list[Waiter] = []
        with self._lock:
            for waiter in self._unique():
                if waiter.kind is not RequestKind.BATCH or waiter.frames is None or waiter.retry_at is not None:
                    continue
                progressed = waiter.progressed_at()
                if progressed is None or now - progressed < quiet_s:
                    continue
                if waiter.asked_at is not None and waiter.asked_at >= progressed:  # asked since its last progress
                    answered = waiter.seen is not None and waiter.seen_at is not None and waiter.seen_at >= waiter.asked_at
                    held = answered and waiter.seen is not None and waiter.seen.place not in ("done", "unknown")
                    if now - waiter.asked_at < (quiet_s if held else again_s):
                        continue
                chosen.append(waiter)
            chosen.sort(key=lambda w: w.ids[0])
            chosen = chosen[:MAX_WHERE]
            for waiter in chosen:
                waiter.asked_at = now
                waiter.asked += 1
        return [waiter.ids[-1] for waiter in chosen]

    def oldest_s(self) -> float:
        """How long the oldest unanswered batch has waited for its answer (0 when none waits)."""
        now = self.clock()
        with self._lock:
            return max((now - w.added_at for w in self._waiters.values() if w.kind is RequestKind.BATCH), default=0.0)

    def located(self, place: Place, grace_s: float) -> Waiter | None:
        """The broker said where request ``place.request_id`` is. The waiter, to send again, when the broker does not
        hold it: it never had it or forgot it (unknown), or it left the broker's care more than ``grace_s`` ago
        (done) and its answer never came; None otherwise (held, answered meanwhile, or done a moment ago: its
        answer may be on its way, and the next ``where`` asks again)."""
        with self._lock:
            waiter = self._waiters.get(place.request_id)
            if waiter is None or waiter.ids[-1] != place.request_id:
                return None  # answered meanwhile, or asked again under a newer id since
            waiter.seen, waiter.seen_at = place, self.clock()
            lost = place.place == "unknown" or (place.place == "done" and place.age_s >= grace_s)
            if not lost or waiter.frames is None:
                return None
            waiter.sent_again_lost += 1
            waiter.seen = None  # what the broker says of the new try is what counts
            return waiter

    def describe(self, request_id: int | None) -> str | None:
        """Where the unanswered request that answers to ``request_id`` was last seen, in words (for a timeout's error
        and the waits' log); None if it is not here."""
        if request_id is None:
            return None
        now = self.clock()
        with self._lock:
            waiter = self._waiters.get(request_id)
            if waiter is None:
                return None
            latest, seen, seen_at, asked, asked_at = waiter.ids[-1], waiter.seen, waiter.seen_at, waiter.asked, waiter.asked_at
            lost, sent_at = waiter.sent_again_lost, waiter.sent_at
        again = f"; sent again {lost} {'time' if lost == 1 else 'times'} after the broker had lost track of it" if lost else ""
        if seen is not None and seen_at is not None:
            return f"request {latest} was {_in_words(seen)}, as the broker said {now - seen_at:.1f} s ago{again}"
        if asked and asked_at is not None:
            return f"request {latest} was never acknowledged: the broker has not said where it is (asked {asked} times, last {now - asked_at:.1f} s ago){again}"
        if sent_at is not None:
            return f"request {latest} was sent {now - sent_at:.1f} s ago{again}"
        return f"request {latest} has not been sent yet{again}"

    # ------------------------------------------------------------ resolving
    def resolve(self, request_id: int, *, header: Any = None, tensors: dict[str, Any] | None = None, error: BaseException | None = None) -> bool:
        """Settle the request that answers to ``request_id`` with the reply (``header``, ``tensors``) or ``error``,
        once; False if it was already resolved. Nothing of the caller's runs here (``finish`` runs when taken)."""
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
            if waiter is None:
                return False
            for other in waiter.ids:
                self._waiters.pop(other, None)
            if waiter.kind.holds_window_slot:
                self.in_flight -= 1
        if waiter.kind.holds_window_slot:
            self._slots.release()
        settle(waiter.future, Reply(header, tensors or {}), error)
        return True

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiters = self._unique()
            self._waiters.clear()
            held = sum(w.kind.holds_window_slot for w in waiters)
            self.in_flight -= held
        for _ in range(held):
            self._slots.release()
        for waiter in waiters:
            settle(waiter.future, None, error)

    def _unique(self) -> list[Waiter]:
        """Each waiter once (one asked again answers to several ids); call with the lock held."""
        return list({id(w): w for w in self._waiters.values()}.values())


def _in_words(place: Place) -> str:
    """Where the broker said a request was: ``queued at the broker for 3.0 s``, ``computing at worker w1 for 590.2 s``."""
    if place.place == "done":
        by = f" by worker {place.worker}" if place.worker else " by the broker"
        return f"done {place.age_s:.1f} s before ({place.outcome}{by}), but its answer never came"
    if place.place == "unknown":
        return "unknown to the broker"
    where = {"queued": "queued at the broker", "parked": "parked at the broker (beyond the rank's window)"}.get(place.place)
    if where is None:
        where = f"{'computing' if place.place == 'computing' else 'waiting'} at worker {place.worker}"
    return f"{where} for {place.age_s:.1f} s" + (f" ({place.note})" if place.note else "")
