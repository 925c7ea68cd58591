"""The worker's link to the broker, on its own thread so that heartbeats flow while the target computes.

It registers, passes the broker's messages to the compute loop through an inproc pipe and the compute
loop's messages (``done``, ``draining``) to the broker, and keeps the registration alive: a broker that
is silent for its liveness window, says it does not know this worker, restarts (a new instance id) or
says goodbye gets a fresh registration, and the compute loop is told to drop what it had queued
(``RESET``), since the broker has requeued it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from draftfeed.net import close_quietly
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    BACKEND_OUTBOUND,
    Bye,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Register,
    Registered,
    WorkerHeartbeat,
)
from draftfeed.security.curve import PeerKeys, make_client

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
        heartbeat_interval_s: float = 1.0,
        liveness: int = 5,
        keys: PeerKeys | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        super().__init__(name=f"draftfeed-broker-link-{registration.worker}", daemon=True)
        self._context = context
        self._broker = broker
        self._registration = registration
        self._pipe_endpoint = pipe_endpoint
        self._stats = stats
        self._keys = keys
        self._max_frame_bytes = max_frame_bytes
        self.interval_s, self.liveness = heartbeat_interval_s, liveness
        self.registered = threading.Event()
        self.refused: str | None = None
        self.failure: BaseException | None = None
        self.instance: str | None = None
        self.registrations = 0

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
            dealer.connect(self._broker)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.connect(self._pipe_endpoint)
            self._serve(dealer, pipe)
        except _Refused:
            log.error("worker %s: the broker refused registration: %s", self._registration.worker, self.refused)
        except BaseException as exc:  # reported to the compute loop, which exits with it
            self.failure = exc
            log.exception("worker: broker link failed")
            self.registered.set()
        finally:
            close_quietly(dealer, pipe)

    def _serve(self, dealer: zmq.Socket, pipe: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(pipe, zmq.POLLIN)
        self._send_registration(dealer)
        last_heard = time.monotonic()
        next_beat = last_heard + self.interval_s
        while True:
            events = dict(poller.poll(max(0, int((next_beat - time.monotonic()) * 1000))))
            if pipe in events:
                frames = pipe.recv_multipart(copy=False)
                if len(frames) == 1 and frames[0].bytes == STOP:
                    dealer.send_multipart(pack(Bye()))
                    return
                dealer.send_multipart(frames, copy=False)
            if dealer in events:
                frames = dealer.recv_multipart(copy=False)
                last_heard = time.monotonic()
                if not self._handle(frames, dealer, pipe):
                    pipe.send_multipart(frames, copy=False)
            now = time.monotonic()
            if now >= next_beat:
                window = self.interval_s * self.liveness
                if self.registered.is_set() and now - last_heard > window and now - self._registration_sent_at > window:
                    log.warning("worker %s: broker %s silent for %.1f s; registering again", self._registration.worker, self._broker, now - last_heard)
                    self._register_again(dealer, pipe)
                dealer.send_multipart(pack(self._stats()))
                next_beat = now + self.interval_s

    _registration_sent_at = 0.0
    _awaiting_registration = False

    def _send_registration(self, dealer: zmq.Socket) -> None:
        self._awaiting_registration, self._registration_sent_at = True, time.monotonic()
        dealer.send_multipart(pack(self._registration))

    def _register_again(self, dealer: zmq.Socket, pipe: zmq.Socket) -> None:
        """Register afresh, unless a registration is already on its way (each one makes the broker requeue)."""
        if self._awaiting_registration and time.monotonic() - self._registration_sent_at < self.interval_s * self.liveness:
            return
        pipe.send(RESET)
        self._send_registration(dealer)

    def _handle(self, frames: list[Any], dealer: zmq.Socket, pipe: zmq.Socket) -> bool:
        """Handle what concerns the link itself; False passes the message on to the compute loop."""
        try:
            message, _ = unpack(frames, BACKEND_OUTBOUND)
        except MalformedMessage as exc:
            log.warning("worker: ignoring a malformed message from the broker: %s", exc)
            return True
        if isinstance(message, Registered):
            self._awaiting_registration = False
            self.instance = message.instance
            self.interval_s, self.liveness = message.liveness.heartbeat_interval_s, message.liveness.liveness
            self.registrations += 1
            log.info("worker %s: registered with broker %s (instance %s)", self._registration.worker, message.broker, message.instance)
            self.registered.set()
            return True
        if isinstance(message, ErrorReply):
            if not self.registered.is_set() or (self._awaiting_registration and message.code == "refused"):
                self.refused = message.message
                self.registered.set()
                raise _Refused(message.message)
            elif message.code in ("unknown_peer", "forgotten"):
                log.warning("worker %s: %s; registering again", self._registration.worker, message.message)
                self._register_again(dealer, pipe)
            else:
                log.warning("worker %s: the broker reports: %s", self._registration.worker, message.message)
            return True
        if isinstance(message, Heartbeat):
            if self.instance is not None and message.instance != self.instance and not self._awaiting_registration:
                log.warning("worker %s: the broker restarted (instance %s); registering again", self._registration.worker, message.instance)
                self._register_again(dealer, pipe)
            return True
        if isinstance(message, Goodbye):
            log.warning("worker %s: the broker is shutting down; registering with its successor", self._registration.worker)
            self._awaiting_registration = False
            self._register_again(dealer, pipe)
            return True
        return False
