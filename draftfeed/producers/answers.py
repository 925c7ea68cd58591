"""The future a rank's caller holds for one request: the IO thread only hands the reply over, the caller finishes it.

The IO thread moves frames and nothing else (it also sends the rank's heartbeats: starve it and the broker
forgets the rank). When a reply arrives it settles the request's ``Answer`` with the reply as received (its
header and decoded tensor views); the work that turns a reply into what the caller asked for (device copies, the
compact form's lm_head matmul, a copy for the store's recorder) is ``finish``, run by the first thread that takes
the result (``result()`` or ``exception()``), once. Errors surface the same way: the pipeline's as they came, a
``finish`` that fails as a RemoteTargetError naming the request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, NamedTuple

from draftfeed.schemas.errors import RemoteTargetError


class Reply(NamedTuple):
    header: Any  # the reply message (a Result, an Ack, a ModelInfoReply, ...)
    tensors: dict[str, Any]


Finish = Callable[[Any, dict[str, Any]], Any]  # (reply header, tensors) -> the value the caller asked for


class Answer(Future):
    """Done (``done()``, callbacks, ``concurrent.futures.wait``) when the reply has arrived; valued by ``finish``."""

    def __init__(self, finish: Finish, request_id: int) -> None:
        super().__init__()
        self._finish = finish
        self._request_id = request_id
        self._finishing = threading.Lock()
        self._finished = False
        self._value: Any = None
        self._error: BaseException | None = None
        self.progressed_at: float | None = None  # when a piece of its answer last arrived (time.monotonic); waits.py

    @property
    def request_id(self) -> int:
        """The id it was first sent under (the table knows it by every id it had)."""
        return self._request_id

    def result(self, timeout: float | None = None) -> Any:
        self._take(timeout)
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        if error is not None:
            return error
        self._take(timeout)
        return self._error

    def _take(self, timeout: float | None) -> None:
        """Wait for the reply, then run ``finish`` on this thread unless a thread already has."""
        reply: Reply = super().result(timeout)
        with self._finishing:
            if self._finished:
                return
            try:
                self._value = self._finish(reply.header, reply.tensors)
            except Exception as exc:
                self._error = RemoteTargetError(f"reply to request {self._request_id} is unusable: {exc}")
            self._finished = True
            self._finish = _finished  # what it held (the request's tensors) is freed


def _finished(_header: Any, _tensors: dict[str, Any]) -> Any:
    raise AssertionError("an answer is finished once")


def settle(future: Future, value: Any, error: BaseException | None) -> None:
    """Complete a future unless its owner has cancelled it (an abandoned iterator does)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except InvalidStateError:
        pass
