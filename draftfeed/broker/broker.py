"""The broker process: a ROUTER for training ranks, a ROUTER for workers, and the policy in state.py."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from typing import Any

import zmq

from draftfeed.broker.records import Outgoing
from draftfeed.broker.settings import BrokerSettings
from draftfeed.broker.state import BrokerState
from draftfeed.logs import RateLimitedLog
from draftfeed.net import bind, close_quietly, is_loopback, recv_routed
from draftfeed.schemas.errors import MalformedMessage, ProtocolVersionMismatch, UsageError
from draftfeed.schemas.frames import message_type, pack, unpack, unpack_raw
from draftfeed.schemas.messages import (
    BACKEND_INBOUND,
    FRONTEND_INBOUND,
    Bye,
    Computing,
    Done,
    Draining,
    ErrorReply,
    Heartbeat,
    Hello,
    ModelInfoQuery,
    Register,
    SetVocabMapping,
    StatusQuery,
    Submit,
    UpdateTarget,
    WeightsUpdated,
    Where,
    WorkerHeartbeat,
)
from draftfeed.schemas.protocol import DEFAULT_BACKEND, DEFAULT_FRONTEND
from draftfeed.security.curve import RANKS, WORKERS, BrokerKeys, RoleGate, make_server, peer_key, start_authenticator

log = logging.getLogger("draftfeed.broker")
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)
# Fair reading: each turn reads the two sockets in turn, this many messages at a time, so that neither side's
# traffic holds the other's heartbeats back; a turn ends when both are empty or after TURN_S, for the tick.
BATCH = 64
TURN_S = 0.05


class Broker:
    """Routes requests from ranks (frontend) to workers (backend); supervision bypasses it.

    ``bind()`` opens the sockets and returns the bound endpoints; ``run()`` serves until ``stop()``,
    then drains: nothing new is dispatched, what workers hold completes (up to ``settings.drain_timeout_s``),
    and every peer is told goodbye so that it reconnects to the next broker at once.

    With ``keys`` both sockets are CURVE servers: only rank keys get in at the frontend, only worker keys
    at the backend (docs/security.md). Without, anyone who reaches the ports gets in.
    """

    def __init__(
        self,
        frontend: str = DEFAULT_FRONTEND,
        backend: str = DEFAULT_BACKEND,
        *,
        name: str | None = None,
        settings: BrokerSettings | None = None,
        context: zmq.Context | None = None,
        keys: BrokerKeys | None = None,
    ) -> None:
        self.frontend_endpoint, self.backend_endpoint = frontend, backend
        self.state = BrokerState(name or f"{socket.gethostname()}-{os.getpid()}", settings)
        self.drain_timeout_s = self.state.settings.drain_timeout_s
        self._context = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._frontend: zmq.Socket | None = None
        self._backend: zmq.Socket | None = None
        self._bad_input = RateLimitedLog(log)
        self.keys = keys
        self._authenticator = None
        # The status document for readers on other threads (the metrics endpoint), built by the loop when one asks
        # (``fresh_status``), never otherwise: at thousands of peers it is not free.
        self.published_status: dict[str, Any] | None = None
        self._status_wanted = threading.Event()
        self._status_ready = threading.Event()
        self.running = False  # bound and routing (until it drains)

    def bind(self) -> tuple[str, str]:
        self._frontend = self._router()
        self._backend = self._router()
        if self.keys is not None:
            keys = self.keys
            self._authenticator = start_authenticator(
                self._context,
                {
                    RANKS: RoleGate("rank", lambda: keys.ranks, {"worker": keys.workers}),
                    WORKERS: RoleGate("worker", lambda: keys.workers, {"rank": keys.ranks}),
                },
            )
            make_server(self._frontend, keys.own, RANKS)
            make_server(self._backend, keys.own, WORKERS)
        self.frontend_endpoint = _listen(self._frontend, self.frontend_endpoint, "--frontend")
        self.backend_endpoint = _listen(self._backend, self.backend_endpoint, "--backend")
        if self.keys is None and not (is_loopback(self.frontend_endpoint) and is_loopback(self.backend_endpoint)):
            log.warning(
                "broker: INSECURE: listening on %s and %s without --secure: anyone who reaches these ports can register "
                "as a worker, submit batches and read supervision. Start it with --secure (docs/security.md) unless the "
                "network is closed to everyone else.",
                self.frontend_endpoint,
                self.backend_endpoint,
            )
        if self.keys is not None:
            log.info(
                "broker: secure: CURVE on both sockets; %d rank keys may connect at the rank port, %d worker keys at the worker port",
                len(self.keys.ranks),
                len(self.keys.workers),
            )
        return self.frontend_endpoint, self.backend_endpoint

    def _router(self) -> zmq.Socket:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # A send to a vanished peer raises instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A frame over the limit is refused by libzmq before it is allocated (the sender is disconnected).
        sock.setsockopt(zmq.MAXMSGSIZE, self.state.settings.max_frame_bytes)
        return sock

    def health(self) -> str | None:
        """None while it routes; else why not (for ``/health``)."""
        if not self.running:
            return "the broker is not routing yet (binding its sockets) or has stopped"
        if self.state.draining:
            return "the broker is draining: it hands out no more work"
        return None

    def stop(self) -> None:
        """Ask the loop to drain and exit (safe from a signal handler or another thread)."""
        self._stop.set()

    def fresh_status(self, timeout_s: float = 1.0) -> dict[str, Any] | None:
        """The whole status document as the loop builds it within ``timeout_s`` (any thread); the last one built if
        the loop does not answer in time, None before the first."""
        if self.running:
            self._status_ready.clear()
            self._status_wanted.set()
            self._status_ready.wait(timeout_s)
        return self.published_status

    def run(self) -> None:
        """Route until stopped. One turn: start draining if stop was asked (and return once nothing is at workers or
        the drain timeout passed), wait up to the next tick (at most 100 ms) for messages, handle what waits on the
        two sockets in turn (``BATCH`` at a time, for at most ``TURN_S``), and on each tick send what the policy's
        clock calls for (heartbeats, expiries, the notices gathered); build the status document if a reader asked."""
        if self._frontend is None:
            self.bind()
        assert self._frontend is not None and self._backend is not None
        poller = zmq.Poller()
        poller.register(self._frontend, zmq.POLLIN)
        poller.register(self._backend, zmq.POLLIN)
        interval = self.state.settings.heartbeat_interval_s
        log.info(
            "broker %s (instance %s): ranks on %s, workers on %s", self.state.name, self.state.instance, self.frontend_endpoint, self.backend_endpoint
        )
        next_tick = time.monotonic() + interval
        drain_deadline: float | None = None
        self.running = True
        try:
            while True:
                if self._stop.is_set() and drain_deadline is None:
                    log.info("broker: draining: %d requests at workers, waiting up to %.0f s", self.state.in_flight, self.drain_timeout_s)
                    self.state.start_draining()
                    drain_deadline = time.monotonic() + self.drain_timeout_s
                if drain_deadline is not None and (self.state.in_flight == 0 or time.monotonic() > drain_deadline):
                    self._send(self.state.goodbye())
                    log.info("broker: stopped with %d requests still at workers", self.state.in_flight)
                    return
                timeout_ms = max(0, int((next_tick - time.monotonic()) * 1000))
                if poller.poll(min(timeout_ms, 100)):
                    self._read_in_turn()
                if time.monotonic() >= next_tick:
                    self._send(self.state.on_tick())
                    next_tick = time.monotonic() + interval
                if self._status_wanted.is_set():
                    self._status_wanted.clear()
                    self.published_status = self.state.status()
                    self._status_ready.set()
        finally:
            self.running = False
            close_quietly(self._frontend, self._backend)
            if self._authenticator is not None:
                self._authenticator.stop()

    def _read_in_turn(self) -> None:
        """Read both sockets in turn, ``BATCH`` messages at a time, until both are empty or ``TURN_S`` has passed."""
        assert self._frontend is not None and self._backend is not None
        ends = time.monotonic() + TURN_S
        while True:
            read = self._read_waiting(self._frontend, self._on_frontend) + self._read_waiting(self._backend, self._on_backend)
            if read == 0 or time.monotonic() >= ends:
                return

    def _read_waiting(self, sock: zmq.Socket, handle: Any, budget: int = BATCH) -> int:
        """Read and handle what waits on ``sock``, up to ``budget`` messages, then send everything they call for in one
        pass, and the notices they gathered; how many were read."""
        out: list[Outgoing] = []
        read = 0
        while read < budget:
            try:
                peer, body = recv_routed(sock)
            except zmq.Again:
                break
            read += 1
            key = peer_key(body[0]) if self.keys is not None and body else None
            try:
                out.extend(handle(peer, body, key))
            except MalformedMessage as exc:
                kind = "protocol_version" if isinstance(exc, ProtocolVersionMismatch) else "malformed"
                out.append(self._wrong_port(sock, peer, body) or self._rejection(sock, peer, str(exc), kind))
            except Exception:  # a bug must not take the broker down with every rank's batches
                log.exception("broker: error handling a message from %r", peer)
        self._send(out)
        self._send(self.state.notices.flush())
        return read

    def _on_frontend(self, peer: bytes, body: list[Any], key: str | None) -> list[Outgoing]:
        message, raw, tensors = unpack_raw(body, FRONTEND_INBOUND)
        state = self.state
        if isinstance(message, Submit):
            return state.on_submit(peer, message, tensors, raw)
        if isinstance(message, Heartbeat):
            return state.on_rank_heartbeat(peer)
        if isinstance(message, Hello):
            return state.on_hello(peer, message, key)
        if isinstance(message, SetVocabMapping):
            return state.on_set_vocab_mapping(peer, message, tensors)
        if isinstance(message, ModelInfoQuery):
            return state.on_model_info(peer, message)
        if isinstance(message, StatusQuery):
            return state.on_status(peer, message)
        if isinstance(message, Where):
            return state.on_where(peer, message)
        if isinstance(message, UpdateTarget):
            return state.on_update_target(peer, message)
        if isinstance(message, Bye):
            return state.on_rank_bye(peer)
        raise MalformedMessage(f"unexpected message type {message.type!r} on the rank port")

    def _on_backend(self, peer: bytes, body: list[Any], key: str | None) -> list[Outgoing]:
        message, _tensors = unpack(body, BACKEND_INBOUND)
        state = self.state
        if isinstance(message, Done):
            return state.on_done(peer, message)
        if isinstance(message, Computing):
            return state.on_computing(peer, message)
        if isinstance(message, WorkerHeartbeat):
            return state.on_worker_heartbeat(peer, message)
        if isinstance(message, Register):
            return state.on_register(peer, message, key)
        if isinstance(message, Draining):
            return state.on_draining(peer)
        if isinstance(message, WeightsUpdated):
            return state.on_weights_updated(peer, message)
        if isinstance(message, Bye):
            return state.on_worker_bye(peer)
        raise MalformedMessage(f"unexpected message type {message.type!r} on the worker port")

    def _wrong_port(self, sock: zmq.Socket, peer: bytes, body: list[Any]) -> Outgoing | None:
        """A rank's message at the workers' port, or a worker's at the ranks' port: the answer that says which port."""
        ours, theirs = (FRONTEND_INBOUND, BACKEND_INBOUND) if sock is self._frontend else (BACKEND_INBOUND, FRONTEND_INBOUND)
        kind = message_type(body)
        if kind is None or kind in ours.types or kind not in theirs.types:
            return None
        if sock is self._frontend:
            message = (
                f"this is the broker's rank port ({self.frontend_endpoint}); workers connect to its worker port (--backend, {self.backend_endpoint})"
            )
            side = "frontend"
        else:
            message = (
                f"this is the broker's worker port ({self.backend_endpoint}); ranks connect to its rank port (--frontend, {self.frontend_endpoint})"
            )
            side = "backend"
        self.state.rejections["wrong_port"] += 1
        self._bad_input.warning(f"port:{side}", "broker: a %r message at the wrong port: %s", kind, message)
        return Outgoing(side, peer, pack(ErrorReply(message=message, code="wrong_port")))

    def _rejection(self, sock: zmq.Socket, peer: bytes, reason: str, kind: str = "malformed") -> Outgoing:
        side = "rank" if sock is self._frontend else "worker"
        self.state.rejections[kind] += 1
        self._bad_input.warning(f"{side}:{reason[:40]}", "broker: rejected a message from %s %r: %s", side, peer[:64], reason)
        return Outgoing("frontend" if sock is self._frontend else "backend", peer, pack(ErrorReply(message=f"rejected by the broker: {reason}")))

    def _send(self, outgoing: list[Outgoing]) -> None:
        """Send each message, after what notices wait for its peer (so a peer hears of a departure first)."""
        notices = self.state.notices
        for item in outgoing:
            sock = self._frontend if item.side == "frontend" else self._backend
            if notices:
                for notice in notices.take(item.side, item.peer):
                    self._send_one(sock, notice.peer, notice.frames)
            self._send_one(sock, item.peer, item.frames)

    def _send_one(self, sock: zmq.Socket | None, peer: bytes, frames: list[Any]) -> None:
        """One message, frame by frame with the flags as plain ints (pyzmq's send_multipart spends more on flag
        arithmetic than on sending the small messages the broker routes). The signature and the header are small
        bytes, sent copied (cheaper than a zmq.Frame for a few hundred bytes); tensor frames go as they came."""
        assert sock is not None
        try:
            sock.send(peer, _MORE)
            signature, header, *tensors = frames
            sock.send(signature, _MORE)
            sock.send(header, _MORE if tensors else _LAST)
            last = len(tensors) - 1
            for index, frame in enumerate(tensors):
                sock.send(frame, _LAST if index == last else _MORE, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer left; EAGAIN: its pipe is full
            self._bad_input.warning(f"send:{peer[:64]!r}", "broker: could not send to %r: %s", peer[:64], exc)


def _listen(sock: zmq.Socket, endpoint: str, flag: str) -> str:
    """Bind, or a UsageError that says why this endpoint cannot be listened on and what to change."""
    try:
        return bind(sock, endpoint)
    except zmq.ZMQError as exc:
        close_quietly(sock)
        hint = (
            "another broker (or another program) listens there: stop it, or choose another port"
            if exc.errno == errno.EADDRINUSE
            else "pass an address of this host, or * for all of them"
            if exc.errno == errno.EADDRNOTAVAIL
            else "write tcp://HOST:PORT"
        )
        raise UsageError(f"cannot listen on {endpoint} ({flag}): {exc.strerror}; {hint}") from None
