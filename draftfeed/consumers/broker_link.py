"""The worker's link to the broker, on its own thread so that heartbeats flow while the target computes.

It owns the DEALER to the broker and runs the worker's session (worker_session.py: registration, heartbeats,
registering again, refusals) in the peers' loop (peer_loop.py), the same loop a rank's IO thread runs. It
parses each message from the broker once: what concerns the link stays with the session, the rest goes to
the compute loop through the session's inbox. What the compute loop has for the broker comes on an inproc
pipe, which the loop polls beside the broker's socket. ``leave_now`` (any thread) says bye at once, for a compute
loop that is stuck (a tensor-parallel collective waiting for a machine that is gone): the broker requeues what
the worker held, charging nothing to it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import zmq

from draftfeed.consumers.worker_session import STOP, Inbox, WorkerSession
from draftfeed.logs import RateLimitedLog
from draftfeed.net import close_quietly
from draftfeed.peer_loop import run_peer_loop
from draftfeed.schemas.errors import MalformedMessage
from draftfeed.schemas.frames import unpack
from draftfeed.schemas.messages import BACKEND_OUTBOUND, Register, WorkerHeartbeat
from draftfeed.security.curve import PeerKeys, make_client
from draftfeed.security.handshake import HandshakeWatch

log = logging.getLogger("draftfeed.worker")


class BrokerLink(threading.Thread):
    def __init__(
        self,
        context: zmq.Context,
        broker: str,
        registration: Register,
        pipe_endpoint: str,
        stats: Callable[[], WorkerHeartbeat],
        inbox: Inbox,
        on_register: Callable[[], None] | None = None,
        keys: PeerKeys | None = None,
        max_frame_bytes: int | None = None,
    ) -> None:
        super().__init__(name=f"draftfeed-broker-link-{registration.worker}", daemon=True)
        self._context = context
        self._broker = broker
        self._worker = registration.worker
        self._pipe_endpoint = pipe_endpoint
        self._keys = keys
        self._max_frame_bytes = max_frame_bytes
        self.session = WorkerSession(registration, broker, stats, inbox, on_register=on_register)
        self._urgent_endpoint = f"inproc://draftfeed-leave-{uuid.uuid4().hex}"
        self.failure: BaseException | None = None
        self._bad_input = RateLimitedLog(log)

    @property
    def registered(self) -> threading.Event:
        return self.session.registered

    @property
    def refused(self) -> str | None:
        return self.session.refused

    def run(self) -> None:
        dealer = self._context.socket(zmq.DEALER)
        pipe = self._context.socket(zmq.PAIR)
        urgent = self._context.socket(zmq.PULL)
        try:
            urgent.setsockopt(zmq.LINGER, 0)
            urgent.bind(self._urgent_endpoint)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.ROUTING_ID, self._worker.encode())
            if self._keys is not None:
                make_client(dealer, self._keys.own, self._keys.broker)
            if self._max_frame_bytes is not None:
                dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
            watch = HandshakeWatch(dealer, self._broker, "worker", secure=self._keys is not None)
            dealer.connect(self._broker)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.connect(self._pipe_endpoint)
            self.session.register()
            readers = [(pipe, lambda: self._read_pipe(pipe)), (dealer, lambda: self._read_broker(dealer)), (urgent, lambda: self._read_pipe(urgent))]
            run_peer_loop(self.session, dealer, watch, readers)
        except BaseException as exc:  # reported to the compute loop, which exits with it
            self.failure = exc
            log.exception("worker: broker link failed")
            self.session.registered.set()
        finally:
            close_quietly(dealer, pipe, urgent)

    def leave_now(self) -> None:
        """Say bye to the broker now and end the link (any thread; the compute loop need not answer)."""
        sock = self._context.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(self._urgent_endpoint)
            sock.send(STOP, zmq.NOBLOCK)
        except zmq.ZMQError:  # the link has ended already
            pass
        finally:
            sock.close()

    def _read_pipe(self, pipe: zmq.Socket) -> bool:
        """What the compute loop has for the broker; False once it said stop."""
        while not self.session.ended:
            try:
                self.session.from_compute_loop(pipe.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        return not self.session.ended

    def _read_broker(self, dealer: zmq.Socket) -> bool:
        """What the broker sent, parsed once; False once the session has ended (a refused registration)."""
        while not self.session.ended:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                message, tensor_frames = unpack(frames, BACKEND_OUTBOUND)
            except MalformedMessage as exc:
                self.session.broker.heard()
                self._bad_input.warning(str(exc)[:40], "worker %s: ignoring a malformed message from the broker: %s", self._worker, exc)
                continue
            self.session.on_broker(message, tensor_frames)
        return not self.session.ended
