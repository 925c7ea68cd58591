"""The worker's link to the broker, on its own thread so the link stays responsive while the target computes.

It registers, then passes every message from the broker to the compute loop through an inproc pipe,
and every message from the compute loop (``done``) back to the broker.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from draftfeed.net import close_quietly
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import BACKEND_OUTBOUND, ErrorReply, Register, Registered

log = logging.getLogger("draftfeed.worker")

STOP = b"stop"


class BrokerLink(threading.Thread):
    def __init__(self, context: zmq.Context, broker: str, registration: Register, pipe_endpoint: str) -> None:
        super().__init__(name=f"draftfeed-broker-link-{registration.worker}", daemon=True)
        self._context = context
        self._broker = broker
        self._registration = registration
        self._pipe_endpoint = pipe_endpoint
        self.registered = threading.Event()
        self.refused: str | None = None
        self.failure: BaseException | None = None

    def run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        pipe = self._context.socket(zmq.PAIR)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.ROUTING_ID, self._registration.worker.encode())
            dealer.connect(self._broker)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.connect(self._pipe_endpoint)
            dealer.send_multipart(pack(self._registration))
            self._serve(dealer, pipe)
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
        while True:
            events = dict(poller.poll())
            if pipe in events:
                frames = pipe.recv_multipart(copy=False)
                if len(frames) == 1 and frames[0].bytes == STOP:
                    return
                dealer.send_multipart(frames, copy=False)
            if dealer in events:
                frames = dealer.recv_multipart(copy=False)
                if self._is_control(frames):
                    continue
                pipe.send_multipart(frames, copy=False)

    def _is_control(self, frames: list[Any]) -> bool:
        """Handle registration answers here; everything else goes to the compute loop."""
        try:
            message, _ = unpack(frames, BACKEND_OUTBOUND)
        except MalformedMessage as exc:
            log.warning("worker: ignoring a malformed message from the broker: %s", exc)
            return True
        if isinstance(message, Registered):
            log.info("worker %s: registered with broker %s", self._registration.worker, message.broker)
            self.registered.set()
            return True
        if isinstance(message, ErrorReply) and not self.registered.is_set():
            self.refused = message.message
            self.registered.set()
            return True
        return False
