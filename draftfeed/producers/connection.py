"""A training rank's connection: one IO thread owns its sockets, the caller's threads get futures.

Sockets: a DEALER to the broker's frontend (requests, control, heartbeats) and a ROUTER bound on this
host (supervision arrives straight from workers). The caller packs each request on its own thread and hands
it to the IO thread through an inproc pipe; the IO thread only moves frames: it sends requests, resends them,
and settles one future per request with the reply as received (requests.py keeps them; answers.py runs the
caller's ``finish`` on the thread that takes the result). Errors from the pipeline, and the death of the IO
thread itself, surface on those futures, where the caller waits.

Every unanswered request (its frames are small: token ids and masks) and every vocab mapping a live
request names are kept. When the broker restarts, says it does not know or has forgotten this rank, says
goodbye, or falls silent for its liveness window, the rank says hello again (broker_session.py decides
when); a welcome that says the broker holds nothing of this rank (``resumed`` false) makes it send its
mappings, then every unanswered request, in order. A request refused because the broker lacks its mapping
(``unknown_mapping``) goes again behind that mapping. Each request is answered at most once: the first
answer that echoes the request's random token resolves it; any later one is dropped and counted.

Supervision a worker sends on a pair group (docs/data-planes.md) is received by pair_receivers.py, on a
nixl pair by nixl_receivers.py. When such an answer is lost with its group or pair, the rank asks for the request again under a new request id; the
request answers to both ids, so whichever answer comes first (the worker's frames fallback, a requeue, or
the new request) resolves it, and the rest are dropped as duplicates.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from draftfeed.broker_session import BrokerSession
from draftfeed.dataplane.tensor_codec import decode_tensors
from draftfeed.logs import RateLimitedLog
from draftfeed.net import SendBacklog, bind, close_quietly, host_identity, is_loopback, local_address_towards, send_to_thread
from draftfeed.producers.answers import Answer, Finish
from draftfeed.producers.nixl_receivers import NixlReceivers
from draftfeed.producers.pair_receivers import PairReceivers
from draftfeed.producers.requests import RequestKind, RequestTable
from draftfeed.producers.settings import RankSettings
from draftfeed.schemas.errors import MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
from draftfeed.schemas.frames import pack, unpack, with_request_id
from draftfeed.schemas.messages import (
    DATA_INBOUND,
    FRONTEND_OUTBOUND,
    Ack,
    Bye,
    DataPlaneOffer,
    ErrorReply,
    Failure,
    Goodbye,
    Heartbeat,
    Hello,
    ModelInfoReply,
    NixlOpen,
    NixlWant,
    PairClose,
    PairOpen,
    Result,
    ServiceWorkers,
    StatusReply,
    Welcome,
    WorkerGone,
    WorkerKeys,
)
from draftfeed.schemas.protocol import DEFAULT_MAX_FRAME_BYTES
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


@dataclass
class ConnectionStats:
    duplicates_dropped: int = 0
    foreign_dropped: int = 0
    malformed_dropped: int = 0
    resyncs: int = 0
    busy_retries: int = 0
    received_over_pair: int = 0
    lost_over_pair: int = 0  # answers lost with a failed pair group or nixl pair, asked for again
    received_over_nixl: int = 0


class Connection:
    """Requests and replies of one rank; thread-safe for callers, single-threaded on the sockets."""

    def __init__(
        self,
        broker: str,
        service: str,
        window: int,
        *,
        task: str = "eagle3",
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
        self.stats = ConnectionStats()
        self.session = BrokerSession()
        self._bad_input = RateLimitedLog(log)
        self._data_bind = data_endpoint or f"tcp://{local_address_towards(broker)}:*"
        self._context = zmq.Context()
        self._lock = threading.Lock()  # guards the pipe, which every thread writes
        self._broken: BaseException | None = None
        self._welcome = threading.Event()
        self._hello: Hello  # built by the IO thread once its data socket is bound
        self.data_plane = data_plane
        self.keys = keys
        self.max_result_bytes = max_result_bytes
        self._worker_keys: frozenset[bytes] = frozenset()  # the workers the broker vouches for (secure brokers)
        self._backlog = SendBacklog()  # messages for a broker whose pipe is full (it is out of reach)
        self.service_workers: int | None = None  # the ready workers of this rank's service, as the broker last said
        self.services: dict[str, int] = {}  # every service of the broker, with its ready workers, at the welcome
        self.has_workers = threading.Event()
        self.goodbye_at: float | None = None  # when the broker last said goodbye (None: since a broker answered)
        self._authenticator = None
        self.pairs = PairReceivers(
            data_plane.device if data_plane is not None else "cpu",
            self._on_pair_result,
            self._on_pair_lost,
            self._on_pair_closed,
            self._on_pair_refused,
            max_result_bytes,
        )
        self.nixl = NixlReceivers(
            self.rank_id,
            data_plane.device if data_plane is not None else "cpu",
            nixl_pool_bytes,
            self._on_nixl_result,
            self._on_pair_lost,
            self._on_pair_refused,
            lambda identity, frames: self._tell_io_thread([_TO_WORKER, identity, *frames]),
            max_result_bytes,
        )
        pipe_endpoint = f"inproc://draftfeed-rank-{uuid.uuid4().hex}"
        self._pipe = self._context.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)
        self._pipe.bind(pipe_endpoint)
        self._thread = threading.Thread(target=self._io_main, args=(pipe_endpoint,), name=f"draftfeed-io-{self.rank_id}", daemon=True)
        self._thread.start()
        if not self._welcome.wait(min(5.0, connect_timeout_s)):
            log.warning(
                "draftfeed rank %s: no broker has answered at %s yet; waiting up to %.0f s (connect_timeout)", self.rank_id, broker, connect_timeout_s
            )
        if not self._welcome.wait(max(0.0, connect_timeout_s - 5.0)) or self._broken is not None:
            error = self._broken if isinstance(self._broken, RemoteTargetError) else None
            if error is None:
                hint = (
                    "with keys, a secure broker that cannot read this rank's handshake looks like this too: check broker.key"
                    if keys is not None
                    else "is `draftfeed launch broker` running there, and is that its rank port (--frontend)?"
                )
                error = RemoteTargetError(f"no broker answered at {broker} within {connect_timeout_s:.0f} s (connect_timeout): {hint}")
            self.close()
            raise error

    # ------------------------------------------------------------ caller side
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
        with self._lock:
            self._hello = self._hello.model_copy(update={"expect": info})
            hello = self._hello
        self._tell_io_thread([_TO_BROKER, *pack(hello)])

    @property
    def data_endpoint(self) -> str:
        """Where this rank's data socket listens (workers connect there)."""
        return self._hello.data_endpoint

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    @property
    def peak_in_flight(self) -> int:
        return self.requests.peak_in_flight

    def broker_silent_s(self) -> float:
        return self.session.silent_s()

    def describe_broker(self) -> str:
        """The broker as this rank last heard it, in words: for waits and timeouts."""
        silent = self.session.silent_s()
        if self.goodbye_at is not None:
            return f"the broker at {self.broker} shut down {self.session.clock() - self.goodbye_at:.0f} s ago and no broker has answered since"
        if silent > self.session.window_s:
            return f"the broker at {self.broker} has not answered for {silent:.0f} s (its liveness window is {self.session.window_s:.0f} s)"
        return f"the broker was heard {silent:.1f} s ago"

    def close(self, timeout_s: float = 5.0) -> None:
        """Say goodbye to the broker, stop the IO thread, fail whatever is still outstanding."""
        if self._thread.is_alive():
            self._tell_io_thread([_STOP])
        self._thread.join(timeout_s)
        self.pairs.close()
        if not self._thread.is_alive():
            self.nixl.close()  # the IO thread's: only once it has ended
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
            for sock in (control, data, pipe):
                sock.setsockopt(zmq.LINGER, 0)
            # The window bounds requests; the HWMs leave room for it plus control messages only.
            control.setsockopt(zmq.SNDHWM, self.window + _CONTROL_SLACK)
            control.setsockopt(zmq.RCVHWM, self.window + _CONTROL_SLACK)
            control.setsockopt(zmq.ROUTING_ID, self.rank_id.encode())
            control.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_FRAME_BYTES)  # the broker sends headers and small tensors only
            data.setsockopt(zmq.RCVHWM, self.window + 1)
            # A frame over the limit is refused by libzmq before it is allocated (workers check first, see hello).
            data.setsockopt(zmq.MAXMSGSIZE, self.max_result_bytes)
            if self.keys is not None:
                make_client(control, self.keys.own, self.keys.broker)
                self._authenticator = start_authenticator(self._context, {DATA: RoleGate("worker of this service", lambda: self._worker_keys)})
                make_server(data, self.keys.own, DATA)
            with self._lock:
                self._hello = Hello(
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
            if self.keys is None and not is_loopback(self._hello.data_endpoint):
                log.warning(
                    "draftfeed rank %s: INSECURE: supervision arrives on %s without encryption, and anyone who reaches it "
                    "can connect; pass keys= (or set DRAFTFEED_KEYS) with a --secure broker (docs/security.md)",
                    self.rank_id,
                    self._hello.data_endpoint,
                )
            pipe.connect(pipe_endpoint)
            watch = HandshakeWatch(control, self.broker, "rank", secure=self.keys is not None)
            control.connect(self.broker)
            self._say_hello(control)
            self._serve(control, data, pipe, watch)
            try:
                control.send_multipart(pack(Bye()), flags=zmq.NOBLOCK)
                control.close(linger=500)  # let the bye go out; the broker frees this rank's state at once
            except zmq.Again:
                pass  # the broker is unreachable: it forgets this rank after its liveness window
        except BaseException as exc:
            log.exception("draftfeed rank %s: IO thread failed", self.rank_id)
            self._broken = exc
            self.requests.fail_all(RemoteTargetError(f"the connection's IO thread failed: {exc!r}"))
            self._welcome.set()
        finally:
            close_quietly(control, data, pipe)

    def _serve(self, control: zmq.Socket, data: zmq.Socket, pipe: zmq.Socket, watch: HandshakeWatch | None) -> None:
        """The IO thread's loop. One turn: wait up to the next heartbeat (1 ms while a nixl answer is awaited), settle
        the handshake watch, take what arrived on the data socket (answers), then the control socket (the broker),
        then the callers' commands on the pipe (return on stop), resend requests whose busy backoff is over, and on
        each beat send a heartbeat and say hello again if the broker fell silent."""
        poller = zmq.Poller()
        for sock in (control, data, pipe):
            poller.register(sock, zmq.POLLIN)
        if watch is not None:  # until the first welcome: a refused handshake is the reason no broker answers
            poller.register(watch.monitor, zmq.POLLIN)
        clock = self.session.clock
        next_beat = clock() + self.session.interval_s
        while True:
            # A nixl header waiting for its notification: poll NIXL every millisecond until it comes. Only then: NIXL keeps
            # notifications until asked, and asking progresses its connections, which is not free.
            waiting = self.nixl.waiting
            events = dict(poller.poll(max(0, int(min(next_beat - clock(), 0.001 if waiting else 0.05) * 1000))))
            if waiting:
                self.nixl.poll()
            if watch is not None:
                if watch.monitor in events:
                    watch.read()
                if watch.verdict is not None and not self._welcome.is_set():
                    self._broken = RemoteTargetError(watch.verdict)
                    self._welcome.set()
                    watch.close()
                    return
                if self._welcome.is_set():
                    poller.unregister(watch.monitor)
                    watch.close()
                    watch = None
            if data in events:
                self._drain(data, self._on_data)
            if control in events:
                self._drain(control, lambda frames: self._on_control(frames, control))
            if pipe in events and not self._take_commands(pipe, control, data):
                return
            for waiter in self.requests.due_again():
                self._send(control, waiter.frames)
            if clock() >= next_beat:
                self._flush(control)
                self._send(control, pack(Heartbeat()), droppable=True)
                silence = self.session.silence()
                if silence is not None and self.session.may_introduce():
                    if self.session.instance is not None:  # before any welcome, the constructor says what it waits for
                        log.warning("draftfeed rank %s: broker %s %s; saying hello again", self.rank_id, self.broker, silence)
                    self._say_hello(control)
                next_beat = clock() + self.session.interval_s

    def _take_commands(self, pipe: zmq.Socket, control: zmq.Socket, data: zmq.Socket) -> bool:
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
                waiter = self.requests.get(int.from_bytes(frames[1].bytes, "little"))
                if waiter is not None and waiter.frames is not None:  # else closed or failed meanwhile
                    self._send(control, waiter.frames)
            elif command == _ASK_AGAIN:
                self._ask_again(int.from_bytes(frames[1].bytes, "little"), frames[2].bytes.decode(), control)
            elif command == _TO_WORKER:
                try:
                    data.send_multipart(frames[1:], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass  # the worker's link is full or gone: it learns from its own failed send
            elif command == _TO_BROKER:
                self._send(control, frames[1:])

    def _send(self, control: zmq.Socket, frames: list[Any], *, droppable: bool = False) -> None:
        """Never block on a broker out of reach: a heartbeat or hello that cannot go now is dropped (the next one goes)."""
        self._backlog.send(control, frames, droppable=droppable)

    def _flush(self, control: zmq.Socket) -> None:
        self._backlog.flush(control)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[Any]], None]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handle(frames)
            except MalformedMessage as exc:
                self.stats.malformed_dropped += 1
                self._bad_input.warning(str(exc)[:40], "draftfeed rank %s: ignoring a malformed message: %s", self.rank_id, exc)

    # ------------------------------------------------------------ the broker
    def _say_hello(self, control: zmq.Socket) -> None:
        """Introduce this rank; a welcome that says the broker holds nothing of it makes it resend everything."""
        with self._lock:
            hello = self._hello
        self.session.introducing()
        self._send(control, pack(hello), droppable=True)

    def _hello_again(self, control: zmq.Socket) -> None:
        if self.session.may_introduce():
            self._say_hello(control)

    def _on_control(self, frames: list[Any], control: zmq.Socket) -> None:
        message, _tensors = unpack(frames, FRONTEND_OUTBOUND)
        self.session.heard()
        if isinstance(message, Heartbeat):
            if self.session.restarted(message.instance):
                self._hello_again(control)  # a broker that has not welcomed this rank
        elif isinstance(message, Welcome):
            first = self.session.instance is None
            self.session.welcomed(message.instance, message.liveness)
            self.goodbye_at = None
            self.services = dict(message.services)
            self._set_service_workers(message.services.get(self.service, 0))
            self._worker_keys = frozenset(key.encode() for key in message.worker_keys)
            if not message.resumed and not first:
                self._resync(control, message.instance)
            self._welcome.set()
        elif isinstance(message, ServiceWorkers):
            if message.service == self.service:
                self._set_service_workers(message.workers)
        elif isinstance(message, WorkerKeys):
            self._worker_keys = frozenset(key.encode() for key in message.keys)
        elif isinstance(message, WorkerGone):
            self.pairs.close_worker(message.worker, "the broker reports the worker gone")
            self.nixl.close_worker(message.worker, "the broker reports the worker gone")
        elif isinstance(message, Goodbye):
            log.warning("draftfeed rank %s: broker %s is shutting down; waiting for its successor", self.rank_id, message.instance)
            self.goodbye_at = self.session.clock()
            self._say_hello(control)  # whatever hello went to the old instance is lost with it
        elif isinstance(message, ErrorReply):
            self._on_error(message, control)
        elif isinstance(message, Ack):
            if message.request_id in self.requests:  # else the acknowledgement of a mapping sent again
                self.requests.resolve(message.request_id, header=message)
        elif isinstance(message, (ModelInfoReply, StatusReply)):
            self._resolve(message.request_id, header=message)

    def _on_error(self, message: ErrorReply, control: zmq.Socket) -> None:
        if message.code == "unknown_peer":
            self._hello_again(control)
        elif message.code == "forgotten":
            log.warning("draftfeed rank %s: %s", self.rank_id, message.message)
            self._hello_again(control)
        elif message.code == "unknown_mapping" and message.request_id is not None:
            self._send_behind_its_mapping(message.request_id, control)
        elif message.code == "busy" and message.request_id is not None:
            self.requests.busy(message.request_id)
            self.stats.busy_retries += 1
            log.info("draftfeed rank %s: %s", self.rank_id, message.message)
        elif message.code in ("unreachable", "mismatch", "over_limit", "wrong_port") or (message.request_id is None and not self._welcome.is_set()):
            error = RemoteTargetError(f"the broker at {self.broker} refused this rank: {message.message}")
            log.error("draftfeed rank %s: %s", self.rank_id, error)
            self._broken = error
            self.requests.fail_all(error)
            self._welcome.set()  # a rank still connecting raises this at once
        elif message.request_id is None:
            log.error("draftfeed rank %s: the broker reports: %s", self.rank_id, message.message)
        else:
            self._resolve(message.request_id, error=RemoteTargetError(f"the broker refused the request: {message.message}"))

    def _resync(self, control: zmq.Socket, instance: str) -> None:
        """A broker instance that holds nothing of this rank: send it the vocab mappings (the current one and any an
        unanswered request names), then every unanswered request, in order."""
        self._backlog.clear()  # everything unanswered goes now, in order
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
            self._send(control, waiter.frames)

    def _send_behind_its_mapping(self, request_id: int, control: zmq.Socket) -> None:
        """The broker lacks the mapping this request names: send the mapping, then the request again."""
        waiter = self.requests.get(request_id)
        if waiter is None or waiter.frames is None:
            return  # answered meanwhile
        mapping = self.requests.mapping(waiter.mapping) if waiter.mapping is not None else None
        if mapping is None or mapping.frames is None:
            self._resolve(request_id, error=RemoteTargetError(f"the broker lacks vocab mapping {waiter.mapping}, which this rank no longer holds"))
            return
        log.info("draftfeed rank %s: the broker lacks vocab mapping %s; sending it before request %d again", self.rank_id, waiter.mapping, request_id)
        self._send(control, mapping.frames)
        self._send(control, waiter.frames)

    def _set_service_workers(self, workers: int) -> None:
        self.service_workers = workers
        if workers > 0:
            self.has_workers.set()
        else:
            self.has_workers.clear()

    # ------------------------------------------------------------ answers from workers
    def _on_data(self, frames: list[Any]) -> None:
        message, tensor_frames = unpack(frames[1:], DATA_INBOUND)
        if isinstance(message, PairOpen):
            self.pairs.open(frames[0].bytes, message)
            return
        if isinstance(message, PairClose):
            self.pairs.worker_closed(message)
            self.nixl.worker_closed(message)
            return
        if isinstance(message, Result) and message.plane == "pair":
            self.pairs.receive(message)  # always, even for an answer no longer awaited: the group stays in step
            return
        if isinstance(message, NixlOpen):
            self.nixl.open(frames[0].bytes, message)
            return
        if isinstance(message, NixlWant):
            self.nixl.want(frames[0].bytes, message)
            return
        if isinstance(message, Result) and message.plane == "nixl":
            self.nixl.receive(message)
            return
        self._on_answer(message, lambda: decode_tensors(message.tensors, tensor_frames, max_message_bytes=self.max_result_bytes))

    def _on_answer(self, message: Result | Failure, tensors: Callable[[], dict[str, Any]]) -> None:
        verdict = self.requests.check(message.request_id, message.token)
        if verdict == "answered":
            self.stats.duplicates_dropped += 1
            log.debug("draftfeed rank %s: dropping a second answer to request %d", self.rank_id, message.request_id)
            return
        if verdict == "foreign":
            self.stats.foreign_dropped += 1
            self._bad_input.warning(
                "token",
                "draftfeed rank %s: dropping an answer to request %d with the wrong token (from %s)",
                self.rank_id,
                message.request_id,
                message.worker,
            )
            return
        if isinstance(message, Failure):
            error = RemoteTargetError(f"worker {message.worker} of service {self.service!r} could not serve the request: {message.message}")
            self._resolve(message.request_id, error=error)
        else:
            self._resolve(message.request_id, header=message, tensors=tensors())

    def _resolve(self, request_id: int, *, header: Any = None, tensors: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        if not self.requests.resolve(request_id, header=header, tensors=tensors, error=error):
            self.stats.duplicates_dropped += 1

    # ------------------------------------------------------------ pair groups (receiver threads, IO thread)
    def _on_pair_result(self, header: Result, tensors: dict[str, Any]) -> None:
        self.stats.received_over_pair += 1
        self._on_answer(header, lambda: tensors)

    def _on_nixl_result(self, header: Result, tensors: dict[str, Any]) -> None:
        self.stats.received_over_nixl += 1
        self._on_answer(header, lambda: tensors)

    def _on_pair_lost(self, header: Result, reason: str) -> None:
        self._tell_io_thread([_ASK_AGAIN, header.request_id.to_bytes(8, "little"), reason.encode()])

    def _on_pair_refused(self, header: Result, reason: str) -> None:
        """An answer announced on a pair group that this rank will not take (over its limits): a final error."""
        self._resolve(
            header.request_id, error=RemoteTargetError(f"worker {header.worker}'s answer to request {header.request_id} was refused: {reason}")
        )

    def _on_pair_closed(self, identity: bytes, message: PairClose) -> None:
        self._tell_io_thread([_TO_WORKER, identity, *pack(message)])

    def _ask_again(self, request_id: int, reason: str, control: zmq.Socket) -> None:
        """An answer was lost with its pair group: send the request again under a new id (IO thread)."""
        aliased = self.requests.alias(request_id)
        if aliased is None:
            return  # answered meanwhile (the worker's frames fallback came first)
        new_id, waiter = aliased
        self.stats.lost_over_pair += 1
        log.warning(
            "draftfeed rank %s: the answer to request %d was lost on a pair group (%s); asking again as request %d",
            self.rank_id,
            request_id,
            reason,
            new_id,
        )
        assert waiter.frames is not None  # packed before it was sent, and only what was sent is lost
        waiter.frames = with_request_id(waiter.frames, new_id)
        self._send(control, waiter.frames)
