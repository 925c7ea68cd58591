"""A rank's protocol with the broker, without sockets: what it says, what it makes of what it hears.

The rank's IO thread (connection.py) runs it in the peers' loop (peer_loop.py), which moves its frames; the
caller's threads read what it knows (the service's workers, the broker's state in words). It keeps time with
the clock it is given, so its fault handling is tested under a hand-turned clock (tests/test_rank_session.py).

- It says hello when the loop starts, and again when the broker restarts (a heartbeat from another instance),
  says it does not know or has forgotten this rank, says goodbye, or falls silent for its liveness period
  (broker_view.py decides when; one hello on its way at a time).
- A welcome that says the broker holds nothing of this rank (``resumed`` false) makes it send its vocab
  mappings, then every unanswered request, in order. A request refused because the broker lacks its mapping
  (``unknown_mapping``) goes again behind that mapping; one the broker called busy goes again after a backoff.
- A request whose answer has shown no sign of progress for a liveness period is asked about (``where``, on the
  beat); the broker's ``whereabouts`` say where each is, and one the broker no longer holds (done, its answer never
  came) or never had is sent again at once: whatever lost it (a worker killed between its done and its answer's
  last bytes, a message dropped), the rank finds out within about a liveness period, not at its request_timeout.
- Each request is answered at most once: the first answer that echoes the request's random token resolves it;
  any later one is dropped and counted, and so is one with another token (``foreign``).
- A refusal of the rank itself (another target, over a limit, the wrong port, a refused handshake) breaks it:
  every outstanding request fails with the reason, and a rank still connecting raises it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from draftfeed.broker_view import BrokerView
from draftfeed.logs import RateLimitedLog
from draftfeed.peer_loop import Outbox
from draftfeed.producers.requests import RequestTable, Waiter
from draftfeed.schemas.errors import NonFiniteSupervision, RemoteTargetError
from draftfeed.schemas.frames import pack, with_request_id
from draftfeed.schemas.messages import (
    Ack,
    ErrorReply,
    Failure,
    Goodbye,
    Heartbeat,
    Hello,
    ModelInfoReply,
    Result,
    ServiceWorkers,
    StatusReply,
    Welcome,
    Where,
    Whereabouts,
    WorkerKeys,
    WorkersGone,
)

log = logging.getLogger("draftfeed.producer")

# The ErrorReply codes that refuse the rank itself, not one of its requests.
REFUSING_THE_RANK = ("unreachable", "mismatch", "over_limit", "wrong_port")
# A request done at the broker this many heartbeat intervals ago, whose answer has not come, is taken for lost (a
# moment sooner, its answer may still be on its way).
DONE_GRACE_BEATS = 2


@dataclass
class ConnectionStats:
    duplicates_dropped: int = 0
    foreign_dropped: int = 0
    malformed_dropped: int = 0
    resyncs: int = 0
    busy_retries: int = 0
    received_over_pair: int = 0
    lost_over_pair: int = 0  # answers lost with a failed pair group or nixl pair, or partway in pieces; asked for again
    received_over_nixl: int = 0
    received_in_pieces: int = 0  # answers over --transfer-chunk-bytes, on frames
    bytes_in_pieces: int = 0
    seconds_in_pieces: float = 0.0  # from each such answer's header to its last piece
    checksum_mismatches: int = 0  # answers whose digests said they arrived changed: dropped, asked for again
    where_asked: int = 0  # ``where`` messages sent: requests whose answer showed no progress for a liveness period
    lost_resent: int = 0  # requests the broker no longer held (or never had) while the rank waited: sent again


class RankSession:
    def __init__(
        self,
        rank_id: str,
        broker: str,
        service: str,
        requests: RequestTable,
        on_worker_gone: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank_id, self.broker_endpoint, self.service = rank_id, broker, service
        self.requests = requests
        self.broker = BrokerView(clock)
        self.outbox = Outbox()
        self.stats = ConnectionStats()
        # Set once the rank's data socket is bound, before the loop starts; replaced (one assignment) by the caller's
        # thread when the rank has checked the service's target, so that every hello from then on names it.
        self.hello: Hello | None = None
        self.welcome = threading.Event()  # the first welcome, or a refusal (``broken`` then says why)
        self.broken: RemoteTargetError | None = None
        self.worker_keys: frozenset[bytes] = frozenset()  # the workers the broker vouches for (secure brokers)
        self.service_workers: int | None = None  # the ready workers of this rank's service, as the broker last said
        self.services: dict[str, int] = {}  # every service of the broker, with its ready workers, at the welcome
        self.has_workers = threading.Event()
        self.goodbye_at: float | None = None  # when the broker last said goodbye (None: since a broker answered)
        self._on_worker_gone = on_worker_gone
        self.bad_input = RateLimitedLog(log)

    # ------------------------------------------------------------ the loop's protocol
    @property
    def answered(self) -> bool:
        return self.welcome.is_set()

    def handshake_refused(self, verdict: str) -> None:
        self.broken = RemoteTargetError(verdict)
        self.welcome.set()

    def turn(self) -> None:
        for waiter in self.requests.due_again():
            self._put(waiter)

    def beat(self) -> None:
        self.outbox.put(pack(Heartbeat()), droppable=True)
        silence = self.broker.silence()
        if silence is not None and self.broker.may_introduce():
            if self.broker.instance is not None:  # before any welcome, the constructor says what it waits for
                log.warning("draftfeed rank %s: broker %s %s; saying hello again", self.rank_id, self.broker_endpoint, silence)
            self.say_hello()
        elif self.broker.instance is not None and self.broker.introduced_at is None:
            self._ask_where()

    def _ask_where(self) -> None:
        """Ask the broker where the requests are whose answers have shown no progress for a liveness period."""
        stale = self.requests.stale(self.broker.liveness_s, self.broker.interval_s)
        if stale:
            self.stats.where_asked += 1
            self.outbox.put(pack(Where(request_ids=stale)), droppable=True)  # the next beat asks again

    # ------------------------------------------------------------ what it says
    def say_hello(self) -> None:
        """Introduce this rank; a welcome that says the broker holds nothing of it makes it resend everything."""
        assert self.hello is not None
        self.broker.introducing()
        self.outbox.put(pack(self.hello), droppable=True)

    def send(self, request_id: int) -> None:
        """A caller's request, packed by the caller (else closed or failed meanwhile)."""
        waiter = self.requests.get(request_id)
        if waiter is not None and waiter.frames is not None:
            self._put(waiter)

    def _put(self, waiter: Waiter) -> None:
        """A packed request to the outbox, its sending noted (a request is asked about when nothing moves after it)."""
        assert waiter.frames is not None
        self.requests.sent(waiter)
        self.outbox.put(waiter.frames)

    def ask_again(self, request_id: int, reason: str) -> None:
        """An answer was lost with its pair group or nixl pair, or partway through its pieces: the request goes again
        under a new id."""
        aliased = self.requests.alias(request_id)
        if aliased is None:
            return  # answered meanwhile (the worker's frames fallback came first)
        new_id, waiter = aliased
        self.stats.lost_over_pair += 1
        log.warning(
            "draftfeed rank %s: the answer to request %d was lost on its way (%s); asking again as request %d",
            self.rank_id,
            request_id,
            reason,
            new_id,
        )
        assert waiter.frames is not None  # packed before it was sent, and only what was sent is lost
        waiter.frames = with_request_id(waiter.frames, new_id)
        self._put(waiter)

    # ------------------------------------------------------------ what it hears from the broker
    def on_broker(self, message: Any) -> None:
        self.broker.heard()
        if isinstance(message, Heartbeat):
            if self.broker.restarted(message.instance):
                self._hello_again()  # a broker that has not welcomed this rank
        elif isinstance(message, Welcome):
            self._welcomed(message)
        elif isinstance(message, ServiceWorkers):
            if message.service == self.service:
                self._set_service_workers(message.workers)
        elif isinstance(message, WorkerKeys):
            self.worker_keys = frozenset(key.encode() for key in message.keys)
        elif isinstance(message, WorkersGone):
            for worker in message.workers:
                self._on_worker_gone(worker)
        elif isinstance(message, Goodbye):
            log.warning("draftfeed rank %s: broker %s is shutting down; waiting for its successor", self.rank_id, message.instance)
            self.goodbye_at = self.broker.clock()
            self.say_hello()  # whatever hello went to the old instance is lost with it
        elif isinstance(message, ErrorReply):
            self._on_error(message)
        elif isinstance(message, Ack):
            if message.request_id in self.requests:  # else the acknowledgement of a mapping sent again
                self.requests.resolve(message.request_id, header=message)
        elif isinstance(message, (ModelInfoReply, StatusReply)):
            self._resolve(message.request_id, header=message)
        elif isinstance(message, Whereabouts):
            self._located(message)

    def _located(self, message: Whereabouts) -> None:
        """The broker said where the requests asked about are: one it no longer holds, or never had, goes again."""
        grace_s = DONE_GRACE_BEATS * self.broker.interval_s
        for place in message.places:
            waiter = self.requests.located(place, grace_s)
            if waiter is None:
                continue
            self.stats.lost_resent += 1
            said = (
                f"done {place.age_s:.1f} s ago ({place.outcome} by {f'worker {place.worker}' if place.worker else 'the broker'}) "
                "and its answer never came"
                if place.place == "done"
                else "unknown to it"
            )
            log.warning("draftfeed rank %s: request %d is %s at the broker; sending it again", self.rank_id, place.request_id, said)
            self._put(waiter)

    def _welcomed(self, message: Welcome) -> None:
        first = self.broker.instance is None
        self.broker.welcomed(message.instance, message.liveness)
        self.goodbye_at = None
        self.services = dict(message.services)
        self._set_service_workers(message.services.get(self.service, 0))
        self.worker_keys = frozenset(key.encode() for key in message.worker_keys)
        if not message.resumed and not first:
            self._resync(message.instance)
        self.welcome.set()

    def _hello_again(self) -> None:
        if self.broker.may_introduce():
            self.say_hello()

    def _on_error(self, message: ErrorReply) -> None:
        if message.code == "unknown_peer":
            self._hello_again()
        elif message.code == "forgotten":
            log.warning("draftfeed rank %s: %s", self.rank_id, message.message)
            self._hello_again()
        elif message.code == "unknown_mapping" and message.request_id is not None:
            self._send_behind_its_mapping(message.request_id)
        elif message.code == "busy" and message.request_id is not None:
            self.requests.busy(message.request_id)
            self.stats.busy_retries += 1
            log.info("draftfeed rank %s: %s", self.rank_id, message.message)
        elif message.code in REFUSING_THE_RANK or (message.request_id is None and not self.welcome.is_set()):
            self.broken = RemoteTargetError(f"the broker at {self.broker_endpoint} refused this rank: {message.message}")
            log.error("draftfeed rank %s: %s", self.rank_id, self.broken)
            self.requests.fail_all(self.broken)
            self.welcome.set()  # a rank still connecting raises this at once
        elif message.request_id is None:
            log.error("draftfeed rank %s: the broker reports: %s", self.rank_id, message.message)
        else:
            self._resolve(message.request_id, error=RemoteTargetError(f"the broker refused the request: {message.message}"))

    def _resync(self, instance: str) -> None:
        """A broker instance that holds nothing of this rank: send it the vocab mappings (the current one and any an
        unanswered request names), then every unanswered request, in order."""
        self.outbox.clear()  # everything unanswered goes now, in order
        waiters = self.requests.unanswered()
        mappings = self.requests.mappings_to_resend(waiters)
        self.stats.resyncs += 1
        log.warning(
            "draftfeed rank %s: broker instance %s holds nothing of this rank; resending %d vocab mappings and %d unanswered requests",
            self.rank_id,
            instance,
            len(mappings),
            len(waiters),
        )
        for waiter in [*mappings, *waiters]:
            self._put(waiter)

    def _send_behind_its_mapping(self, request_id: int) -> None:
        """The broker lacks the mapping this request names: send the mapping, then the request again."""
        waiter = self.requests.get(request_id)
        if waiter is None or waiter.frames is None:
            return  # answered meanwhile
        mapping = self.requests.mapping(waiter.mapping) if waiter.mapping is not None else None
        if mapping is None or mapping.frames is None:
            self._resolve(request_id, error=RemoteTargetError(f"the broker lacks vocab mapping {waiter.mapping}, which this rank no longer holds"))
            return
        log.info("draftfeed rank %s: the broker lacks vocab mapping %s; sending it before request %d again", self.rank_id, waiter.mapping, request_id)
        self._put(mapping)
        self._put(waiter)

    def _set_service_workers(self, workers: int) -> None:
        self.service_workers = workers
        if workers > 0:
            self.has_workers.set()
        else:
            self.has_workers.clear()

    # ------------------------------------------------------------ answers from workers
    def on_answer(self, message: Result | Failure, tensors: Callable[[], dict[str, Any]]) -> None:
        """A worker's answer, on whichever plane it came: ``tensors`` decodes it, only if it is for an unanswered request."""
        verdict = self.requests.check(message.request_id, message.token)
        if verdict == "answered":
            self.stats.duplicates_dropped += 1
            log.debug("draftfeed rank %s: dropping a second answer to request %d", self.rank_id, message.request_id)
            return
        if verdict == "foreign":
            self.stats.foreign_dropped += 1
            self.bad_input.warning(
                "token",
                "draftfeed rank %s: dropping an answer to request %d with the wrong token (from %s)",
                self.rank_id,
                message.request_id,
                message.worker,
            )
            return
        if isinstance(message, Failure):
            said = f"worker {message.worker} of service {self.service!r} could not serve the request: {message.message}"
            at = message.nonfinite
            error = (
                RemoteTargetError(said)
                if at is None
                else NonFiniteSupervision(said, tensor=at.tensor, index=tuple(at.index), value=at.value, layer=at.layer)
            )
            self._resolve(message.request_id, error=error)
        else:
            self._resolve(message.request_id, header=message, tensors=tensors())

    def refuse_answer(self, header: Result, reason: str) -> None:
        """An answer announced on a pair group or nixl pair that this rank will not take (over its limits): final."""
        self._resolve(
            header.request_id, error=RemoteTargetError(f"worker {header.worker}'s answer to request {header.request_id} was refused: {reason}")
        )

    def _resolve(self, request_id: int, *, header: Any = None, tensors: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        if not self.requests.resolve(request_id, header=header, tensors=tensors, error=error):
            self.stats.duplicates_dropped += 1

    # ------------------------------------------------------------ in words
    def describe_broker(self) -> str:
        """The broker as this rank last heard it, in words: for waits and timeouts."""
        silent = self.broker.silent_s()
        if self.goodbye_at is not None:
            return (
                f"the broker at {self.broker_endpoint} shut down {self.broker.clock() - self.goodbye_at:.0f} s ago and no broker has answered since"
            )
        if silent > self.broker.liveness_s:
            return f"the broker at {self.broker_endpoint} has not answered for {silent:.0f} s (its liveness period is {self.broker.liveness_s:.0f} s)"
        return f"the broker was heard {silent:.1f} s ago"
