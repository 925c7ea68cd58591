"""A training rank's connection: one IO thread owns its sockets, the caller's threads get futures.

Sockets: a DEALER to the broker's frontend (requests, control) and a ROUTER bound on this host
(supervision arrives straight from workers). The caller hands fully packed messages to the IO
thread through an inproc pipe; the IO thread resolves one future per request. Errors from the
pipeline, and the death of the IO thread itself, surface on those futures, where the caller waits.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from draftfeed.net import bind, close_quietly, host_identity, local_address_towards
from draftfeed.schemas.errors import MalformedMessage, RemoteTargetError, RemoteTargetTimeout, TargetClosed
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import (
    DATA_INBOUND,
    FRONTEND_OUTBOUND,
    Ack,
    Bye,
    ErrorReply,
    Failure,
    Hello,
    ModelInfoReply,
    Result,
    StatusReply,
    Welcome,
)
from draftfeed.schemas.tensor_codec import decode_tensors

log = logging.getLogger("draftfeed.producer")

_STOP = b"stop"
# Control messages (hello, model info, mapping, status) that may be queued beside the window of requests.
_CONTROL_SLACK = 8


@dataclass
class _Waiter:
    future: Future
    finish: Callable[[Any, dict[str, Any]], Any]
    holds_window_slot: bool


class Connection:
    """Requests and replies of one rank; thread-safe for callers, single-threaded on the sockets."""

    def __init__(
        self,
        broker: str,
        service: str,
        window: int,
        *,
        data_endpoint: str | None = None,
        connect_timeout_s: float = 60.0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.broker, self.service, self.window = broker, service, window
        self.client_id = f"{host_identity()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._data_bind = data_endpoint or f"tcp://{local_address_towards(broker)}:*"
        self._context = zmq.Context()
        self._ids = itertools.count()
        self._waiters: dict[int, _Waiter] = {}
        self._lock = threading.Lock()
        self._window = threading.BoundedSemaphore(window)
        self._broken: BaseException | None = None
        self._welcome = threading.Event()
        self.in_flight = 0
        self.peak_in_flight = 0
        pipe_endpoint = f"inproc://draftfeed-rank-{uuid.uuid4().hex}"
        self._pipe = self._context.socket(zmq.PAIR)
        self._pipe.setsockopt(zmq.LINGER, 0)
        self._pipe.bind(pipe_endpoint)
        self._thread = threading.Thread(target=self._io_main, args=(pipe_endpoint,), name=f"draftfeed-io-{self.client_id}", daemon=True)
        self._thread.start()
        if not self._welcome.wait(connect_timeout_s) or self._broken is not None:
            reason = self._broken or f"no broker answered at {broker} within {connect_timeout_s:.0f} s"
            self.close()
            raise RemoteTargetError(f"cannot connect to the draftfeed broker: {reason}; is `draftfeed launch broker` running there?")

    # ------------------------------------------------------------ caller side
    def request(
        self,
        build: Callable[[int], list[Any]],
        finish: Callable[[Any, dict[str, Any]], Any],
        *,
        uses_window: bool,
        timeout_s: float | None = None,
    ) -> Future:
        """Send ``build(request_id)``; the future gets ``finish(reply_header, tensors)`` or the error."""
        if self._broken is not None:
            raise RemoteTargetError(f"the connection to {self.broker} is broken: {self._broken}")
        if uses_window and not self._window.acquire(timeout=timeout_s):
            raise RemoteTargetTimeout(
                f"all {self.window} prefetch slots of service {self.service!r} stayed busy for {timeout_s} s: "
                "no worker answered; check `draftfeed status`"
            )
        request_id = next(self._ids)
        future: Future = Future()
        with self._lock:
            self._waiters[request_id] = _Waiter(future, finish, uses_window)
            if uses_window:
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._pipe.send_multipart(build(request_id), copy=False)
        return future

    def close(self, timeout_s: float = 5.0) -> None:
        """Say goodbye to the broker, stop the IO thread, fail whatever is still outstanding."""
        with self._lock:
            if not self._pipe.closed and self._thread.is_alive():
                self._pipe.send_multipart(pack(Bye()))
                self._pipe.send(_STOP)
        self._thread.join(timeout_s)
        self._fail_all(TargetClosed("the remote target was closed while this request was outstanding"))
        with self._lock:
            close_quietly(self._pipe)
        self._context.term()

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
            control.setsockopt(zmq.ROUTING_ID, self.client_id.encode())
            data.setsockopt(zmq.RCVHWM, self.window + 1)
            data_endpoint = bind(data, self._data_bind)
            pipe.connect(pipe_endpoint)
            control.connect(self.broker)
            hello = Hello(
                client=self.client_id, service=self.service, data_endpoint=data_endpoint,
                window=self.window, host=host_identity(), pid=os.getpid(),
            )
            control.send_multipart(pack(hello))
            self._serve(control, data, pipe)
        except BaseException as exc:
            log.exception("draftfeed rank %s: IO thread failed", self.client_id)
            self._broken = exc
            self._fail_all(RemoteTargetError(f"the connection's IO thread failed: {exc!r}"))
            self._welcome.set()
        finally:
            close_quietly(control, data, pipe)

    def _serve(self, control: zmq.Socket, data: zmq.Socket, pipe: zmq.Socket) -> None:
        poller = zmq.Poller()
        for sock in (control, data, pipe):
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            if data in events:
                self._drain(data, self._on_data)
            if control in events:
                self._drain(control, self._on_control)
            if pipe in events:
                while True:
                    try:
                        frames = pipe.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) == 1 and frames[0].bytes == _STOP:
                        return
                    control.send_multipart(frames, copy=False)

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Callable[[list[Any]], None]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                handle(frames)
            except MalformedMessage as exc:
                log.warning("draftfeed rank: ignoring a malformed message: %s", exc)

    def _on_control(self, frames: list[Any]) -> None:
        message, tensors = unpack(frames, FRONTEND_OUTBOUND)
        if isinstance(message, Welcome):
            self._welcome.set()
        elif isinstance(message, ErrorReply):
            if message.request_id is None:
                log.error("draftfeed rank %s: the broker reports: %s", self.client_id, message.message)
            else:
                self._resolve(message.request_id, error=RemoteTargetError(f"the broker refused the request: {message.message}"))
        elif isinstance(message, (Ack, ModelInfoReply, StatusReply)):
            self._resolve(message.request_id, header=message, tensors={})

    def _on_data(self, frames: list[Any]) -> None:
        message, tensor_frames = unpack(frames[1:], DATA_INBOUND)
        if isinstance(message, Failure):
            self._resolve(
                message.request_id,
                error=RemoteTargetError(f"worker {message.worker} of service {self.service!r} could not serve the request: {message.message}"),
            )
        elif isinstance(message, Result):
            self._resolve(message.request_id, header=message, tensors=decode_tensors(message.tensors, tensor_frames))

    def _resolve(self, request_id: int, *, header: Any = None, tensors: dict[str, Any] | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
            if waiter is not None and waiter.holds_window_slot:
                self.in_flight -= 1
        if waiter is None:
            log.warning("draftfeed rank %s: dropping a reply to unknown request %d", self.client_id, request_id)
            return
        if waiter.holds_window_slot:
            self._window.release()
        value = None
        if error is None:
            try:
                value = waiter.finish(header, tensors or {})
            except Exception as exc:
                error = RemoteTargetError(f"reply to request {request_id} is unusable: {exc}")
        _settle(waiter.future, value, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiters = list(self._waiters.values())
            self._waiters.clear()
            self.in_flight -= sum(w.holds_window_slot for w in waiters)
        for waiter in waiters:
            if waiter.holds_window_slot:
                self._window.release()
            _settle(waiter.future, None, error)


def _settle(future: Future, value: Any, error: BaseException | None) -> None:
    """Complete a future unless its owner has cancelled it (an abandoned iterator does)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass
