"""The worker's link to the broker, on its own thread so that heartbeats flow while the target computes.

It registers, passes the broker's messages to the compute loop through an inproc pipe and the compute
loop's messages (``done``, ``draining``) to the broker, and keeps the registration alive: a broker that
is silent for its liveness window, says it does not know or has forgotten this worker, restarts (a new
instance id) or says goodbye gets a fresh registration (broker_session.py decides when), and the compute
loop is told to drop what it had queued (``RESET``), since the broker has requeued it.

It also counts, per rank endpoint, the ``forget_rank`` messages it passes on, so that a delivery to a rank
stuck on the compute loop learns at once that the rank is gone (``forgets``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from draftfeed.broker_session import BrokerSession
from draftfeed.net import SendBacklog, close_quietly
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    Bye,
    ErrorReply,
    ForgetRank,
    Goodbye,
    Heartbeat,
    Register,
    Registered,
    WorkerHeartbeat,
)
from draftfeed.security.curve import PeerKeys, make_client
from draftfeed.security.handshake import HandshakeWatch

log = logging.getLogger("draftfeed.worker")

STOP = b"stop"  # compute loop -> link: say bye and end
RESET = b"reset"  # link -> compute loop: registered afresh; drop queued dispatches and mappings


class _Refused(Exception):
    """The broker refused this worker's registration: the link ends and the worker exits."""


class BrokerLink(threading.Thread):
    def __init__(
        self,
        context: zmq.Context,
        broker: str,
        registration: Register,
        pipe_endpoint: str,
        stats: Callable[[], WorkerHeartbeat],
        keys: PeerKeys | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        super().__init__(name=f"draftfeed-broker-link-{registration.worker}", daemon=True)
        self._context = context
        self._broker = broker
        self._registration = registration
        self._worker = registration.worker
        self._pipe_endpoint = pipe_endpoint
        self._stats = stats
        self._keys = keys
        self._max_frame_bytes = max_frame_bytes
        self.session = BrokerSession()
        self.registered = threading.Event()
        self.refused: str | None = None
        self.failure: BaseException | None = None
        self.registrations = 0
        self._forgets: Counter[str] = Counter()
        self._backlog = SendBacklog()  # messages for a broker whose pipe is full
        self._watch: HandshakeWatch | None = None
        self._forgets_lock = threading.Lock()

    def forgets(self, endpoint: str) -> int:
        """How many ``forget_rank`` messages for the rank at ``endpoint`` the broker has sent so far (any thread)."""
        with self._forgets_lock:
            return self._forgets[endpoint]

    def run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        pipe = self._context.socket(zmq.PAIR)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.ROUTING_ID, self._registration.worker.encode())
            if self._keys is not None:
                make_client(dealer, self._keys.own, self._keys.broker)
            if self._max_frame_bytes is not None:
                dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            self._watch = HandshakeWatch(dealer, self._broker, "worker", secure=self._keys is not None)
            dealer.connect(self._broker)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.connect(self._pipe_endpoint)
            self._serve(dealer, pipe)
        except _Refused:
            log.error("worker %s: the broker refused registration: %s", self._worker, self.refused)
        except BaseException as exc:  # reported to the compute loop, which exits with it
            self.failure = exc
            log.exception("worker: broker link failed")
            self.registered.set()
        finally:
            if self._watch is not None:
                self._watch.close()
            close_quietly(dealer, pipe)

    def _serve(self, dealer: zmq.Socket, pipe: zmq.Socket) -> None:
        """The link's loop. One turn: wait up to the next heartbeat, settle the handshake watch, forward what the
        compute loop sends (return with a bye on stop), handle or pass on what the broker sends, and on each beat send
        a heartbeat with the worker's stats and register again if the broker fell silent."""
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        watch: HandshakeWatch | None = self._watch  # until registered: a refused handshake is why no broker answers
        if watch is not None:
            poller.register(watch.monitor, zmq.POLLIN)
        session = self.session
        self._register(dealer)
        next_beat = session.clock() + session.interval_s
        while True:
            events = dict(poller.poll(max(0, int((next_beat - session.clock()) * 1000))))
            if watch is not None:
                if watch.monitor in events:
                    watch.read()
                if watch.verdict is not None and not self.registered.is_set():
                    self.refused = watch.verdict
                    self.registered.set()
                    raise _Refused(watch.verdict)
                if self.registered.is_set():
                    poller.unregister(watch.monitor)
                    watch.close()
                    watch = self._watch = None
            if pipe in events:
                frames = pipe.recv_multipart(copy=False)
                if len(frames) == 1 and frames[0].bytes == STOP:
                    self._send(dealer, pack(Bye()), droppable=True)  # a broker out of reach forgets this worker anyway
                    return
                self._send(dealer, frames)
            if dealer in events:
                frames = dealer.recv_multipart(copy=False)
                session.heard()
                if not self._handle(frames, dealer, pipe):
                    pipe.send_multipart(frames, copy=False)
            if session.clock() >= next_beat:
                silence = session.silence()
                if self.registered.is_set() and silence is not None and session.may_introduce():
                    log.warning("worker %s: broker %s %s; registering again", self._worker, self._broker, silence)
                    self._register_again(dealer, pipe)
                self._flush(dealer)
                self._send(dealer, pack(self._stats()), droppable=True)
                next_beat = session.clock() + session.interval_s

    def _send(self, dealer: zmq.Socket, frames: list[Any], *, droppable: bool = False) -> None:
        """Never block on a broker out of reach (a registration afresh drops what waits: the broker requeued it all)."""
        self._backlog.send(dealer, frames, droppable=droppable)

    def _flush(self, dealer: zmq.Socket) -> None:
        self._backlog.flush(dealer)

    def _register(self, dealer: zmq.Socket) -> None:
        self.session.introducing()
        self._backlog.clear()
        self._send(dealer, pack(self._registration))

    def _register_again(self, dealer: zmq.Socket, pipe: zmq.Socket) -> None:
        """Register afresh, unless a registration is already on its way (each one makes the broker requeue)."""
        if not self.session.may_introduce():
            return
        pipe.send(RESET)
        self._register(dealer)

    def _handle(self, frames: list[Any], dealer: zmq.Socket, pipe: zmq.Socket) -> bool:
        """Handle what concerns the link itself; False passes the message on to the compute loop."""
        try:
            message, _ = unpack(frames, BACKEND_OUTBOUND)
        except MalformedMessage as exc:
            log.warning("worker: ignoring a malformed message from the broker: %s", exc)
            return True
        if isinstance(message, Registered):
            self.session.welcomed(message.instance, message.liveness)
            self.registrations += 1
            log.info("worker %s: registered with broker %s (instance %s)", self._worker, message.broker, message.instance)
            self.registered.set()
            return True
        if isinstance(message, ErrorReply):
            awaiting = self.session.introduced_at is not None
            if not self.registered.is_set() or (awaiting and message.code == "refused"):
                self.refused = message.message
                self.registered.set()
                raise _Refused(message.message)
            if message.code in ("unknown_peer", "forgotten"):
                log.warning("worker %s: %s; registering again", self._worker, message.message)
                self._register_again(dealer, pipe)
            else:
                log.warning("worker %s: the broker reports: %s", self._worker, message.message)
            return True
        if isinstance(message, Heartbeat):
            if self.session.restarted(message.instance):
                log.warning("worker %s: the broker restarted (instance %s); registering again", self._worker, message.instance)
                self._register_again(dealer, pipe)
            return True
        if isinstance(message, Goodbye):
            log.warning("worker %s: the broker is shutting down; registering with its successor", self._worker)
            self.session.introduced_at = None  # whatever registration went to the old instance is lost with it
            self._register_again(dealer, pipe)
            return True
        if isinstance(message, ForgetRank):
            with self._forgets_lock:
                self._forgets[message.reply_to] += 1
        return False
