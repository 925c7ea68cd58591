"""A training rank's connection: one IO thread owns its sockets and only moves frames; the caller's threads get futures.

Sockets: a DEALER to the broker's frontend (requests, control, heartbeats) and a ROUTER bound on this
host (supervision arrives straight from workers). The caller packs each request on its own thread and hands
it to the IO thread through an inproc pipe; the IO thread sends it, and settles the request's future with the
reply as received (requests.py keeps the requests; answers.py runs the caller's ``finish`` on the thread that
takes the result). Errors from the pipeline, and the death of the IO thread itself, surface on those futures,
where the caller waits.

What the rank says to the broker and makes of what it hears (hello, welcome, resync, busy, forgotten,
refusals, first-answer-wins) is its session (rank_session.py), which holds no socket; the IO thread runs it
in the peers' loop (peer_loop.py), the same loop a worker's broker link runs.

What arrives on the data socket goes to receivers.py: answers as frames, in pieces (dataplane/frames/rank_chunks.py),
on a pair group (dataplane/pair_group/rank.py) or a nixl pair (dataplane/nixl/rank.py). When an answer is lost on its
way (its group or pair failed, its worker left partway through its pieces), the rank asks for the request again
under a new request id; the request answers to both ids, so whichever answer comes first (the
worker's frames fallback, a requeue, or the new request) resolves it, and the rest are dropped as duplicates.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from draftfeed.net import bind, close_quietly, host_identity, is_loopback, local_address_towards, send_to_thread
from draftfeed.peer_loop import run_peer_loop
from draftfeed.producers.answers import Answer, Finish
from draftfeed.producers.rank_session import RankSession
from draftfeed.producers.receivers import Receivers
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.producers.settings import RankSettings
from draftfeed.schemas.errors import MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    FRONTEND_OUTBOUND,
    Bye,
    DataPlaneOffer,
    Hello,
)
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES, MAX_TRANSFER_CHUNK_BYTES
from draftfeed.security.curve import DATA, PeerKeys, RoleGate, make_client, make_server, start_authenticator
from draftfeed.security.handshake import HandshakeWatch

RANK_DEFAULTS = RankSettings()  # the rank's defaults, stated once in producers/settings.py

log = logging.getLogger("draftfeed.producer")

# Commands to the IO thread, on the pipe: the first frame names the command.
_STOP = b"stop"
_SEND = b"send"  # caller: send the request with this id (packed already)
_ASK_AGAIN = b"again"  # a pair receiver: this request's answer was lost; ask under a new id
_TO_WORKER = b"worker"  # a pair receiver: send these frames to this worker on the data socket
_TO_BROKER = b"broker"  # the caller: send these frames to the broker (a new hello)
# Control messages (hello, heartbeats, model info, mapping, status) that may be queued beside the window.
_CONTROL_SLACK = 16
# Messages read from the data socket in one turn of the loop: a stream of answer pieces never holds the broker's
# heartbeats back for longer than copying this many pieces takes (8 x 16 MiB by default).
DATA_MESSAGES_PER_TURN = 8


class Connection:
    """Requests and replies of one rank; thread-safe for callers, single-threaded on the sockets."""

    def __init__(
        self,
        broker: str,
        service: str,
        window: int,
        *,
        task: str,
        data_endpoint: str | None = None,
        connect_timeout_s: float = RANK_DEFAULTS.connect_timeout,
        data_plane: DataPlaneOffer | None = None,
        keys: PeerKeys | None = None,
        max_result_bytes: int = RANK_DEFAULTS.max_result_bytes,
        nixl_pool_bytes: int = RANK_DEFAULTS.nixl_pool_bytes,
    ) -> None:
        self.broker, self.service, self.window, self.task = broker, service, window, task
        self.requests = RequestTable(window)
        self.rank_id = f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.session = RankSession(self.rank_id, broker, service, self.requests, lambda worker: self.receivers.worker_gone(worker))
        self._data_bind = data_endpoint or f"tcp://{local_address_towards(broker)}:*"
        self._context = zmq.Context()
        self._lock = threading.Lock()  # guards the pipe, which every thread writes
        self._failure: BaseException | None = None  # why the IO thread died
        self.data_plane = data_plane
        self.keys = keys
        self.max_result_bytes = max_result_bytes
        self._authenticator = None
        self.receivers = Receivers(
            self.session,
            self.requests,
            data_plane.device if data_plane is not None else "cpu",
            nixl_pool_bytes,
            max_result_bytes,
            ask_again=lambda header, reason: self._tell_io_thread([_ASK_AGAIN, header.request_id.to_bytes(8, "little"), reason.encode()]),
            to_worker=lambda identity, frames: self._tell_io_thread([_TO_WORKER, identity, *frames]),
        )
        pipe_endpoint = f"inproc://draftfeed-rank-{uuid.uuid4().hex}"
        self._pipe = self._context.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)
        self._pipe.bind(pipe_endpoint)
        self._thread = threading.Thread(target=self._io_main, args=(pipe_endpoint,), name=f"draftfeed-io-{self.rank_id}", daemon=True)
        self._thread.start()
        self._await_welcome(connect_timeout_s)

    def _await_welcome(self, connect_timeout_s: float) -> None:
        welcome = self.session.welcome
        if not welcome.wait(min(5.0, connect_timeout_s)):
            log.warning(
                "draftfeed rank %s: no broker has answered at %s yet; waiting up to %.0f s (connect_timeout)",
                self.rank_id,
                self.broker,
                connect_timeout_s,
            )
        if not welcome.wait(max(0.0, connect_timeout_s - 5.0)) or self._broken is not None:
            error = self._broken if isinstance(self._broken, RemoteTargetError) else None
            if error is None:
                hint = (
                    "with keys, a secure broker that cannot read this rank's handshake looks like this too: check broker.key"
                    if self.keys is not None
                    else "is `draftfeed launch broker` running there, and is that its rank port (--frontend)?"
                )
                error = RemoteTargetError(f"no broker answered at {self.broker} within {connect_timeout_s:.0f} s (connect_timeout): {hint}")
            self.close()
            raise error

    # ------------------------------------------------------------ caller side
    @property
    def _broken(self) -> BaseException | None:
        return self._failure or self.session.broken

    def request(
        self,
        build: Callable[[int, int], list[Any]],
        finish: Finish,
        kind: RequestKind,
        *,
        mapping: str | None = None,
        timeout_s: float | None = None,
    ) -> Answer:
        """Send ``build(request_id, token)``; the future gets ``finish(reply_header, tensors)`` or the error.

        ``build`` runs here, on the caller's thread, and ``finish`` on the thread that takes the result: the IO
        thread only moves frames. ``mapping``: the vocab mapping (digest) a BATCH names or a SET_MAPPING sets.
        Tensors ``build`` packs are sent zero-copy: they must not change until the future is done."""
        if self._broken is not None:
            raise RemoteTargetError(f"the connection to {self.broker} is broken: {self._broken}")
        added = self.requests.add(finish, kind, mapping=mapping, timeout_s=timeout_s)
        if added is None:
            raise RemoteTargetTimeout(
                f"all {self.window} prefetch slots of service {self.service!r} stayed busy for {timeout_s} s: "
                "no worker answered; check `draftfeed status`"
            )
        request_id, waiter = added
        try:
            waiter.frames = build(request_id, waiter.token)
        except BaseException:
            self.requests.resolve(request_id, error=RemoteTargetError(f"request {request_id} could not be packed"))
            raise
        self._tell_io_thread([_SEND, request_id.to_bytes(8, "little")])
        return waiter.future

    def expect(self, info: Any) -> None:
        """Tell the broker which target this rank checked; it pins the service to it (also after a restart)."""
        assert self.session.hello is not None  # set before the first welcome, which the constructor waited for
        hello = self.session.hello = self.session.hello.model_copy(update={"expect": info})
        self._tell_io_thread([_TO_BROKER, *pack(hello)])

    @property
    def data_endpoint(self) -> str:
        """Where this rank's data socket listens (workers connect there)."""
        assert self.session.hello is not None
        return self.session.hello.data_endpoint

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self.requests.peak_in_flight

    def close(self, timeout_s: float = 5.0) -> None:
        """Say goodbye to the broker, stop the IO thread, fail whatever is still outstanding."""
        if self._thread.is_alive():
            self._tell_io_thread([_STOP])
        self._thread.join(timeout_s)
        self.receivers.close(io_thread_ended=not self._thread.is_alive())
        self.requests.fail_all(TargetClosed("the remote target was closed while this request was outstanding"))
        with self._lock:
            close_quietly(self._pipe)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def _tell_io_thread(self, frames: list[Any]) -> None:
        """Hand a command to the IO thread from any thread (the pipe is shared under the lock)."""
        with self._lock:
            if not self._pipe.closed:
                send_to_thread(self._pipe, frames, self._thread)

    # ------------------------------------------------------------ IO thread
    def _io_main(self, pipe_endpoint: str) -> None:
        control = self._context.socket(zmq.DEALER)
        data = self._context.socket(zmq.ROUTER)
        pipe = self._context.socket(zmq.PAIR)
        try:
            self._set_up(control, data)
            pipe.setsockopt(zmq.LINGER, 0)
            pipe.connect(pipe_endpoint)
            watch = HandshakeWatch(control, self.broker, "rank", secure=self.keys is not None)
            control.connect(self.broker)
            self.session.say_hello()
            readers = [
                (data, lambda: self._read_all(data, self.receivers.on_data, DATA_MESSAGES_PER_TURN)),
                (control, lambda: self._read_all(control, lambda frames: self.session.on_broker(unpack(frames, FRONTEND_OUTBOUND)[0]))),
                (pipe, lambda: self._take_commands(pipe, data)),
            ]
            run_peer_loop(self.session, control, watch, readers, self._wait_cap_s, self._poll_nixl)
            try:
                control.send_multipart(pack(Bye()), flags=zmq.NOBLOCK)
                control.close(linger=500)  # let the bye go out; the broker frees this rank's state at once
            except zmq.Again:
                pass  # the broker is unreachable: it forgets this rank after its liveness period
        except BaseException as exc:
            log.exception("draftfeed rank %s: IO thread failed", self.rank_id)
            self._failure = exc
            self.requests.fail_all(RemoteTargetError(f"the connection's IO thread failed: {exc!r}"))
            self.session.welcome.set()
        finally:
            close_quietly(control, data, pipe)

    def _set_up(self, control: zmq.Socket, data: zmq.Socket) -> None:
        """Options, keys and the data socket's bind; then the session's hello, which names where it is bound."""
        for sock in (control, data):
            sock.setsockopt(zmq.LINGER, 0)
        # The window bounds requests; the HWMs leave room for it plus control messages only.
        control.setsockopt(zmq.SNDHWM, self.window + _CONTROL_SLACK)
        control.setsockopt(zmq.RCVHWM, self.window + _CONTROL_SLACK)
        control.setsockopt(zmq.ROUTING_ID, self.rank_id.encode())
        control.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_FRAME_BYTES)  # the broker sends headers and small tensors only
        data.setsockopt(zmq.RCVHWM, self.window + 1)
        # A frame over the limit is refused by libzmq before it is allocated (workers check first, see hello): answers
        # come in pieces of at most MAX_TRANSFER_CHUNK_BYTES (dataplane/frames/chunks.py).
        data.setsockopt(zmq.MAXMSGSIZE, min(self.max_result_bytes, MAX_TRANSFER_CHUNK_BYTES))
        if self.keys is not None:
            make_client(control, self.keys.own, self.keys.broker)
            gate = RoleGate("worker of this service", lambda: self.session.worker_keys)
            self._authenticator = start_authenticator(self._context, {DATA: gate})
            make_server(data, self.keys.own, DATA)
        self.session.hello = Hello(
            rank=self.rank_id,
            service=self.service,
            data_endpoint=bind(data, self._data_bind),
            window=self.window,
            host=host_identity(),
            pid=os.getpid(),
            task=self.task,
            data_plane=self.data_plane,
            max_result_bytes=self.max_result_bytes,
        )
        if self.keys is None and not is_loopback(self.session.hello.data_endpoint):
            log.warning(
                "draftfeed rank %s: INSECURE: supervision arrives on %s without encryption, and anyone who reaches it "
                "can connect; pass keys= (or set DRAFTFEED_KEYS) with a --secure broker (docs/security.md)",
                self.rank_id,
                self.session.hello.data_endpoint,
            )

    def _wait_cap_s(self) -> float:
        """A nixl header waiting for its notification: wait a millisecond a turn, then ask NIXL (``_poll_nixl``)."""
        return 0.001 if self.receivers.nixl.waiting else 0.05

    def _poll_nixl(self) -> None:
        """Only while a header waits: NIXL keeps notifications until asked, and asking is not free."""
        if self.receivers.nixl.waiting:
            self.receivers.nixl.poll()

    def _take_commands(self, pipe: zmq.Socket, data: zmq.Socket) -> bool:
        """Carry out what the other threads asked for; False on stop."""
        while True:
            try:
                frames = pipe.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            command = frames[0].bytes
            if command == _STOP:
                return False
            if command == _SEND:
                self.session.send(int.from_bytes(frames[1].bytes, "little"))
            elif command == _ASK_AGAIN:
                self.session.ask_again(int.from_bytes(frames[1].bytes, "little"), frames[2].bytes.decode())
            elif command == _TO_WORKER:
                try:
                    data.send_multipart(frames[1:], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # the worker's link is full or gone: it learns from its own failed send
            elif command == _TO_BROKER:
                self.session.outbox.put(frames[1:])

    def _read_all(self, sock: zmq.Socket, handle: Callable[[list[Any]], None], limit: int | None = None) -> bool:
        """Hand every message ``sock`` holds (at most ``limit``: the rest next turn) to ``handle``; a malformed one is
        dropped, counted and logged."""
        for _ in itertools.repeat(None) if limit is None else range(limit):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            try:
                handle(frames)
            except MalformedMessage as exc:
                self.session.stats.malformed_dropped += 1
                self.session.bad_input.warning(str(exc)[:40], "draftfeed rank %s: ignoring a malformed message: %s", self.rank_id, exc)
        return True
